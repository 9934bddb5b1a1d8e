#include "nn/module.h"

#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "core/error.h"
#include "core/platform.h"
#include "hub/hub.h"
#include "hub/semver.h"

namespace kcpp::nn {

// ---- Slot ----------------------------------------------------------------------------------------

void Slot::set_kernel(std::optional<KernelLayer> k, uint32_t mode, std::string reason) {
  kernel_ = std::move(k);
  mode_ = mode;
  reason_ = std::move(reason);
  stats_ = {};
}

void Slot::clear_kernel(std::string reason) {
  kernel_.reset();
  reason_ = std::move(reason);
  stats_ = {};
}

namespace {
thread_local bool t_capturing = false;
}

CaptureScope::CaptureScope() : previous_(t_capturing) { t_capturing = true; }
CaptureScope::~CaptureScope() { t_capturing = previous_; }
bool CaptureScope::active() { return t_capturing; }

bool Slot::run(const KernelArgs& args, Device device, bool backward, uint32_t mode) {
  if (!kernel_ || (backward && !kernel_->has_backward())) {
    ++stats_.reference_calls;
    return false;
  }
  if (t_capturing) {
    if (!(kernel_->info().modes & kGraph)) {
      ++stats_.fallbacks;
      ++stats_.reference_calls;
      stats_.last_refusal = fmt::format("{} is not declared fit for CUDA graph capture (modes without graph)",
                                        kernel_->describe());
      return false;
    }
    mode |= kGraph;
  }
  const KernelStatus s = kernel_->supports(args, device, mode);
  if (!s.ok()) {
    ++stats_.fallbacks;
    ++stats_.reference_calls;
    stats_.last_refusal = fmt::format("{}: {}", status_name(s.status), s.message);
    return false;
  }
  if (backward) kernel_->backward(args, device, mode);
  else kernel_->forward(args, device, mode);
  ++stats_.kernel_calls;
  return true;
}

void Slot::count_refusal(const std::string& why) {
  ++stats_.reference_calls;
  if (!kernel_) return;
  ++stats_.fallbacks;
  stats_.last_refusal = why;
}

bool Slot::run_forward(const KernelArgs& args, Device device, bool for_backward) {
  const uint32_t mode = for_backward || !(mode_ & kTraining) ? mode_ : (mode_ & kGraph) | kInference;
  return run(args, device, false, mode);
}
bool Slot::run_backward(const KernelArgs& args, Device device) { return run(args, device, true, mode_); }

// ---- loading ---------------------------------------------------------------------------------------

KernelLoader hub_loader(std::shared_ptr<hub::Hub> hub) {
  KCPP_CHECK(hub != nullptr, "hub_loader: null hub");
  return [hub](const hub::Reference& ref) { return hub->load(ref); };
}

hub::HubConfig default_hub_config() {
  hub::HubConfig c = hub::HubConfig::from_env();
  if (const char* r = std::getenv("KCPP_HTTP_RETRIES"); !r || !*r) c.http.retries = 0;
  if (const char* t = std::getenv("KCPP_HTTP_TIMEOUT"); !t || !*t) c.http.connect_timeout_s = 5;
  return c;
}

KernelLoader default_loader(std::shared_ptr<hub::Hub> hub, LocalPackageFinder local) {
  KCPP_CHECK(hub != nullptr, "default_loader: null hub");
  struct State {
    std::mutex mu;
    std::map<std::string, std::string> hub_refused;  // "org/repo@range" -> why the hub could not serve it
    std::string endpoint_down;                        // why the endpoint did not answer, once it did not
    std::shared_ptr<hub::Hub> local_hub;              // allow_all_kernels: this build's packages are unsigned
  };
  auto st = std::make_shared<State>();
  const std::string org_prefix = std::string(kDefaultKernelOrg) + "/";
  return [hub, local = std::move(local), st, org_prefix](const hub::Reference& ref) -> hub::LoadedKernel {
    if (ref.is_local() || !ref.repo.starts_with(org_prefix)) return hub->load(ref);
    const std::string package = ref.repo.substr(org_prefix.size());
    const std::string key = ref.repo + "@" + (ref.constraint ? ref.constraint->text() : ref.revision);
    std::string why;
    {
      std::lock_guard<std::mutex> g(st->mu);
      if (auto it = st->hub_refused.find(key); it != st->hub_refused.end()) why = it->second;
      else if (!st->endpoint_down.empty()) why = st->endpoint_down;
    }
    if (why.empty()) {
      try {
        return hub->load(ref);
      } catch (const hub::HubUnavailable& e) {
        why = e.what();
        std::lock_guard<std::mutex> g(st->mu);
        // Later references are not asked for: their reason is this request's failure, said as such.
        if (e.unreachable()) st->endpoint_down = "the hub did not answer an earlier request, so it is not asked again (" + why + ")";
        st->hub_refused[key] = why;
      } catch (const hub::Untrusted& e) {
        why = e.what();
        std::lock_guard<std::mutex> g(st->mu);
        st->hub_refused[key] = why;
      }
    }
    const std::optional<std::filesystem::path> folder = local ? local(package) : std::nullopt;
    if (!folder)
      throw KeepReference(fmt::format("{}: the hub cannot supply it ({}) and this build has no package {}", ref.text,
                                      why, package));
    std::shared_ptr<hub::Hub> lh;
    {
      std::lock_guard<std::mutex> g(st->mu);
      if (!st->local_hub) {
        hub::HubConfig c = hub->config();
        c.allow_all_kernels = true;
        c.lock_file.reset();  // a lock pins hub revisions; this build's folders are not among them
        st->local_hub = std::make_shared<hub::Hub>(std::move(c));
      }
      lh = st->local_hub;
    }
    const hub::Reference local_ref =
        hub::Reference::parse(folder->string() + (ref.layer.empty() ? "" : ":" + ref.layer));
    hub::LoadedKernel k = lh->load(local_ref);
    if (ref.constraint && !ref.constraint->matches(hub::Version::parse(k.info.manifest.version)))
      throw KeepReference(fmt::format("{}: the hub cannot supply it ({}), and this build's {} is version {}", ref.text,
                                      why, package, k.info.manifest.version));
    k.substituted = fmt::format("this build's {} {} ({}), as the hub cannot supply {}: {}", package,
                                k.info.manifest.version, folder->string(), key, why);
    return k;
  };
}

namespace {

hub::Backend backend_of(Device d) { return d.is_cuda() ? hub::Backend::CUDA : hub::Backend::CPU; }

// The layer of `loaded` a slot with `contract` uses: the reference's :Layer, or else the package's
// only layer implementing the contract.
KernelLayer pick_layer(const hub::LoadedKernel& loaded, const hub::Reference& ref, const std::string& layer_name,
                       const std::string& contract) {
  std::shared_ptr<const hub::LoadedPackage> pkg = loaded.package;
  std::optional<KernelLayer> k;
  if (!ref.layer.empty()) {
    k = KernelLayer::find(pkg, ref.layer);
  } else {
    std::vector<std::string> matching;
    const kcpp_package& t = pkg->table();
    for (int32_t i = 0; i < t.num_layers; ++i)
      if (contract == t.layers[i].contract) matching.emplace_back(t.layers[i].name);
    KCPP_CHECK(matching.size() == 1, "kernel_mapping.{}: '{}' names no layer, and the package has {} implementing {}{}{}",
               layer_name, ref.text, matching.empty() ? "none" : std::to_string(matching.size()), contract,
               matching.empty() ? "" : ": ", fmt::join(matching, ", "));
    k = KernelLayer::find(pkg, matching[0]);
  }
  KCPP_CHECK(contract == k->info().contract,
             "kernel_mapping.{}: {} implements {}, but the {} slot needs {}", layer_name, k->describe(),
             k->info().contract, layer_name, contract);
  return *k;
}

}  // namespace

// ---- Module ----------------------------------------------------------------------------------------

KernelizeReport Module::kernelize(const KernelConfig& config, uint32_t mode, Device device, const KernelLoader& loader) {
  mode_name(mode);  // validates the bits
  KCPP_CHECK(loader != nullptr, "kernelize: no kernel loader");
  int cc_major = 0, cc_minor = 0;
  if (device.is_cuda()) {
    static const PlatformInfo platform = detect_platform();
    for (const GpuInfo& g : platform.gpus)
      if (g.index == device.index) cc_major = g.cc_major, cc_minor = g.cc_minor;
  }
  // Slots grouped by layer name, in the order the model lists them.
  std::vector<std::string> order;
  std::map<std::string, std::vector<Slot*>> by_layer;
  visit_slots([&](Slot& s) {
    auto [it, fresh] = by_layer.try_emplace(s.layer_name());
    if (fresh) order.push_back(s.layer_name());
    it->second.push_back(&s);
  });
  KernelizeReport report;
  std::map<std::string, hub::LoadedKernel> loaded;  // by reference text: each package loads once
  for (const std::string& name : order) {
    const std::vector<Slot*>& slots = by_layer[name];
    const std::string& contract = slots.front()->contract();
    std::string why;
    const std::optional<hub::MappingEntry> e =
        config.select(name, mode, backend_of(device), cc_major, cc_minor, &why);
    std::optional<KernelLayer> kernel;
    std::string reason;
    if (!e) {
      reason = fmt::format("no mapping for {} in {} on {}", name, mode_name(mode), device.str());
    } else if (!e->ref) {
      reason = why;  // "kernel_mapping.X disables it"
    } else {
      auto it = loaded.find(e->ref->text);
      if (it == loaded.end()) {
        try {
          it = loaded.emplace(e->ref->text, loader(*e->ref)).first;
        } catch (const hub::HubDisabled& d) {
          reason = fmt::format("hub kernels are disabled (USE_HUB_KERNELS): {}", d.what());
        } catch (const KeepReference& k) {
          reason = k.what();
        } catch (const Error& err) {
          KCPP_FAIL("kernel_mapping.{}: cannot load '{}': {}", name, e->ref->text, err.what());
        }
      }
      if (it != loaded.end()) {
        KernelLayer k = pick_layer(it->second, *e->ref, name, contract);
        const uint32_t need = mode & (kInference | kTraining | kGraph);
        if (!k.runs_on(device)) {
          reason = fmt::format("{} does not run on {} ({})", k.describe(), device.str(), why);
        } else if ((k.info().modes & need) != need) {
          reason = fmt::format("{} is not for {} mode ({})", k.describe(), mode_name(mode), why);
        } else if ((mode & kTraining) && !k.has_backward()) {
          reason = fmt::format("{} has no backward, needed in training ({})", k.describe(), why);
        } else {
          reason = why;
          kernel = k;
        }
        if (!it->second.substituted.empty()) reason += "; " + it->second.substituted;
      }
    }
    for (Slot* s : slots) {
      if (kernel) s->set_kernel(kernel, mode, reason);
      else s->clear_kernel(reason);
    }
    report.entries.push_back({name, static_cast<int>(slots.size()), kernel ? kernel->describe() : "", reason});
  }
  for (const std::string& l : config.layers())
    if (!by_layer.count(l)) report.unused.push_back(l);
  config_ = config;
  loader_ = loader;
  device_ = device;
  mode_ = mode;
  return report;
}

void Module::unkernelize() {
  visit_slots([](Slot& s) { s.clear_kernel(); });
  config_.reset();
}

void Module::train() {
  const uint32_t m = (mode_ & kGraph) | kTraining;
  if (config_) kernelize(*config_, m, device_, loader_);
  mode_ = m;
}

void Module::eval() {
  const uint32_t m = (mode_ & kGraph) | kInference;
  if (config_) kernelize(*config_, m, device_, loader_);
  mode_ = m;
}

std::string Module::kernel_report() {
  struct Row {
    std::string kernel, reason, last_refusal;
    int slots = 0;
    int64_t kernel_calls = 0, reference_calls = 0, fallbacks = 0;
  };
  std::vector<std::string> order;
  std::map<std::string, Row> rows;
  visit_slots([&](Slot& s) {
    auto [it, fresh] = rows.try_emplace(s.layer_name());
    if (fresh) order.push_back(s.layer_name());
    Row& r = it->second;
    ++r.slots;
    r.kernel = s.kernel() ? s.kernel()->describe() : "reference";
    r.reason = s.reason();
    r.kernel_calls += s.stats().kernel_calls;
    r.reference_calls += s.stats().reference_calls;
    r.fallbacks += s.stats().fallbacks;
    if (!s.stats().last_refusal.empty()) r.last_refusal = s.stats().last_refusal;
  });
  std::string out;
  for (const std::string& name : order) {
    const Row& r = rows[name];
    out += fmt::format("{:<18} x{:<3} {}  [{}]  kernel calls {}, reference calls {}, fallbacks {}{}\n", name, r.slots,
                       r.kernel, r.reason, r.kernel_calls, r.reference_calls, r.fallbacks,
                       r.last_refusal.empty() ? "" : " (last: " + r.last_refusal + ")");
  }
  return out;
}

std::string KernelizeReport::str() const {
  std::string out;
  for (const Entry& e : entries)
    out += fmt::format("{:<18} x{:<3} {}  [{}]\n", e.layer, e.slots, e.kernel.empty() ? "reference" : e.kernel, e.reason);
  for (const std::string& u : unused) out += fmt::format("{:<18} (mapped, but the model has no such layer)\n", u);
  return out;
}

}  // namespace kcpp::nn
