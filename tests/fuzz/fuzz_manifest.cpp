// manifest.json (src/hub/manifest.h) and the variant names and CUDA architectures in it
// (src/hub/variant.h), as a package download hands them to the hub.
//
// Properties of a manifest that parses: its pretty form (what `kcpp package index` writes) parses
// back to the same canonical bytes (what a signature covers); every file lies inside its variant's
// build/ folder; choosing a variant for a CPU machine and for a Hopper machine gives an answer.
#include <string>

#include "fuzz.h"
#include "hub/fs.h"
#include "hub/manifest.h"
#include "hub/variant.h"

using namespace kcpp;
using namespace kcpp::hub;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Manifest m;
  try {
    m = Manifest::parse(fuzz::text(data, size), "fuzz");
  } catch (const Error&) {
    return 0;
  }
  const std::string canonical = m.canonical_bytes();
  const Manifest again = Manifest::parse(m.dump(), "fuzz (written back)");
  KCPP_FUZZ_EXPECT(again.canonical_bytes() == canonical, "the written manifest reads back differently");
  std::vector<VariantCandidate> candidates;
  for (const ManifestVariant& v : m.variants) {
    KCPP_FUZZ_EXPECT(m.variant(v.name) != nullptr, "variant '{}' is not found by name", v.name);
    KCPP_FUZZ_EXPECT(v.file(v.library) != nullptr, "variant '{}': the library is not among its files", v.name);
    for (const ManifestFile& f : v.files)
      KCPP_FUZZ_EXPECT(relative_path_problem(f.path).empty() && f.path.starts_with("build/" + v.name + "/"),
                       "file '{}' escapes its variant's folder", f.path);
    for (const std::string& arch : v.cuda_archs) (void)cuda_arch_fit(arch, 9, 0);
    candidates.push_back({v.name, v.cuda_archs});
  }
  Machine cpu, hopper;
  hopper.cuda_driver = 13000;
  hopper.gpus.push_back({9, 0});
  for (const Machine& machine : {cpu, hopper}) {
    const VariantChoice choice = select_variant(candidates, machine);
    if (choice.chosen.empty()) (void)choice.explain(m.name, machine);
    KCPP_FUZZ_EXPECT(choice.chosen.empty() || m.variant(choice.chosen), "chose '{}', not a variant", choice.chosen);
  }
  return 0;
}
