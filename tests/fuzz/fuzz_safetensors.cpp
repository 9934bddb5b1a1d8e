// safetensors files (src/models/safetensors.h): the 8-byte header length, the JSON header and
// every claim it makes about the data, then each tensor read out of the mapping.
//
// Properties of a file that opens: no dimension is negative, every tensor's view holds exactly its
// data_offsets' bytes, and the readable dtypes convert to f32.
#include "core/tensor.h"
#include "fuzz.h"
#include "models/safetensors.h"

using namespace kcpp;
using namespace kcpp::models;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::MemFile file;
  try {
    const SafetensorsFile f = SafetensorsFile::open(file.write(fuzz::text(data, size)));
    for (const auto& [name, e] : f.entries()) {
      KCPP_FUZZ_EXPECT(e.begin <= e.end, "tensor '{}': offsets run backwards", name);
      for (int64_t d : e.shape) KCPP_FUZZ_EXPECT(d >= 0, "tensor '{}': dimension {}", name, d);
      Tensor t;
      try {
        t = f.view(name);
      } catch (const Error&) {
        continue;  // a dtype the runtime has no type for: refused by name
      }
      KCPP_FUZZ_EXPECT(t.nbytes() == e.end - e.begin, "tensor '{}': view of {} bytes, offsets hold {}", name, t.nbytes(),
                       e.end - e.begin);
      if (t.numel() <= (1 << 16)) (void)f.load(name, DType::f32, Device::cpu());
    }
  } catch (const Error&) {
  }
  return 0;
}
