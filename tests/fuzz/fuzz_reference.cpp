// Hub references and version constraints (src/hub/reference.h, src/hub/semver.h).
//
// The first line of the input is read as a kernel reference, a version constraint and a version;
// the second line, if any, as a second version.  Properties: a version prints to text that parses
// back to it; ordering is a total order (reflexive, antisymmetric); the constraints that name a
// version exactly ("X", "=X", ">=X", "<=X", "^X", "~X", "~=X") admit it; a hub reference's repo id
// is valid and its layer an identifier.
#include <string>

#include "fuzz.h"
#include "hub/reference.h"
#include "hub/semver.h"

using namespace kcpp;
using namespace kcpp::hub;

namespace {

void check_version(std::string_view s) {
  const std::optional<Version> tried = Version::try_parse(s);
  std::optional<Version> v;
  try {
    v = Version::parse(s);
  } catch (const Error&) {
  }
  KCPP_FUZZ_EXPECT(tried.has_value() == v.has_value(), "try_parse and parse disagree on '{}'", s);
  if (!v) return;
  const Version back = Version::parse(v->str());
  KCPP_FUZZ_EXPECT(back == *v && back.str() == v->str(), "'{}' prints as '{}', which reads back as '{}'", s, v->str(),
                   back.str());
  KCPP_FUZZ_EXPECT((*v <=> *v) == 0, "'{}' is not equal to itself", s);
  if (v->is_prerelease()) return;  // a pre-release is admitted only by comparators naming one
  Version core = *v;
  core.build.clear();  // build metadata is not part of a constraint
  for (const char* op : {"", "=", "==", ">=", "<=", "^", "~", "~="}) {
    const std::string c = op + core.str();
    KCPP_FUZZ_EXPECT(Constraint::parse(c).matches(core), "'{}' does not admit {}", c, core.str());
  }
}

void check_constraint(std::string_view s, const std::optional<Version>& a, const std::optional<Version>& b) {
  Constraint c;
  try {
    c = Constraint::parse(s);
  } catch (const Error&) {
    return;
  }
  std::vector<Version> candidates;
  for (const char* t : {"0.0.0", "0.1.0", "1.0.0-rc.1", "1.0.0", "1.2.3", "2.0.0", "18446744073709551614.0.0"})
    candidates.push_back(Version::parse(t));
  if (a) candidates.push_back(*a);
  if (b) candidates.push_back(*b);
  const std::optional<Version> best = c.best(candidates);
  for (const Version& v : candidates)
    if (c.matches(v)) KCPP_FUZZ_EXPECT(best && *best >= v, "'{}': best() is not the largest match {}", s, v.str());
  if (best) KCPP_FUZZ_EXPECT(c.matches(*best), "'{}': best() {} does not match", s, best->str());
}

void check_reference(std::string_view s) {
  Reference r;
  try {
    r = Reference::parse(s);
  } catch (const Error&) {
    return;
  }
  KCPP_FUZZ_EXPECT(r.str() == s, "a reference keeps its text");
  if (!r.layer.empty()) KCPP_FUZZ_EXPECT(Reference::parse(std::string("/x:") + r.layer).layer == r.layer, "layer '{}'", r.layer);
  if (r.is_local()) {
    KCPP_FUZZ_EXPECT(!r.path.empty() && r.path[0] == '/', "local path '{}' is not absolute", r.path);
    return;
  }
  try {
    validate_repo_id(r.repo);
  } catch (const Error& e) {
    KCPP_FUZZ_EXPECT(false, "'{}' was accepted with a bad repo id: {}", s, e.what());
  }
  KCPP_FUZZ_EXPECT(r.constraint.has_value() != !r.revision.empty(), "'{}': a revision or a constraint, exactly one", s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in = fuzz::text(data, size);
  const size_t nl = in.find('\n');
  const std::string_view first = in.substr(0, nl), second = nl == std::string_view::npos ? "" : in.substr(nl + 1);
  const std::optional<Version> a = Version::try_parse(first), b = Version::try_parse(second);
  check_version(first);
  if (a && b) {
    const auto ab = *a <=> *b, ba = *b <=> *a;
    KCPP_FUZZ_EXPECT((ab < 0 && ba > 0) || (ab > 0 && ba < 0) || (ab == 0 && ba == 0), "'{}' vs '{}' is not antisymmetric",
                     first, second);
  }
  check_constraint(first, a, b);
  check_reference(first);
  return 0;
}
