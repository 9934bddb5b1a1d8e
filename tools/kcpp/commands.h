// The kcpp subcommands, grouped by file.  Each add_* registers its subcommands on `app`; a parsed
// subcommand stores what to run in `action`, which main() calls inside one error handler.
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "models/chat_template.h"

namespace kcpp::tools {

using Action = std::function<int()>;

void add_hub_commands(CLI::App& app, Action& action);    // hub_commands.cpp
void add_model_commands(CLI::App& app, Action& action);  // model_commands.cpp: generate
void add_train_command(CLI::App& app, Action& action);   // train_command.cpp: train (the main job)
// bench_layers.cpp: `kcpp bench --layers` and its options, on the bench subcommand whose --device,
// --quick and --json (main.cpp) it shares; sets `action` when --layers is given.
void add_bench_layers_options(CLI::App& bench, Action& action, const std::string& device, const bool& quick,
                              const std::string& json_path);

// A KernelConfig kernel_mapping given on the command line (--kernels): inline JSON, or the path of a
// JSON file (model_commands.cpp).
std::string kernel_mapping_text(const std::string& arg);

// A package this build made ("liger", "flash_attn"): under `given`, $KCPP_PACKAGES_DIR,
// <bin>/../kernels (the build tree) or, installed, <bin>/../lib/kcpp/kernels (KCPP_INSTALL_PACKAGE_DIR;
// train_command.cpp).
std::optional<std::filesystem::path> find_built_package(const std::string& given, const char* name);

// The chat template of a model folder: `given` (--chat-template: a tokenizer_config.json, or a
// template's text with the folder's special tokens), else the folder's tokenizer_config.json.
// `user` starts the error messages ("kcpp generate: --chat").  (model_commands.cpp)
models::ChatTemplate load_chat_template(const std::filesystem::path& model, const std::string& given, const std::string& user);

}  // namespace kcpp::tools
