// The kcpp subcommands, grouped by file.  Each add_* registers its subcommands on `app`; a parsed
// subcommand stores what to run in `action`, which main() calls inside one error handler.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace kcpp::tools {

using Action = std::function<int()>;

void add_hub_commands(CLI::App& app, Action& action);    // hub_commands.cpp
void add_model_commands(CLI::App& app, Action& action);  // model_commands.cpp: generate
void add_train_command(CLI::App& app, Action& action);   // train_command.cpp: train (the main job)

}  // namespace kcpp::tools
