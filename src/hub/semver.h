// Semantic versions (semver.org 2.0.0) and version constraints over a repo's `vX.Y.Z` tags.
//
// Version: MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD], with an optional leading "v" ("v1.2.0").
// Precedence as semver §11: numeric fields, then a pre-release sorts before its release, and
// pre-release identifiers compare numerically when both are numeric, else as ASCII, numeric before
// alphanumeric, and a longer list wins a tie.  Build metadata is ignored.
//
// Constraint grammar (what `org/repo@CONSTRAINT` accepts):
//   constraint := set ( "||" set )*                 any set matches
//   set        := comparator ( ("," | " ") comparator )*   all comparators match
//   comparator := OP? partial | "^" partial | "~" partial | "~=" partial | "*"
//   OP         := "=" | "==" | "!=" | ">" | ">=" | "<" | "<="
//   partial    := X[.Y[.Z]][-pre] with "x" / "*" allowed for missing fields; after an operator it
//                 needs at least X (">=x" is an error naming 'x', not "any version")
// Meaning (npm / Cargo conventions):
//   "1.2.3" or "=1.2.3"  exactly 1.2.3;  "1.2" = 1.2.x = >=1.2.0,<1.3.0;  "1" = >=1.0.0,<2.0.0
//   ">=2.0"  >=2.0.0;   "<3"  <3.0.0;   "<=1.4"  <1.5.0 (all of 1.4.x);   ">1.4"  >=1.5.0
//   "^1.2.3" >=1.2.3,<2.0.0;  "^0.2.3" >=0.2.3,<0.3.0;  "^0.0.3" >=0.0.3,<0.0.4
//   "~1.4"   >=1.4.0,<1.5.0;  "~1" >=1.0.0,<2.0.0;      "~=1.4" (PEP 440) >=1.4,<2.0
// Pre-releases (npm's rule, what semver users expect): a version with a pre-release tag satisfies a
// set only if the set matches it AND some comparator of the set names the same MAJOR.MINOR.PATCH
// with a pre-release ("^1.0.0-rc.1" admits 1.0.0-rc.2 but ">=0.9" never admits 1.0.0-rc.2).
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kcpp::hub {

struct Version {
  uint64_t major = 0, minor = 0, patch = 0;
  std::vector<std::string> prerelease;  // dot-separated identifiers
  std::string build;                    // kept for printing; ignored by comparison

  // Throws kcpp::Error naming the text and the problem.
  static Version parse(std::string_view text);
  // nullopt instead of throwing (for scanning tags, most of which are not versions).
  static std::optional<Version> try_parse(std::string_view text);

  bool is_prerelease() const { return !prerelease.empty(); }
  std::string str() const;  // without the "v"
};

std::strong_ordering operator<=>(const Version& a, const Version& b);
inline bool operator==(const Version& a, const Version& b) { return (a <=> b) == 0; }

class Constraint {
 public:
  // Throws kcpp::Error with the offending part of the text.
  static Constraint parse(std::string_view text);
  bool matches(const Version& v) const;
  const std::string& text() const { return text_; }
  // The largest of `candidates` that matches, or nullopt.
  std::optional<Version> best(const std::vector<Version>& candidates) const;

 private:
  enum class Op { Eq, Ne, Lt, Le, Gt, Ge };
  struct Comparator {
    Op op;
    Version v;
  };
  using Set = std::vector<Comparator>;  // all must hold
  std::vector<Set> sets_;               // any may hold
  std::string text_;

  static void parse_comparator(std::string_view tok, std::string_view whole, Set& out);
  static bool holds(const Comparator& c, const Version& v);
};

// True when the text looks like a constraint rather than a tag, branch or commit: it starts with an
// operator or a digit, or is "*" (so "v1.2.0" and "main" are revisions, ">=1.2", "^1", "1.2" are
// not), and it is not a full commit id (is_commit_id: those are revisions, always).
bool looks_like_constraint(std::string_view text);

// A full commit id: 40 lower-case hex digits (huggingface_hub's REGEX_COMMIT_HASH, `^[0-9a-f]{40}$`).
bool is_commit_id(std::string_view text);

}  // namespace kcpp::hub
