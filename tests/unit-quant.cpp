// quant: quantized Linear weights. Dequantization is checked bit for bit against what compressed-tensors and
// transformers computed from the same files (tests/fixtures/quant, made by tools/make_quant_fixtures.py);
// the matmul against a float32 matmul over the dequantized weights; fp8 activation quantization against
// compressed-tensors; and every malformed tensor must be refused with its name and both shapes.
#include <doctest/doctest.h>
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <nlohmann/json.hpp>
#include "kvlite.hpp"
#include "model_fixtures.hpp"
#include "quant_weights.hpp"
#include "safetensors_writer.hpp"
using namespace kvlite;
using json = nlohmann::json;
using quant_test::odd_linear_desc;
namespace st = testing_safetensors;

namespace {

std::string fixture(const std::string& relative) {
  return std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant/" + relative;
}

TensorStore open_file(const std::string& path) { return TensorStore::open_files({path}).value(); }

// A float tensor of the store (F32, BF16 or F16) widened to float.
std::vector<float> floats_of(const TensorStore& store, const std::string& name) {
  const TensorInfo* tensor = store.find(name);
  REQUIRE_MESSAGE(tensor != nullptr, name);
  std::vector<float> out(tensor->numel());
  for (size_t i = 0; i < out.size(); i++) out[i] = scale_at(store.data(*tensor), tensor->dtype, int64_t(i));
  return out;
}

// Bit-for-bit equality, reporting the first difference.
void check_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what,
                     int64_t cols) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); i++)
    if (float_to_bits(got[i]) != float_to_bits(want[i])) {
      FAIL_CHECK(what << " differs at [" << int64_t(i) / cols << ", " << int64_t(i) % cols << "]: " << got[i]
                      << " vs reference " << want[i]);
      return;
    }
}

std::vector<float> dequantized(const QuantWeight& weight) {
  std::vector<float> out(size_t(weight.out_features * weight.in_features));
  REQUIRE(dequantize_rows(weight, 0, weight.out_features, out.data()).ok());
  return out;
}

void check_error(const Status& status, ErrorCode code, const std::vector<std::string>& fragments) {
  REQUIRE_FALSE(status.ok());
  CHECK_MESSAGE(status.error().code == code, status.error().message);
  for (const std::string& fragment : fragments)
    CHECK_MESSAGE(status.error().message.find(fragment) != std::string::npos,
                  "'" << fragment << "' not in: " << status.error().message);
}

std::vector<float> random_floats(std::mt19937& rng, size_t count, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> out(count);
  for (float& v : out) v = normal(rng);
  return out;
}

// x @ W^T in double, and sum |x_k w_k| per output (the scale of float32 rounding error).
void double_matmul(const std::vector<float>& x, int64_t tokens, const std::vector<float>& w, int64_t n, int64_t k,
                   std::vector<double>& out, std::vector<double>& magnitude) {
  out.assign(size_t(tokens * n), 0.0);
  magnitude.assign(size_t(tokens * n), 0.0);
  for (int64_t t = 0; t < tokens; t++)
    for (int64_t j = 0; j < n; j++)
      for (int64_t c = 0; c < k; c++) {
        double p = double(x[size_t(t * k + c)]) * double(w[size_t(j * k + c)]);
        out[size_t(t * n + j)] += p;
        magnitude[size_t(t * n + j)] += std::fabs(p);
      }
}

// The documented summation order of quant_linear (the CPU backend's linear), one element at a time.
float ordered_dot(const float* x, const float* w, int64_t k) {
  float lanes[8] = {};
  const int64_t main = k - k % 8;
  for (int64_t c = 0; c < main; c += 8)
    for (int l = 0; l < 8; l++) lanes[l] += x[c + l] * w[c + l];
  float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (int64_t c = main; c < k; c++) sum += x[c] * w[c];
  return sum;
}

}  // namespace

TEST_CASE("bit helpers follow compressed-tensors' int4 packing") {
  // Word with nibble i = i: stored values 0..7 are q = -8..-1 (the stored value is q + 8).
  const uint32_t word = 0x76543210u;
  for (int i = 0; i < 8; i++) CHECK(int4_from_word(word, i) == i - 8);
  CHECK(int4_from_word(0xf0000000u, 7) == 7);
  // Column k of a packed row lives in word k / 8, nibble k % 8, at any byte alignment.
  uint8_t row[1 + 8];
  const uint32_t words[2] = {0x89abcdefu, 0x01234567u};
  memcpy(row + 1, words, 8);
  for (int k = 0; k < 16; k++) CHECK(int4_packed_at(row + 1, k) == int((words[k / 8] >> (4 * (k % 8))) & 0xf) - 8);
  // Zero points are packed along out_features: row n is nibble n % 8 of word [n / 8, g].
  const uint32_t zeros[2][3] = {{0x11111111u, 0x22222222u, 0x0000000fu}, {0x00000009u, 0, 0}};  // [2, 3]
  CHECK(int4_zero_point_at(reinterpret_cast<const uint8_t*>(zeros), 3, 0, 2) == 7);
  CHECK(int4_zero_point_at(reinterpret_cast<const uint8_t*>(zeros), 3, 5, 1) == 2 - 8);
  CHECK(int4_zero_point_at(reinterpret_cast<const uint8_t*>(zeros), 3, 8, 0) == 1);
  // Rounding to the scale's dtype is nearest-even to BF16 / F16; F32 passes through.
  const float third = 1.0f / 3.0f;
  CHECK(round_to_dtype(third, DType::BF16) == bf16_to_float(float_to_bf16(third)));
  CHECK(round_to_dtype(third, DType::F16) == f16_to_float(float_to_f16(third)));
  CHECK(round_to_dtype(third, DType::F32) == third);
  CHECK(dequantize_value(-7.0f, third, DType::F32, DequantRounding::f32) == -7.0f * third);
}

TEST_CASE("odd linears dequantize bit for bit as compressed-tensors and transformers do") {
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  TensorStore reference = open_file(fixture("odd-linears/reference.safetensors"));
  REQUIRE(doc["linears"].size() == 14);
  for (const json& entry : doc["linears"]) {
    const LinearDesc desc = odd_linear_desc(entry);
    CAPTURE(desc.name);
    Result<QuantWeight> weight = quant_weight(desc, store);
    REQUIRE_MESSAGE(weight.ok(), weight.error().message);
    const std::vector<float> want = floats_of(reference, desc.name + ".weight");
    check_same_bits(dequantized(*weight), want, desc.name, desc.in_features);
    // Any row range gives the same rows.
    const int64_t k = desc.in_features, row0 = desc.out_features / 3, rows = desc.out_features - row0 - 1;
    std::vector<float> part(size_t(rows * k));
    REQUIRE(dequantize_rows(*weight, row0, rows, part.data()).ok());
    check_same_bits(part, std::vector<float>(want.begin() + row0 * k, want.begin() + (row0 + rows) * k),
                    desc.name + " rows", k);
  }
}

TEST_CASE("quantized fixture models: every Linear loads, the reference Linears dequantize bit for bit") {
  for (const char* name : {"tiny-w4a16", "tiny-fp8", "tiny-fp8-qwen"}) {
    CAPTURE(name);
    const std::string dir = fixture(name);
    ModelConfig config = load_config(dir).value();
    TensorStore store = TensorStore::open_dir(dir).value();
    Result<std::vector<LinearDesc>> linears = describe_linears(config, &store);
    REQUIRE_MESSAGE(linears.ok(), linears.error().message);
    int quantized = 0;
    for (const LinearDesc& desc : *linears) {
      if (desc.format == WeightFormat::dense) continue;
      CAPTURE(desc.name);
      Result<QuantWeight> weight = quant_weight(desc, store);
      REQUIRE_MESSAGE(weight.ok(), weight.error().message);
      quantized++;
    }
    CHECK(quantized == 14);  // 7 Linears x 2 layers; the tied lm_head stays dense
    const json reference_doc = json::parse(detail::read_text_file(dir + "/reference.json"));
    TensorStore reference = open_file(dir + "/reference.safetensors");
    REQUIRE(!reference_doc["reference_linears"].empty());
    for (const auto& item : reference_doc["reference_linears"].items()) {
      const std::string& linear = item.key();
      CAPTURE(linear);
      auto desc = std::find_if(linears->begin(), linears->end(), [&](const LinearDesc& d) { return d.name == linear; });
      REQUIRE(desc != linears->end());
      QuantWeight weight = quant_weight(*desc, store).value();
      check_same_bits(dequantized(weight), floats_of(reference, linear + ".weight"), linear, desc->in_features);
    }
  }
}

TEST_CASE("quant_linear equals a float32 matmul over the dequantized weight, for any thread count") {
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  std::mt19937 rng(12345);
  for (const json& entry : doc["linears"]) {
    const LinearDesc desc = odd_linear_desc(entry);
    const QuantWeight weight = quant_weight(desc, store).value();
    const std::vector<float> w = dequantized(weight);
    const int64_t n = desc.out_features, k = desc.in_features;
    for (int64_t tokens : {1, 3, 7, 17}) {
      CAPTURE(desc.name);
      CAPTURE(tokens);
      // x with a row stride wider than K and out written into a wider buffer: strides are honoured.
      const int64_t x_stride = k + 3, out_stride = n + 5;
      const std::vector<float> x_wide = random_floats(rng, size_t(tokens * x_stride));
      std::vector<float> x(size_t(tokens * k));
      for (int64_t t = 0; t < tokens; t++)
        std::copy_n(x_wide.begin() + t * x_stride, k, x.begin() + t * k);
      std::vector<float> out1(size_t(tokens * out_stride), -1.0f), out3 = out1;
      REQUIRE(quant_linear(x_wide.data(), x_stride, tokens, weight, out1.data(), out_stride, {1, false}).ok());
      REQUIRE(quant_linear(x_wide.data(), x_stride, tokens, weight, out3.data(), out_stride, {3, false}).ok());
      CHECK(out1 == out3);  // bitwise (no NaN here), padding untouched
      std::vector<double> want, magnitude;
      double_matmul(x, tokens, w, n, k, want, magnitude);
      int64_t far = 0, misordered = 0;
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t j = 0; j < n; j++) {
          const float got = out1[size_t(t * out_stride + j)];
          if (std::fabs(got - want[size_t(t * n + j)]) > 1e-5 * magnitude[size_t(t * n + j)]) far++;
          if (float_to_bits(got) != float_to_bits(ordered_dot(&x[size_t(t * k)], &w[size_t(j * k)], k))) misordered++;
        }
      CHECK(far == 0);
      CHECK(misordered == 0);
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t j = n; j < out_stride; j++) CHECK(out1[size_t(t * out_stride + j)] == -1.0f);
    }
  }
}

TEST_CASE("quant_linear equals the CPU backend's linear over the dequantized weight, bit for bit") {
  // The engine may run a quantized Linear either way; both must give the same logits. The reference kernels:
  // quant_linear is the reference's order, which the fast kernels (the default) do not keep (cpu-fast: checks
  // them against the reference within float rounding).
  CpuBackendOptions reference_options{2, 64};
  reference_options.kernels = CpuKernels::reference;
  std::unique_ptr<Backend> backend = make_cpu_backend(reference_options).value();
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  std::mt19937 rng(2024);
  for (const json& entry : doc["linears"]) {
    const LinearDesc desc = odd_linear_desc(entry);
    QuantWeight weight = quant_weight(desc, store).value();
    std::vector<float> w = dequantized(weight);
    const int64_t n = desc.out_features, k = desc.in_features;
    std::vector<float> bias = random_floats(rng, size_t(n));
    weight.bias = reinterpret_cast<const uint8_t*>(bias.data());
    weight.bias_dtype = DType::F32;
    for (int64_t tokens : {1, 5, 37}) {
      CAPTURE(desc.name);
      CAPTURE(tokens);
      std::vector<float> x = random_floats(rng, size_t(tokens * k));
      std::vector<float> got(size_t(tokens * n)), want(size_t(tokens * n));
      REQUIRE(quant_linear(x.data(), k, tokens, weight, got.data(), n, {2, false}).ok());
      REQUIRE(backend
                  ->linear(Tensor::matrix(x.data(), DType::F32, tokens, k), Tensor::matrix(w.data(), DType::F32, n, k),
                           Tensor::vector(bias.data(), DType::F32, n), Tensor::matrix(want.data(), DType::F32, tokens, n))
                  .ok());
      check_same_bits(got, want, desc.name, n);
    }
  }
}

TEST_CASE("the CPU backend's quant_linear op equals quant_linear, in token chunks, into column slices") {
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  std::mt19937 rng(31337);
  for (bool fp8_activations : {false, true}) {
    CpuBackendOptions options;
    options.threads = 3;
    options.max_quant_in_features = 512;
    options.fp8_activations = fp8_activations;
    // the reference kernels, whose chunked, threaded op must equal quant_linear bit for bit (the fast ones,
    // the default, sum in another order; cpu-fast: checks them against these)
    options.kernels = CpuKernels::reference;
    std::unique_ptr<Backend> backend = make_cpu_backend(options).value();
    for (const json& entry : doc["linears"]) {
      const LinearDesc desc = odd_linear_desc(entry);
      const QuantWeight weight = quant_weight(desc, store).value();
      const int64_t n = desc.out_features, k = desc.in_features;
      const bool requantize = fp8_activations && weight.format == WeightFormat::fp8;
      for (int64_t tokens : {1, 7, 64, 131}) {  // the backend works in chunks of 64 tokens
        CAPTURE(desc.name);
        CAPTURE(tokens);
        CAPTURE(fp8_activations);
        const std::vector<float> x = random_floats(rng, size_t(tokens * k));
        std::vector<float> want(size_t(tokens * n));
        REQUIRE(quant_linear(x.data(), k, tokens, weight, want.data(), n, {1, requantize}).ok());
        // out: columns [2, 2 + n) of a [tokens, n + 5] buffer poisoned with NaN
        const int64_t wide = n + 5;
        std::vector<float> buffer(size_t(tokens * wide), std::nanf(""));
        Tensor out = Tensor::matrix(buffer.data(), DType::F32, tokens, wide).slice_cols(2, n);
        REQUIRE(backend->quant_linear(Tensor::matrix(const_cast<float*>(x.data()), DType::F32, tokens, k), weight, out).ok());
        std::vector<float> got(size_t(tokens * n));
        int64_t padding_written = 0;
        for (int64_t t = 0; t < tokens; t++)
          for (int64_t j = 0; j < wide; j++) {
            const float value = buffer[size_t(t * wide + j)];
            if (j >= 2 && j < 2 + n) got[size_t(t * n + j - 2)] = value;
            else padding_written += !std::isnan(value);
          }
        CHECK(padding_written == 0);
        check_same_bits(got, want, desc.name, n);
      }
    }
  }
}

TEST_CASE("the CPU backend's quant_linear op refuses bad shapes and rows wider than its scratch") {
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  const QuantWeight weight = quant_weight(odd_linear_desc(doc["linears"][0]), store).value();  // 37 x 96
  std::vector<float> x(size_t(4 * 100), 1.0f), out(size_t(4 * 37));
  CpuBackendOptions options;
  options.threads = 1;
  options.max_quant_in_features = 64;
  std::unique_ptr<Backend> small = make_cpu_backend(options).value();
  Status too_wide = small->quant_linear(Tensor::matrix(x.data(), DType::F32, 4, 96), weight,
                                        Tensor::matrix(out.data(), DType::F32, 4, 37));
  check_error(too_wide, ErrorCode::invalid_argument, {weight.name, "96 in_features", "max_quant_in_features"});
  std::unique_ptr<Backend> backend = make_cpu_backend({1, 64}).value();
  Status wrong_k = backend->quant_linear(Tensor::matrix(x.data(), DType::F32, 4, 100), weight,
                                         Tensor::matrix(out.data(), DType::F32, 4, 37));
  check_error(wrong_k, ErrorCode::invalid_argument, {weight.name, "in 96", "[4, 100]"});
  Status wrong_out = backend->quant_linear(Tensor::matrix(x.data(), DType::F32, 4, 96), weight,
                                           Tensor::matrix(out.data(), DType::F32, 2, 37));
  check_error(wrong_out, ErrorCode::invalid_argument, {"out", "[4, 37]"});
}

TEST_CASE("quant_linear adds the bias after the dot product") {
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  QuantWeight weight = quant_weight(odd_linear_desc(doc["linears"][0]), store).value();  // int4, 37 x 96
  std::mt19937 rng(7);
  const int64_t tokens = 5, n = weight.out_features, k = weight.in_features;
  const std::vector<float> x = random_floats(rng, size_t(tokens * k));
  std::vector<float> plain(size_t(tokens * n)), biased(size_t(tokens * n));
  REQUIRE(quant_linear(x.data(), k, tokens, weight, plain.data(), n).ok());
  std::vector<uint16_t> bias(static_cast<size_t>(n));
  for (uint16_t& b : bias) b = float_to_bf16(random_floats(rng, 1)[0]);
  weight.bias = reinterpret_cast<const uint8_t*>(bias.data());
  weight.bias_dtype = DType::BF16;
  REQUIRE(quant_linear(x.data(), k, tokens, weight, biased.data(), n, {2, false}).ok());
  for (int64_t t = 0; t < tokens; t++)
    for (int64_t j = 0; j < n; j++)
      CHECK(biased[size_t(t * n + j)] == plain[size_t(t * n + j)] + bf16_to_float(bias[size_t(j)]));
}

TEST_CASE("fp8 activation quantization matches compressed-tensors") {
  TensorStore store = open_file(fixture("activations/activations.safetensors"));
  for (const char* name : {"token", "group"}) {
    CAPTURE(name);
    const std::string p = std::string(name) + ".";
    const TensorInfo& x_info = *store.find(p + "x");
    const int64_t rows = x_info.shape[0], cols = x_info.shape[1];
    const int64_t group = std::string(name) == "token" ? cols : 128;
    const std::vector<float> x = floats_of(store, p + "x");
    const std::vector<float> want_scales = floats_of(store, p + "scale");
    const TensorInfo& q_info = *store.find(p + "q");
    REQUIRE(q_info.dtype == DType::F8_E4M3);
    const uint8_t* want_q = store.data(q_info);
    std::vector<uint8_t> q(size_t(rows * cols));
    std::vector<float> scales(want_scales.size());
    REQUIRE(quantize_fp8_activations(x.data(), rows, cols, cols, group, q.data(), scales.data()).ok());
    check_same_bits(scales, want_scales, "scales", int64_t(want_scales.size()) / rows);
    int64_t differ = 0;
    for (size_t i = 0; i < q.size(); i++) differ += q[i] != want_q[i];
    CHECK(differ == 0);
  }
}

TEST_CASE("quant_linear with fp8 activations runs on the quantize-dequantized activations") {
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  std::mt19937 rng(99);
  int checked = 0;
  for (const json& entry : doc["linears"]) {
    const LinearDesc desc = odd_linear_desc(entry);
    const QuantWeight weight = quant_weight(desc, store).value();
    const int64_t tokens = 3, n = weight.out_features, k = weight.in_features;
    const std::vector<float> x = random_floats(rng, size_t(tokens * k), 2.0f);
    std::vector<float> out(size_t(tokens * n));
    if (weight.format == WeightFormat::int4) {
      Status refused = quant_linear(x.data(), k, tokens, weight, out.data(), n, {1, true});
      CHECK(refused.error().code == ErrorCode::invalid_argument);
      continue;
    }
    CAPTURE(desc.name);
    // The activations as the weight's W8A8 path sees them: per token, or per block_k columns for blocks.
    const int64_t group = weight.granularity == ScaleGranularity::block ? weight.block_k : k;
    const int64_t groups = (k + group - 1) / group;
    std::vector<uint8_t> q(size_t(tokens * k));
    std::vector<float> scales(size_t(tokens * groups)), x_hat(size_t(tokens * k));
    REQUIRE(quantize_fp8_activations(x.data(), tokens, k, k, group, q.data(), scales.data()).ok());
    for (int64_t t = 0; t < tokens; t++)
      for (int64_t c = 0; c < k; c++)
        x_hat[size_t(t * k + c)] = fp8_e4m3_to_float(q[size_t(t * k + c)]) * scales[size_t(t * groups + c / group)];
    CHECK(x_hat != x);  // the quantization did something
    std::vector<float> want(size_t(tokens * n));
    REQUIRE(quant_linear(x_hat.data(), k, tokens, weight, want.data(), n).ok());
    REQUIRE(quant_linear(x.data(), k, tokens, weight, out.data(), n, {2, true}).ok());
    CHECK(out == want);
    checked++;
  }
  CHECK(checked == 7);
}

// ---- malformed checkpoints ------------------------------------------------------------------------------

namespace {

std::vector<uint8_t> bytes_of_i32(const std::vector<int32_t>& values) {
  std::vector<uint8_t> out(values.size() * 4);
  memcpy(out.data(), values.data(), out.size());
  return out;
}
std::vector<uint8_t> bytes_of_i64(const std::vector<int64_t>& values) {
  std::vector<uint8_t> out(values.size() * 8);
  memcpy(out.data(), values.data(), out.size());
  return out;
}
st::Tensor filled(const std::string& name, const std::string& dtype, std::vector<int64_t> shape, uint8_t byte) {
  uint64_t count = 1;
  for (int64_t d : shape) count *= uint64_t(d);
  return {name, dtype, std::move(shape), std::vector<uint8_t>(dtype_bytes(*dtype_from_name(dtype), count), byte)};
}

// A valid asymmetric int4 Linear "lin" (16 x 64, group 32, actorder) whose tensors the cases then break.
struct Int4Case {
  LinearDesc desc;
  std::map<std::string, st::Tensor> tensors;
  Int4Case() {
    desc.name = "lin";
    desc.out_features = 16;
    desc.in_features = 64;
    desc.format = WeightFormat::int4;
    desc.granularity = ScaleGranularity::group;
    desc.group_size = 32;
    desc.symmetric = false;
    desc.has_g_idx = true;
    desc.scale_name = "weight_scale";
    std::vector<int32_t> g_idx(64);
    for (int k = 0; k < 64; k++) g_idx[size_t(k)] = (k * 7 % 64) / 32;  // a permutation's groups: 32 each
    add({"lin.weight_packed", "I32", {16, 8}, std::vector<uint8_t>(16 * 8 * 4, 0x5a)});
    add({"lin.weight_shape", "I64", {2}, bytes_of_i64({16, 64})});
    add(filled("lin.weight_scale", "BF16", {16, 2}, 0x3c));
    add({"lin.weight_zero_point", "I32", {2, 2}, bytes_of_i32({0x12345678, 0x76543210, 0x11111111, 0x7f7f7f7f})});
    add({"lin.weight_g_idx", "I32", {64}, bytes_of_i32(g_idx)});
  }
  void add(st::Tensor tensor) { tensors[tensor.name] = std::move(tensor); }
  // Writes the tensors and builds the view: the error, or ok.
  Status build(const std::string& test_name) const {
    std::string dir = st::temp_dir("quant-" + test_name);
    std::vector<st::Tensor> list;
    for (const auto& item : tensors) list.push_back(item.second);
    st::write_file(dir + "/model.safetensors", list);
    TensorStore store = TensorStore::open_dir(dir).value();
    Result<QuantWeight> weight = quant_weight(desc, store);
    if (weight.ok()) return Status();
    return weight.error();
  }
};

}  // namespace

TEST_CASE("malformed int4 Linears are refused, naming the tensor and both shapes") {
  Int4Case c;
  REQUIRE(c.build("valid").ok());

  SUBCASE("weight_shape disagrees with the packed weight") {
    c.add({"lin.weight_shape", "I64", {2}, bytes_of_i64({16, 72})});
    check_error(c.build("shape-values"), ErrorCode::bad_format,
                {"lin.weight_shape", "[16, 72]", "lin.weight_packed", "[16, 8]", "[16, 64]"});
  }
  SUBCASE("packed width of another bit width") {
    c.add(filled("lin.weight_packed", "I32", {16, 16}, 0));  // 64 x 8 bits = 16 words
    check_error(c.build("bits"), ErrorCode::unsupported, {"lin.weight_packed", "[16, 16]", "8-bit", "[16, 8]"});
  }
  SUBCASE("packed shape that no bit width explains") {
    c.add(filled("lin.weight_packed", "I32", {15, 8}, 0));
    check_error(c.build("packed-rows"), ErrorCode::bad_format, {"lin.weight_packed", "[15, 8]", "[16, 8]"});
  }
  SUBCASE("packed weight of the wrong dtype") {
    c.add(filled("lin.weight_packed", "U8", {16, 32}, 0));
    check_error(c.build("packed-dtype"), ErrorCode::bad_format, {"lin.weight_packed", "U8", "I32"});
  }
  SUBCASE("scale of the wrong shape") {
    c.add(filled("lin.weight_scale", "BF16", {16, 4}, 0x3c));
    check_error(c.build("scale-shape"), ErrorCode::bad_format,
                {"lin.weight_scale", "[16, 4]", "[16, 2]", "group_size 32"});
  }
  SUBCASE("scale of an integer dtype") {
    c.add(filled("lin.weight_scale", "I32", {16, 2}, 0));
    check_error(c.build("scale-dtype"), ErrorCode::unsupported, {"lin.weight_scale", "I32"});
  }
  SUBCASE("group_size not dividing in_features") {
    c.desc.group_size = 48;
    check_error(c.build("group"), ErrorCode::bad_format, {"lin.weight_packed", "group_size 48", "in_features 64"});
  }
  SUBCASE("zero points of the wrong shape") {
    c.add({"lin.weight_zero_point", "I32", {16, 2}, std::vector<uint8_t>(16 * 2 * 4, 0)});
    check_error(c.build("zero-shape"), ErrorCode::bad_format, {"lin.weight_zero_point", "[16, 2]", "[2, 2]"});
  }
  SUBCASE("asymmetric without zero points") {
    c.tensors.erase("lin.weight_zero_point");
    check_error(c.build("zero-missing"), ErrorCode::missing_tensor, {"lin.weight_zero_point"});
  }
  SUBCASE("g_idx of the wrong length") {
    c.add({"lin.weight_g_idx", "I32", {63}, bytes_of_i32(std::vector<int32_t>(63, 0))});
    check_error(c.build("gidx-shape"), ErrorCode::bad_format, {"lin.weight_g_idx", "[63]", "[64]"});
  }
  SUBCASE("g_idx naming a group that does not exist") {
    std::vector<int32_t> g_idx(64, 1);
    g_idx[10] = 2;
    c.add({"lin.weight_g_idx", "I32", {64}, bytes_of_i32(g_idx)});
    check_error(c.build("gidx-range"), ErrorCode::bad_format, {"lin.weight_g_idx[10] = 2", "lin.weight_scale"});
  }
  SUBCASE("g_idx with unequal groups") {
    std::vector<int32_t> g_idx(64, 0);
    g_idx[0] = 1;
    c.add({"lin.weight_g_idx", "I32", {64}, bytes_of_i32(g_idx)});
    check_error(c.build("gidx-count"), ErrorCode::bad_format, {"lin.weight_g_idx", "63 columns to group 0"});
  }
  SUBCASE("missing scale") {
    c.tensors.erase("lin.weight_scale");
    check_error(c.build("scale-missing"), ErrorCode::missing_tensor, {"lin.weight_scale"});
  }
}

TEST_CASE("malformed fp8 Linears are refused, naming the tensor and both shapes") {
  LinearDesc desc;
  desc.name = "fc";
  desc.out_features = 200;
  desc.in_features = 160;
  desc.format = WeightFormat::fp8;
  desc.granularity = ScaleGranularity::block;
  desc.block_n = desc.block_k = 128;
  desc.scale_name = "weight_scale_inv";
  std::map<std::string, st::Tensor> tensors;
  auto add = [&](st::Tensor t) { tensors[t.name] = std::move(t); };
  add(filled("fc.weight", "F8_E4M3", {200, 160}, 0x38));
  add(filled("fc.weight_scale_inv", "F32", {2, 2}, 0x3c));
  auto build = [&](const std::string& name) -> Status {
    std::string dir = st::temp_dir("quant-fp8-" + name);
    std::vector<st::Tensor> list;
    for (const auto& item : tensors) list.push_back(item.second);
    st::write_file(dir + "/model.safetensors", list);
    TensorStore store = TensorStore::open_dir(dir).value();
    Result<QuantWeight> weight = quant_weight(desc, store);
    if (weight.ok()) return Status();
    return weight.error();
  };
  REQUIRE(build("valid").ok());

  SUBCASE("block scale of the wrong shape") {
    add(filled("fc.weight_scale_inv", "F32", {2, 1}, 0x3c));
    check_error(build("block"), ErrorCode::bad_format, {"fc.weight_scale_inv", "[2, 1]", "[2, 2]", "128 x 128"});
  }
  SUBCASE("channel scale of the wrong shape") {
    desc.granularity = ScaleGranularity::channel;
    check_error(build("channel"), ErrorCode::bad_format, {"fc.weight_scale_inv", "[2, 2]", "[200, 1]"});
  }
  SUBCASE("tensor scale with several elements") {
    desc.granularity = ScaleGranularity::tensor;
    check_error(build("tensor"), ErrorCode::bad_format, {"fc.weight_scale_inv", "[2, 2]", "[1]"});
  }
  SUBCASE("weight of the wrong shape") {
    add(filled("fc.weight", "F8_E4M3", {160, 200}, 0x38));
    check_error(build("weight-shape"), ErrorCode::bad_format, {"fc.weight", "[160, 200]", "[200, 160]"});
  }
  SUBCASE("weight not fp8") {
    add(filled("fc.weight", "BF16", {200, 160}, 0x38));
    check_error(build("weight-dtype"), ErrorCode::bad_format, {"fc.weight", "BF16", "F8_E4M3"});
  }
  SUBCASE("asymmetric fp8") {
    add(filled("fc.weight_zero_point", "F32", {2, 2}, 0));
    check_error(build("zero"), ErrorCode::unsupported, {"fc.weight_zero_point"});
  }
  SUBCASE("bias of the wrong length") {
    add(filled("fc.bias", "BF16", {199}, 0));
    check_error(build("bias"), ErrorCode::bad_format, {"fc.bias", "[199]", "[200]"});
  }
}

TEST_CASE("dequantize_rows and quant_linear refuse bad arguments") {
  TensorStore store = open_file(fixture("odd-linears/model.safetensors"));
  const json doc = json::parse(detail::read_text_file(fixture("odd-linears/linears.json")));
  const QuantWeight weight = quant_weight(odd_linear_desc(doc["linears"][0]), store).value();  // 37 x 96
  std::vector<float> out(size_t(40 * 96));
  Status past_end = dequantize_rows(weight, 30, 8, out.data());
  check_error(past_end, ErrorCode::invalid_argument, {"int4_group_asym", "[30, 38)", "[0, 37)"});
  CHECK(dequantize_rows(weight, -1, 2, out.data()).error().code == ErrorCode::invalid_argument);
  std::vector<float> x(96);
  Status narrow = quant_linear(x.data(), 95, 1, weight, out.data(), 37);
  check_error(narrow, ErrorCode::invalid_argument, {"x_stride 95", "in 96"});
  CHECK(quant_linear(x.data(), 96, 1, weight, out.data(), 37, {0, false}).error().code == ErrorCode::invalid_argument);
  LinearDesc dense;
  dense.name = "dense";
  dense.out_features = dense.in_features = 4;
  Result<QuantWeight> not_quantized = quant_weight(dense, store);
  REQUIRE_FALSE(not_quantized.ok());
  check_error(Status(not_quantized.error()), ErrorCode::invalid_argument, {"dense", "not a quantized format"});
}

// ---- end to end -------------------------------------------------------------------------------------------

namespace {

// The fixture model rewritten as a dense checkpoint: every quantized Linear replaced by its dequantized
// weight (F32, exact), every other tensor copied as stored, quantization_config removed.
std::string dense_copy(const std::string& name) {
  const std::string src = fixture(name), dst = st::temp_dir("quant-dense-" + name);
  ModelConfig config = load_config(src).value();
  TensorStore store = TensorStore::open_dir(src).value();
  std::map<std::string, QuantWeight> quantized;  // by module name
  const std::vector<LinearDesc> linears = describe_linears(config, &store).value();
  for (const LinearDesc& desc : linears)
    if (desc.format != WeightFormat::dense) quantized.emplace(desc.name, quant_weight(desc, store).value());
  std::vector<st::Tensor> tensors;
  for (const TensorInfo& info : store.tensors()) {
    const std::string module = info.name.substr(0, info.name.rfind('.'));
    if (quantized.count(module)) continue;
    const uint8_t* bytes = store.data(info);
    tensors.push_back({info.name, dtype_name(info.dtype), info.shape, std::vector<uint8_t>(bytes, bytes + info.nbytes)});
  }
  for (const auto& item : quantized)
    tensors.push_back({item.first + ".weight", "F32", {item.second.out_features, item.second.in_features},
                       st::bytes_of_f32(dequantized(item.second))});
  st::write_file(dst + "/model.safetensors", tensors);
  json doc = json::parse(detail::read_text_file(src + "/config.json"));
  doc.erase("quantization_config");
  st::write_text(dst + "/config.json", doc.dump(2));
  for (const char* file : {"generation_config.json", "tokenizer.json", "tokenizer_config.json"})
    st::write_text(dst + "/" + file, detail::read_text_file(src + "/" + file));
  return dst;
}

}  // namespace

TEST_CASE("quantized fixture models run as stored and reproduce transformers' logits and greedy continuations") {
  for (const char* name : {"tiny-w4a16", "tiny-fp8", "tiny-fp8-qwen"}) {
    CAPTURE(name);
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.device_mem = 64 * MiB;
    auto engine = Engine::open(fixture(name), options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    const json reference = json::parse(detail::read_text_file(fixture(name) + "/reference.json"));
    REQUIRE(reference["prompts"].size() == 1);
    for (const json& prompt : reference["prompts"]) {
      const std::vector<int32_t> ids = prompt["input_ids"].get<std::vector<int32_t>>();
      model_fixtures::Npy expected =
          model_fixtures::read_npy(fixture(name) + "/" + prompt["logits_file"].get<std::string>());
      auto logits = (*engine)->logits(ids);
      REQUIRE_MESSAGE(logits, logits.error().message);
      REQUIRE(logits->tokens == expected.rows);
      REQUIRE(logits->vocab == expected.cols);
      CHECK(model_fixtures::relative_max_diff(logits->values, expected.values) <= 1e-4);
      SamplingParams params;  // temperature 0: greedy
      params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
      auto generation = (*engine)->generate(ids, params);
      REQUIRE_MESSAGE(generation, generation.error().message);
      CHECK(generation->ids == prompt["greedy"]["new_ids"].get<std::vector<int32_t>>());
    }
  }
}

TEST_CASE("the quantized engine equals the engine over the dequantized dense checkpoint, bit for bit") {
  // quant_linear's order is the dense linear's, and the chunked, threaded backend op changes no bit of it.
  for (const char* name : {"tiny-w4a16", "tiny-fp8", "tiny-fp8-qwen"}) {
    CAPTURE(name);
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    // the reference kernels: their quantized and dense Linears sum in one order, which is what makes the two
    // engines' bits equal; the fast kernels (the default) sum int4 / fp8 and dense weights in different orders
    options.cpu_kernels = CpuKernels::reference;
    options.plan.device_mem = 64 * MiB;
    options.plan.max_batched_tokens = 80;  // > the backend's 64-token chunk, so a prompt spans two
    options.threads = 3;
    auto quantized = Engine::open(fixture(name), options);
    REQUIRE_MESSAGE(quantized, quantized.error().message);
    auto dense = Engine::open(dense_copy(name), options);
    REQUIRE_MESSAGE(dense, dense.error().message);
    std::vector<int32_t> ids(75);
    uint32_t state = 12345;
    for (int32_t& id : ids) id = int32_t((state = state * 1664525u + 1013904223u) >> 8) % 1000 + 10;
    auto a = (*quantized)->logits(ids);
    auto b = (*dense)->logits(ids);
    REQUIRE_MESSAGE(a, a.error().message);
    REQUIRE_MESSAGE(b, b.error().message);
    CHECK(a->values == b->values);
  }
}

TEST_CASE("fp8 activations (W8A8) move fp8 models' logits a little, and leave int4 models alone") {
  auto logits_of = [](const char* name, bool fp8_activations) {
    EngineOptions options;
    options.backend = kvlite::BackendChoice::cpu;  // the CPU reference (EngineOptions defaults to auto)
    options.plan.device_mem = 64 * MiB;
    options.fp8_activations = fp8_activations;
    auto engine = Engine::open(fixture(name), options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    const json reference = json::parse(detail::read_text_file(fixture(name) + "/reference.json"));
    auto logits = (*engine)->logits(reference["prompts"][0]["input_ids"].get<std::vector<int32_t>>());
    REQUIRE_MESSAGE(logits, logits.error().message);
    return logits->values;
  };
  for (const char* name : {"tiny-fp8", "tiny-fp8-qwen"}) {
    CAPTURE(name);
    const std::vector<float> w8a16 = logits_of(name, false), w8a8 = logits_of(name, true);
    const double difference = model_fixtures::relative_max_diff(w8a8, w8a16);
    CHECK(difference > 1e-4);  // the activations really went through fp8
    // e4m3 keeps 3 mantissa bits: each activation moves by up to 1/16 of itself, in every Linear of a random
    // model with no outliers handling (measured: 0.09 and 0.13); a broken quantizer lands far beyond.
    CHECK(difference < 0.25);
  }
  CHECK(logits_of("tiny-w4a16", true) == logits_of("tiny-w4a16", false));
}

// ---- the int8 copy (--cpu-lm-head int8) -------------------------------------------------------------------

TEST_CASE("quantize_int8_copy: each weight within half a step of its group's max/127, every dtype and group") {
  std::mt19937 rng(4501);
  struct Shape { int64_t n, k, group; };
  // K = 1024 (groups of 128), 96 (of 32), 320 (of 64), 100 (no group divides it: one scale a row)
  for (Shape shape : {Shape{37, 1024, 128}, Shape{5, 96, 32}, Shape{3, 320, 64}, Shape{7, 100, 100}})
    for (DType dtype : {DType::BF16, DType::F16, DType::F32})
      for (int threads : {1, 3}) {
        CAPTURE(shape.n); CAPTURE(shape.k); CAPTURE(dtype_name(dtype)); CAPTURE(threads);
        CHECK(int8_copy_group_size(shape.k) == shape.group);
        const int64_t stride = shape.k + 3;  // a view with padding between rows
        std::vector<float> values = random_floats(rng, size_t(shape.n * stride), 0.05f);
        for (int64_t k = 0; k < shape.k; k++) values[size_t(k)] = 0.0f;  // row 0 all zeros: scale 0, codes 0
        values[size_t(stride + 5)] = 0.9f;  // one outlier: its group's scale is its /127
        std::vector<uint8_t> bytes(size_t(shape.n * stride) * dtype_bytes(dtype, 1));
        std::vector<float> exact(values.size());  // what the stored dtype holds
        for (size_t i = 0; i < values.size(); i++) {
          if (dtype == DType::F32) memcpy(&bytes[4 * i], &values[i], 4), exact[i] = values[i];
          else {
            const uint16_t h = dtype == DType::BF16 ? float_to_bf16(values[i]) : float_to_f16(values[i]);
            memcpy(&bytes[2 * i], &h, 2);
            exact[i] = dtype == DType::BF16 ? bf16_to_float(h) : f16_to_float(h);
          }
        }
        const Tensor view{bytes.data(), dtype, shape.n, shape.k, stride};
        Result<QuantWeight> copy = quantize_int8_copy(view, "lm_head", threads);
        REQUIRE_MESSAGE(copy, copy.error().message);
        CHECK(copy->format == WeightFormat::int8);
        CHECK(copy->layout == QuantLayout::checkpoint);
        CHECK(copy->group_size == shape.group);
        CHECK(copy->scale_cols == shape.k / shape.group);
        CHECK(copy->storage->size() == int8_copy_bytes(shape.n, shape.k));
        CHECK(int8_copy_bytes(shape.n, shape.k) == uint64_t(shape.n) * uint64_t(shape.k + 4 * (shape.k / shape.group)));
        const std::vector<float> back = dequantized(*copy);
        const int8_t* codes = reinterpret_cast<const int8_t*>(copy->int8);
        for (int64_t n = 0; n < shape.n; n++)
          for (int64_t g = 0; g < shape.k / shape.group; g++) {
            double amax = 0;
            for (int64_t k = g * shape.group; k < (g + 1) * shape.group; k++)
              amax = std::max(amax, std::fabs(double(exact[size_t(n * stride + k)])));
            const double step = amax / 127.0;
            const float scale = scale_at(copy->scales, copy->scale_dtype, n * copy->scale_cols + g);
            CHECK(std::fabs(double(scale) - step) <= 1e-6 * step);
            bool reaches_127 = amax == 0;  // the largest weight of a group is coded +-127
            for (int64_t k = g * shape.group; k < (g + 1) * shape.group; k++) {
              const double w = exact[size_t(n * stride + k)], got = back[size_t(n * shape.k + k)];
              if (std::fabs(w - got) > step / 2 * (1 + 1e-5) + 1e-12)
                FAIL_CHECK("row " << n << " column " << k << ": " << w << " came back " << got << ", step " << step);
              CHECK(std::abs(int(codes[n * shape.k + k])) <= 127);
              reaches_127 = reaches_127 || std::abs(int(codes[n * shape.k + k])) == 127;
            }
            CHECK(reaches_127);
          }
        for (int64_t k = 0; k < shape.k; k++) CHECK(back[size_t(k)] == 0.0f);
      }
}

TEST_CASE("quantize_int8_copy: the copy's quant_linear is the float matmul over its dequantized rows") {
  std::mt19937 rng(4502);
  const int64_t n = 41, k = 256, tokens = 3;
  std::vector<float> w = random_floats(rng, size_t(n * k));
  Result<QuantWeight> copy = quantize_int8_copy(Tensor::matrix(w.data(), DType::F32, n, k), "w");
  REQUIRE_MESSAGE(copy, copy.error().message);
  const std::vector<float> deq = dequantized(*copy), x = random_floats(rng, size_t(tokens * k));
  std::vector<float> out(size_t(tokens * n), std::nanf(""));
  REQUIRE(quant_linear(x.data(), k, tokens, *copy, out.data(), n).ok());
  std::vector<double> want, magnitude;
  double_matmul(x, tokens, deq, n, k, want, magnitude);
  for (size_t i = 0; i < out.size(); i++) CHECK(std::fabs(out[i] - want[i]) <= 1e-5 * magnitude[i] + 1e-30);
}

TEST_CASE("quantize_int8_copy refuses what it cannot read, naming it") {
  std::vector<float> w(64, 0.5f);
  auto status = [](const Result<QuantWeight>& r) { return r ? Status{} : Status{r.error()}; };
  check_error(status(quantize_int8_copy(Tensor{}, "lm_head")), ErrorCode::invalid_argument, {"lm_head", "need data"});
  check_error(status(quantize_int8_copy(Tensor{w.data(), DType::F32, 2, 32, 16}, "lm_head")),
              ErrorCode::invalid_argument, {"row stride 16"});
  check_error(status(quantize_int8_copy(Tensor::matrix(w.data(), DType::I8, 2, 32), "lm_head")),
              ErrorCode::invalid_argument, {"dtype", "BF16, F16 or F32"});
  check_error(status(quantize_int8_copy(Tensor::matrix(w.data(), DType::F32, 2, 32), "lm_head", 0)),
              ErrorCode::invalid_argument, {"threads"});
  CHECK(int8_copy_bytes(0, 64) == 0);
  CHECK(int8_copy_bytes(INT64_MAX, INT64_MAX / 2) == UINT64_MAX);
}
