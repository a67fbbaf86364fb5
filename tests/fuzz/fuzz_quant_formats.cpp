// libFuzzer harness: AWQ / GPTQ / INT8 Linears read and repacked from hostile tensors (src/quant_formats). The
// input is 8 bytes of descriptor (packing, bits, out - 1, in - 1, group size - 1 (0: channel), flags, 2 reserved),
// then a .safetensors file
// whose tensors are named "m.<tensor>"; quant_weight must answer with a typed error or a view whose every row
// dequantizes (a repack that read past a tensor would trip ASan).
#include <unistd.h>
#include <fstream>
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  kvlite::LinearDesc d;
  d.name = "m";
  static const kvlite::IntPacking kPackings[] = {kvlite::IntPacking::awq, kvlite::IntPacking::gptq,
                                                 kvlite::IntPacking::gptq_v2, kvlite::IntPacking::compressed_tensors,
                                                 kvlite::IntPacking::compressed_tensors_unpacked};
  d.packing = kPackings[in.byte() % 5];
  d.format = (in.byte() & 1) ? kvlite::WeightFormat::int8 : kvlite::WeightFormat::int4;
  d.out_features = 1 + in.byte() % 64;
  d.in_features = 1 + in.byte() % 128;
  const uint8_t group = in.byte();
  d.group_size = group == 0 ? d.in_features : 1 + group % 64;
  d.granularity = d.group_size == d.in_features ? kvlite::ScaleGranularity::channel : kvlite::ScaleGranularity::group;
  const uint8_t flags = in.byte();
  d.symmetric = flags & 1;
  d.has_g_idx = flags & 2;
  d.int8_activations = flags & 4;
  (void)in.byte();  // reserved (2 bytes)
  (void)in.byte();
  if (d.format == kvlite::WeightFormat::int4 && d.packing == kvlite::IntPacking::compressed_tensors_unpacked) return 0;
  const std::string file = in.rest();
  static const std::string path = "/tmp/kvlite-fuzz-quant-" + std::to_string(getpid()) + ".safetensors";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(file.data(), std::streamsize(file.size()));
  }
  auto store = kvlite::TensorStore::open_files({path});
  if (!store.ok()) return 0;
  auto weight = kvlite::quant_weight(d, *store);
  fuzz::expect_typed(weight, "quant_weight");
  if (weight.ok()) {
    std::vector<float> rows(size_t(weight->out_features * weight->in_features));
    fuzz::expect_typed(kvlite::dequantize_rows(*weight, 0, weight->out_features, rows.data()), "dequantize_rows");
  }
  return 0;
}
