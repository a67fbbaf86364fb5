// libFuzzer harness: a .safetensors file's header and the tensor store over it (a file on disk, as models
// arrive), then the weights summary a plan is made from.
#include <unistd.h>
#include <fstream>
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::expect_typed(kvlite::parse_safetensors_header(data, size, "fuzz.safetensors"), "parse_safetensors_header");
  static const std::string path = "/tmp/kvlite-fuzz-" + std::to_string(getpid()) + ".safetensors";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  auto store = kvlite::TensorStore::open_files({path});
  fuzz::expect_typed(store, "TensorStore::open_files");
  if (store.ok()) {
    for (const auto& tensor : store->tensors()) (void)store->data(tensor);
    static const auto config = kvlite::load_config(fuzz::source_dir() + "/tests/fixtures/models/tiny-qwen3");
    if (config.ok()) fuzz::expect_typed(kvlite::summarize_weights(*config, &*store), "summarize_weights");
  }
  return 0;
}
