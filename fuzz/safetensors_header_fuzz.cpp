// libFuzzer target: arbitrary bytes as a whole safetensors file. A bg::Error is an accepted rejection; any other
// exception, a sanitizer report, or a header that passes but breaks the parser's promises is a bug.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>

#include "core/error.h"
#include "core/tensor.h"
#include "formats/safetensors.h"

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "safetensors_header_fuzz: accepted header breaks an invariant: %s\n", what);
  std::abort();
}

// Checks what parse_safetensors_header promises for an accepted file, then reads tensor elements the way a loader
// does, so an entry pointing outside the input becomes an ASan report.
float check_accepted(const bg::SafetensorsHeader& h, std::span<const std::byte> file) {
  if (h.data_start < 8 || h.data_start > file.size()) broken("data_start outside the file");
  uint64_t covered = 0;
  float sum = 0.0f;
  for (const auto& e : h.entries) {
    if (e.file_offset < h.data_start || e.file_offset > file.size() || e.nbytes > file.size() - e.file_offset) {
      broken("tensor bytes outside the data buffer");
    }
    bg::TensorView v{e.dtype, e.shape, file.data() + e.file_offset, e.nbytes, e.name};
    int64_t numel = v.numel();
    if (static_cast<uint64_t>(numel) * bg::dtype_size_bytes(e.dtype) != e.nbytes) broken("size != shape x dtype");
    for (int64_t i = 0; i < std::min<int64_t>(numel, 4096); ++i) sum += v.get_f32(i);
    covered += e.nbytes;
  }
  if (covered != file.size() - h.data_start) broken("tensors do not tile the data buffer");
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  try {
    bg::SafetensorsHeader h = bg::parse_safetensors_header(file, size, "fuzz-input");
    volatile float sink = check_accepted(h, file);
    (void)sink;
  } catch (const bg::Error&) {
    // Rejected with a message: the expected outcome for most inputs.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "safetensors_header_fuzz: non-bg::Error exception: %s\n", e.what());
    std::abort();
  }
  return 0;
}
