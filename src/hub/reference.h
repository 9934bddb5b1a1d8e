// Kernel references: the strings a KernelConfig maps layer names to, and the device-keyed tables.
//
//   org/repo[@REV|@CONSTRAINT][:Layer]     a package repo on the hub
//   /abs/path[:Layer]                      a local package folder (manifest.json + build/)
//
// REV is a tag, branch or full commit id ("@v2.1.0", "@main", "@0a1b...(40 hex)"; default "main");
// CONSTRAINT a version range over the repo's vX.Y.Z tags ("@>=2.0,<3.0", "@^1.2", "@~1.4", "@1.2.3";
// see semver.h).  A full commit id (40 lower-case hex digits, as huggingface_hub recognises one) is
// a revision whatever its first character; other text after '@' that starts with an operator or a
// digit is a constraint, anything else a tag or branch name.  (Hugging Face's `kernels` takes the
// revision and the version in separate arguments; one string here needs this rule.)  Repo names follow
// the Hugging Face rules: letters, digits, '-', '_', '.', no leading or trailing '-' or '.', no "--"
// or "..", at most 96 characters per part.  Layer names are C identifiers.
//
// A mapping value is a reference, "" (the layer keeps its reference implementation), or a table
// keyed by device:
//   {"cuda": REF-or-entries, "rocm": ..., "metal": ..., "xpu": ..., "cpu": ...}
// where a CUDA value may be a list of entries {"ref": REF, "capability": ">=9.0"} (a constraint over
// MAJOR.MINOR compute capabilities); the first entry whose capability matches the GPU is used, and
// an entry without "capability" matches any GPU.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "hub/semver.h"
#include "hub/variant.h"

namespace kcpp::hub {

struct Reference {
  enum class Kind { Hub, Local };
  Kind kind = Kind::Hub;
  std::string repo;                       // "org/repo" (Hub)
  std::string path;                       // absolute folder (Local)
  std::string revision;                   // tag or branch; "main" when neither it nor a constraint is given
  std::optional<Constraint> constraint;   // version range over tags
  std::string layer;                      // "" when not given
  std::string text;                       // as written

  // Throws kcpp::Error: "bad kernel reference 'TEXT': WHY".
  static Reference parse(std::string_view text);
  bool is_local() const { return kind == Kind::Local; }
  std::string str() const { return text; }
};

// Checks "org/repo"; throws naming the problem.
void validate_repo_id(std::string_view repo);
// Why `part` is not a valid organization or repo name (called `what` in the message), or "".
std::string repo_part_problem(std::string_view part, std::string_view what);
// Why `rev` is not a valid tag or branch name (the git ref-name rules that matter here, as
// `git check-ref-format` applies them, plus no '/' at either end), or "".
std::string revision_problem(std::string_view rev);

struct MappingEntry {
  Backend device = Backend::CPU;
  std::optional<Constraint> capability;  // CUDA only
  std::optional<Reference> ref;          // nullopt: disabled ("")
};

// One layer's mapping value, parsed.
class LayerMapping {
 public:
  // `value` is a string or a device table; `context` names it in errors ("kernel_mapping.RMSNorm").
  static LayerMapping parse(const nlohmann::json& value, std::string_view context);
  // The entry for this device (and GPU capability, for CUDA), or nullptr when the mapping names
  // nothing for it.  An entry whose ref is nullopt means "explicitly disabled".
  const MappingEntry* select(Backend device, int cc_major = 0, int cc_minor = 0) const;
  const std::vector<MappingEntry>& entries() const { return entries_; }

 private:
  std::vector<MappingEntry> entries_;
  bool any_device_ = false;  // a plain string: applies to every device
};

}  // namespace kcpp::hub
