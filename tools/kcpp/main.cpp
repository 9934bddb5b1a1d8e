// kcpp: the command-line tool.  `kcpp info` reports the platform; `kcpp bench --ceilings`
// measures the ceilings that benchmark figures are quoted against, `kcpp bench --layers` every layer
// slot with the reference and kernelized (bench_layers.cpp); the hub commands (keygen, trust,
// package, serve, download, versions, show, lock, verify) are in hub_commands.cpp; `kcpp generate`
// in model_commands.cpp.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ceilings.h"
#include "commands.h"
#include "core/error.h"
#include "core/platform.h"
#include "ops/threads.h"

namespace {

int run_info(bool json) {
  const kcpp::PlatformInfo p = kcpp::detect_platform();
  const kcpp::ops::ThreadPolicy t = kcpp::ops::thread_policy();
  if (json) {
    auto j = nlohmann::json::parse(kcpp::platform_json(p));
    j["cpu_threads"] = {{"threads", t.threads}, {"blas", t.blas}, {"blas_core", t.blas_core},
                        {"blas_threading", t.blas_threading}};
    std::fputs((j.dump(2) + "\n").c_str(), stdout);
  } else {
    std::fputs(kcpp::format_platform(p).c_str(), stdout);
    std::fputs(("CPU work: " + kcpp::ops::thread_policy_str(t) + "\n").c_str(), stdout);
  }
  return 0;
}

int run_ceilings(const std::string& device_arg, bool quick, const std::string& json_path) {
  std::vector<kcpp::Device> devices;
  if (device_arg == "all") {
    devices.push_back(kcpp::Device::cpu());
    for (int i = 0; i < kcpp::cuda_device_count(); ++i) devices.push_back(kcpp::Device::cuda(i));
  } else if (device_arg == "auto") {
    devices.push_back(kcpp::cuda_device_count() > 0 ? kcpp::Device::cuda(0) : kcpp::Device::cpu());
  } else {
    devices.push_back(kcpp::parse_device(device_arg));
  }
  nlohmann::json out = nlohmann::json::array();
  fmt::print("{:<10} {:<22} {:>10} {:>12} {:>10}\n", "device", "ceiling", "median ms", "GB/s", "TFLOP/s");
  for (const kcpp::Device& d : devices) {
    for (const auto& c : kcpp::tools::measure_ceilings(d, quick)) {
      fmt::print("{:<10} {:<22} {:>10.3f} {:>12} {:>10}\n", d.str(), c.name, c.ms,
                 c.gbps > 0 ? fmt::format("{:.1f}", c.gbps) : "", c.tflops > 0 ? fmt::format("{:.2f}", c.tflops) : "");
      out.push_back({{"device", d.str()}, {"name", c.name}, {"ms", c.ms}, {"GBps", c.gbps}, {"TFLOPs", c.tflops}});
    }
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kcpp: optimized transformer kernels from a hub, in C++ (kernels.cpp)"};
  app.require_subcommand(1);

  auto* info = app.add_subcommand("info", "Print the platform report: OS, CPU, CUDA driver and runtime, GPUs");
  bool info_json = false;
  info->add_flag("--json", info_json, "Print JSON instead of text");

  auto* bench = app.add_subcommand("bench", "Run benchmarks");
  bool ceilings = false, quick = false;
  std::string device = "auto", json_path;
  bench->add_flag("--ceilings", ceilings, "Measure copy bandwidth and bf16/f32 GEMM rates");
  bench->add_option("--device", device, "cpu, cuda, cuda:N, auto (the GPU if any) or all")->capture_default_str();
  bench->add_flag("--quick", quick, "Smaller sizes (smoke test)");
  bench->add_option("--json", json_path, "Also write the figures to this JSON file");

  kcpp::tools::Action action;
  kcpp::tools::add_bench_layers_options(*bench, action, device, quick, json_path);

  kcpp::tools::add_hub_commands(app, action);
  kcpp::tools::add_model_commands(app, action);
  kcpp::tools::add_train_command(app, action);

  CLI11_PARSE(app, argc, argv);
  try {
    if (action) return action();
    if (*info) return run_info(info_json);
    if (*bench) {
      if (!ceilings) {
        std::fputs("kcpp bench: say what to run: --ceilings or --layers\n", stderr);
        return 2;
      }
      return run_ceilings(device, quick, json_path);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kcpp: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
