// cpu-lowp: CpuKernels::fast_lowp, the CPU Linear kernels with llama.cpp's numerics (src/cpu_lowp.inl), on fresh
// random inputs (never zeros) at odd shapes, outputs poisoned with NaN first, every instruction set this machine
// has forced in turn (portable always; AVX2; AVX-512, whose integer kernels use VNNI where the CPU has it; NEON,
// whose integer kernels use sdot where the CPU has it: tests/neon_qemu.sh runs this file on emulated AArch64).
//
// What is checked, and against what:
//   - the activation quantizer against its definition, recomputed here (d = max|x| / 127 per 32 columns,
//     q = nearest-even(x 127 / max|x|) clamped to +-127; the int4 layout's column order; the group sums),
//     and its rounding bound |x - d q| <= d / 2;
//   - each integer kernel against the formula in double over the test's own exact weights ((u - 8 - zero) s,
//     (q - zero) s, unrounded), on the quantized activations: within float32 rounding of the magnitude;
//   - the BF16 kernel against sum w bf16(x) in double;
//   - and all of them against the reference (f32 activations): the error the rounding adds, rms over outputs,
//     stays under 1% of the outputs' rms for the int8 kernels and 0.5% for bf16;
//   - weights the lowp kernels do not take (K or groups not whole 128s, act-order, W8A8, fp8, F16 weights) run
//     CpuKernels::fast's kernels, bit for bit; threads change no bit;
//   - an engine with fast-lowp reproduces transformers' logits within that rounding, and its plan's workspace row
//     counts the activation buffer.
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include "host_floats.hpp"
#include "quant_weights.hpp"
#include "model_fixtures.hpp"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <vector>

using namespace kvlite;
using namespace host_floats;

namespace {

std::vector<CpuIsa> machine_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::portable, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::neon})
    if (cpu_isa_supported(isa)) isas.push_back(isa);
  return isas;
}

std::unique_ptr<Backend> cpu(CpuKernels kernels, CpuIsa isa, int threads, int64_t max_k = 1024) {
  CpuBackendOptions options;
  options.threads = threads;
  options.max_head_dim = 64;
  options.kernels = kernels;
  options.isa = isa;
  options.int8_activations = true;  // W8A8 weights below
  options.max_quant_in_features = max_k;
  return make_cpu_backend(options).value();
}

// The activation quantization as defined (cpu_lowp.inl's header), natural column order.
struct Quantized {
  std::vector<float> d;       // per 32 columns
  std::vector<int32_t> q;     // per column
  std::vector<float> values;  // d q
};
Quantized quantize_as_defined(const float* x, int64_t k) {
  Quantized out;
  for (int64_t b = 0; b < k / 32; b++) {
    float amax = 0;
    for (int64_t i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const float d = amax / 127.0f, inverse = amax > 0 ? 127.0f / amax : 0.0f;
    out.d.push_back(d);
    for (int64_t i = 0; i < 32; i++) {
      const float v = std::min(127.0f, std::max(-127.0f, x[b * 32 + i] * inverse));
      out.q.push_back(int32_t(std::nearbyint(v)));
      out.values.push_back(d * float(out.q.back()));
    }
  }
  return out;
}

// Row n's exact weights (unrounded products of code and scale), as the lowp formula takes them.
std::vector<double> exact_row(const QuantWeight& w, int64_t n) {
  std::vector<double> row(size_t(w.in_features));
  for (int64_t k = 0; k < w.in_features; k++) {
    const int64_t g = k / w.group_size;
    const double s = scale_at(w.scales, w.scale_dtype, n * w.scale_cols + g);
    if (w.format == WeightFormat::int4) {
      const int zero = w.zero_points ? int4_zero_point_at(w.zero_points, w.scale_cols, n, g) : 0;
      row[size_t(k)] = double(int4_packed_at(w.packed + 4 * n * w.packed_cols, k) - zero) * s;
    } else {
      const int zero = w.zero_points ? int8_t(w.zero_points[n * w.scale_cols + g]) : 0;
      row[size_t(k)] = double(int8_t(w.int8[n * w.in_features + k]) - zero) * s;
    }
  }
  return row;
}

double rms(const std::vector<double>& v) {
  double sum = 0;
  for (double e : v) sum += e * e;
  return std::sqrt(sum / double(std::max<size_t>(1, v.size())));
}

// Both checks of one int weight: lowp (every ISA, 2 threads; and 1 and 3 threads on the first ISA) against the
// formula in double within float rounding of the magnitude, and against the reference within the rounding the
// two differ by (sum |w| |x - d q| + |x| |w - the reference's w rounded to the scale's dtype|, plus both sums'
// float rounding). Returns the rms of (lowp - reference) over the rms of the outputs.
double check_int_weight(const QuantWeight& weight, int64_t tokens, Random& rng) {
  const int64_t k = weight.in_features, n = weight.out_features;
  Matrix x(DType::F32, tokens, k, 3), want(DType::F32, tokens, n, 2);
  x.randomize(rng);
  auto reference = cpu(CpuKernels::reference, CpuIsa::automatic, 2);
  REQUIRE(reference->quant_linear(x.view(), weight, want.view()).ok());
  std::vector<std::vector<double>> rows;
  for (int64_t j = 0; j < n; j++) rows.push_back(exact_row(weight, j));
  std::vector<float> rounded(static_cast<size_t>(n * k));  // the reference's weights
  REQUIRE(dequantize_rows(weight, 0, n, rounded.data()).ok());
  double relative_rms = 0;
  std::vector<Quantized> quantized;
  for (int64_t t = 0; t < tokens; t++) {
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; i++) row[size_t(i)] = x.get(t, i);
    quantized.push_back(quantize_as_defined(row.data(), k));
  }
  const std::vector<CpuIsa> isas = machine_isas();
  std::vector<float> first_bits;
  for (CpuIsa isa : isas)
    for (int threads : {2, 1, 3}) {
      if (threads != 2 && isa != isas.front()) continue;
      CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(threads); CAPTURE(tokens);
      auto lowp = cpu(CpuKernels::fast_lowp, isa, threads);
      Matrix got(DType::F32, tokens, n, 2);
      REQUIRE(lowp->quant_linear(x.view(), weight, got.view()).ok());
      Compare cmp{0, 0}, against_reference{0, 0};
      std::vector<double> errors, outputs;
      std::vector<float> bits;
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t j = 0; j < n; j++) {
          double expected = 0, magnitude = 0, rounding = 0;
          for (int64_t i = 0; i < k; i++) {
            const double w = rows[size_t(j)][size_t(i)], xi = x.get(t, i);
            rounding += std::fabs(w) * std::fabs(xi - quantized[size_t(t)].values[size_t(i)]) +
                        std::fabs(xi) * std::fabs(w - rounded[size_t(j * k + i)]) +
                        double(k / 8 + 48) * 0x1p-24 * std::fabs(w * xi);
            // the codes' offsets are summed apart (u q and offset q), so the magnitude counts both
            const double product = rows[size_t(j)][size_t(i)] * quantized[size_t(t)].values[size_t(i)];
            expected += product;
            magnitude += std::fabs(product) + 24.0 * std::fabs(double(scale_at(weight.scales, weight.scale_dtype,
                                                                               j * weight.scale_cols + i / weight.group_size)) *
                                                                quantized[size_t(t)].values[size_t(i)]);
          }
          if (weight.bias) {
            const double b = scale_at(weight.bias, weight.bias_dtype, j);
            expected += b;
            magnitude += std::fabs(b);
          }
          const double float_rounding = double(k / 16 + 32) * 0x1p-24 * magnitude;
          cmp(got.get(t, j), float(expected), t, j, float_rounding);
          against_reference(got.get(t, j), want.get(t, j), t, j, rounding + float_rounding);
          errors.push_back(double(got.get(t, j)) - want.get(t, j));
          outputs.push_back(want.get(t, j));
          bits.push_back(got.get(t, j));
        }
      CHECK_COMPARE(cmp);
      CHECK_COMPARE(against_reference);
      CHECK(got.padding_untouched());
      relative_rms = rms(errors) / rms(outputs);
      if (isa == isas.front()) {  // threads change no bit
        if (first_bits.empty()) first_bits = bits;
        else CHECK(bits == first_bits);
      }
    }
  return relative_rms;
}

}  // namespace

TEST_CASE("fast-lowp: the backend names its kernels, and a CPU without the ISA asked for is refused") {
  auto lowp = cpu(CpuKernels::fast_lowp, CpuIsa::automatic, 1);
  CHECK(lowp->name().find("fast-lowp") != std::string::npos);
  CHECK(std::string(cpu_kernels_name(CpuKernels::fast_lowp)) == "fast-lowp");
  MESSAGE("fast-lowp here: " << lowp->name());
  // tests/neon_qemu.sh runs this suite on emulated AArch64 CPUs with and without the dot-product extension and
  // names the integer kernels each must pick (the sdot ones, or the portable fallback)
  if (const char* expected = std::getenv("KVLITE_EXPECT_LOWP_KERNELS"))
    CHECK(lowp->name().find(expected) != std::string::npos);
  for (CpuIsa isa : {CpuIsa::avx2, CpuIsa::avx512, CpuIsa::neon})
    if (!cpu_isa_supported(isa)) {
      CpuBackendOptions options;
      options.kernels = CpuKernels::fast_lowp;
      options.isa = isa;
      CHECK(make_cpu_backend(options).error().code == ErrorCode::invalid_argument);
    }
}

TEST_CASE("fast-lowp: the activation quantizer is its definition, in both layouts, within half a step") {
  Random rng(4601);
  for (int64_t k : {128, 384, 1024})
    for (bool int4_layout : {true, false})
      for (int64_t group : {128, 256, 0}) {
        const int64_t g = group == 0 ? k : group;
        if (k % g != 0) continue;
        CAPTURE(k); CAPTURE(int4_layout); CAPTURE(g);
        std::vector<float> x(static_cast<size_t>(k));
        for (float& v : x) v = rng.value(3.0f);
        x[5] = 0.0f;  // a zero, and a block whose max is exact
        std::vector<int8_t> q(static_cast<size_t>(k), int8_t(99));
        std::vector<float> lanes(static_cast<size_t>(k / 4), NAN), sums(static_cast<size_t>(k / g), NAN);
        detail::quantize_q8_activations(x.data(), k, int4_layout, g, q.data(), lanes.data(), sums.data());
        const Quantized want = quantize_as_defined(x.data(), k);
        int64_t wrong_q = 0, wrong_lane = 0, outside = 0;
        for (int64_t i = 0; i < k; i++) {
          const int64_t at = int4_layout ? (i / 128) * 128 + (i % 2) * 64 + (i % 128) / 2 : i;
          wrong_q += q[size_t(at)] != want.q[size_t(i)];
          const float d = want.d[size_t(i / 32)];
          outside += !(std::fabs(x[size_t(i)] - d * float(want.q[size_t(i)])) <= 0.5f * d * (1 + 1e-6f));
        }
        // lane scales: int4, lane l of each 128 columns is block l / 4; int8, lane l of each 64 is block l / 8
        for (int64_t v = 0; v < (int4_layout ? k / 128 : k / 64); v++)
          for (int64_t lane = 0; lane < 16; lane++) {
            const int64_t block = int4_layout ? v * 4 + lane / 4 : v * 2 + lane / 8;
            wrong_lane += lanes[size_t(v * 16 + lane)] != want.d[size_t(block)];
          }
        CHECK(wrong_q == 0);
        CHECK(wrong_lane == 0);
        CHECK(outside == 0);
        for (int64_t group_index = 0; group_index < k / g; group_index++) {
          double sum = 0;
          for (int64_t i = group_index * g; i < (group_index + 1) * g; i++) sum += double(want.values[size_t(i)]);
          CHECK(std::fabs(sums[size_t(group_index)] - sum) <= 1e-5 * (1 + std::fabs(sum)));
        }
      }
}

TEST_CASE("fast-lowp int4: the formula on int8 activations, groups 128 / 256 / channel, zero points, every ISA") {
  Random rng(4602);
  for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
    for (int64_t group : {128, 256, 0})
      for (int64_t n : {1, 5, 19})
        for (bool asymmetric : {false, true}) {
          const int64_t k = group == 256 ? 512 : 384;
          const int64_t g = group == 0 ? k : group;
          quant_test::OwnedWeight owned = quant_test::make_int4(n, k, g, scale_dtype, asymmetric, false, rng);
          if (n == 5) quant_test::add_bias(owned, DType::BF16, rng);
          for (int64_t tokens : {1, 2, 4, 7}) {
            CAPTURE(std::string(dtype_name(scale_dtype))); CAPTURE(g); CAPTURE(n); CAPTURE(asymmetric);
            check_int_weight(owned.weight, tokens, rng);
          }
        }
}

TEST_CASE("fast-lowp int8: the formula on int8 activations, groups 128 / channel, zero points, every ISA") {
  Random rng(4603);
  for (DType scale_dtype : {DType::BF16, DType::F32})
    for (int64_t group : {128, 0})
      for (int64_t n : {1, 6, 17})
        for (bool asymmetric : {false, true}) {
          const int64_t k = 256;
          const int64_t g = group == 0 ? k : group;
          quant_test::OwnedWeight owned = quant_test::make_int8(n, k, g, scale_dtype, asymmetric, false, false, rng);
          if (n == 6) quant_test::add_bias(owned, DType::F32, rng);
          for (int64_t tokens : {1, 3, 4, 9}) {
            CAPTURE(std::string(dtype_name(scale_dtype))); CAPTURE(g); CAPTURE(n); CAPTURE(asymmetric);
            check_int_weight(owned.weight, tokens, rng);
          }
        }
}

TEST_CASE("fast-lowp: more tokens than one activation chunk (64) quantize and multiply chunk by chunk") {
  Random rng(4604);
  quant_test::OwnedWeight int4 = quant_test::make_int4(13, 256, 128, DType::BF16, true, false, rng);
  check_int_weight(int4.weight, 67, rng);
  quant_test::OwnedWeight int8 = quant_test::make_int8(11, 128, 128, DType::BF16, false, false, false, rng);
  check_int_weight(int8.weight, 70, rng);
}

TEST_CASE("fast-lowp's error against the reference, rms over a Qwen3-0.6B-wide layer, is under 1% (int8) and 0.5% (bf16)") {
  // what README and bench/RESULTS.md quote: random weights and activations, 96 rows x K = 1024, 8 tokens
  Random rng(4607);
  quant_test::OwnedWeight int4 = quant_test::make_int4(96, 1024, 128, DType::BF16, false, false, rng);
  const double int4_error = check_int_weight(int4.weight, 8, rng);
  quant_test::OwnedWeight int8 = quant_test::make_int8(96, 1024, 1024, DType::BF16, false, false, false, rng);
  const double int8_error = check_int_weight(int8.weight, 8, rng);
  // --cpu-lm-head int8's copy of a BF16 matrix (groups of 128, F32 scales) runs the same int8 kernels
  Matrix dense(DType::BF16, 96, 1024);
  dense.randomize(rng);
  Result<QuantWeight> copy = quantize_int8_copy(dense.view(), "lm_head (int8 copy)", 2);
  REQUIRE_MESSAGE(copy, copy.error().message);
  const double copy_error = check_int_weight(*copy, 8, rng);
  MESSAGE("rms error over rms output: int4 x int8 " << int4_error << ", int8 x int8 " << int8_error
                                                    << ", int8 copy x int8 " << copy_error);
  CHECK(int4_error < 0.01);
  CHECK(int8_error < 0.01);
  CHECK(copy_error < 0.01);
  auto lowp = cpu(CpuKernels::fast_lowp, CpuIsa::automatic, 2);
  auto reference = cpu(CpuKernels::reference, CpuIsa::automatic, 2);
  Matrix x(DType::F32, 8, 1024), weight(DType::BF16, 96, 1024), got(DType::F32, 8, 96), want(DType::F32, 8, 96);
  x.randomize(rng);
  weight.randomize(rng);
  REQUIRE(lowp->linear(x.view(), weight.view(), Tensor{}, got.view()).ok());
  REQUIRE(reference->linear(x.view(), weight.view(), Tensor{}, want.view()).ok());
  std::vector<double> errors, outputs;
  for (int64_t t = 0; t < 8; t++)
    for (int64_t j = 0; j < 96; j++) {
      errors.push_back(double(got.get(t, j)) - want.get(t, j));
      outputs.push_back(want.get(t, j));
    }
  MESSAGE("rms error over rms output: bf16 x bf16 " << rms(errors) / rms(outputs));
  CHECK(rms(errors) < 0.005 * rms(outputs));
}

TEST_CASE("fast-lowp BF16: each product of bf16-rounded activations exact, summed in f32, every ISA") {
  Random rng(4605);
  for (CpuIsa isa : machine_isas())
    for (int64_t k : {20, 32, 100, 1024})  // 20: only a masked tail; 100: whole vectors and a tail
      for (int64_t n : {1, 7, 33})
        for (int64_t tokens : {1, 3, 4, 6, 66}) {
          CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(k); CAPTURE(n); CAPTURE(tokens);
          auto lowp = cpu(CpuKernels::fast_lowp, isa, 2);
          auto reference = cpu(CpuKernels::reference, CpuIsa::automatic, 2);
          Matrix x(DType::F32, tokens, k, 3), weight(DType::BF16, n, k, 1), bias(DType::F32, 1, n);
          Matrix got(DType::F32, tokens, n, 2), want(DType::F32, tokens, n, 2);
          x.randomize(rng);
          weight.randomize(rng);
          bias.randomize(rng);
          const Tensor bias_vector = Tensor::vector(bias.view().data, DType::F32, n);
          REQUIRE(lowp->linear(x.view(), weight.view(), bias_vector, got.view()).ok());
          REQUIRE(reference->linear(x.view(), weight.view(), bias_vector, want.view()).ok());
          Compare cmp{0, 0}, against_reference{0, 0};
          for (int64_t t = 0; t < tokens; t++)
            for (int64_t j = 0; j < n; j++) {
              double expected = bias.get(0, j), magnitude = std::fabs(double(bias.get(0, j))), rounding = 0;
              for (int64_t i = 0; i < k; i++) {
                const double xi = x.get(t, i), x16 = bf16_to_float(float_to_bf16(x.get(t, i)));
                const double product = double(weight.get(j, i)) * x16;
                expected += product;
                magnitude += std::fabs(product);
                rounding += std::fabs(double(weight.get(j, i))) * std::fabs(xi - x16);
              }
              const double float_rounding = double(k / 16 + 32) * 0x1p-24 * magnitude;
              cmp(got.get(t, j), float(expected), t, j, float_rounding);
              against_reference(got.get(t, j), want.get(t, j), t, j, rounding + 2 * float_rounding);
            }
          CHECK_COMPARE(cmp);
          CHECK_COMPARE(against_reference);
          CHECK(got.padding_untouched());
        }
}

TEST_CASE("fast-lowp BF16: one row or 8 streamed side by side give the same bits, and other widths are refused") {
  // On AVX-512 BF16 a one-token GEMV reads 8 rows side by side on Intel, one at a time elsewhere
  // (CpuBackendOptions::bf16_stream_rows); both orders must give each row the same sum. Elsewhere the option
  // changes nothing, and the check still holds.
  Random rng(4609);
  auto with_rows = [](int rows) {
    CpuBackendOptions options;
    options.threads = 2;
    options.max_head_dim = 64;
    options.kernels = CpuKernels::fast_lowp;
    options.bf16_stream_rows = rows;
    return make_cpu_backend(options).value();
  };
  auto one = with_rows(1), eight = with_rows(8), chosen = with_rows(0);
  MESSAGE("this CPU's choice: " << chosen->name());
  for (int64_t k : {32, 100, 1024})
    for (int64_t n : {1, 7, 8, 9, 17, 33, 100})
      for (int64_t tokens : {1, 2, 5}) {
        CAPTURE(k); CAPTURE(n); CAPTURE(tokens);
        Matrix x(DType::F32, tokens, k, 3), weight(DType::BF16, n, k, 1), bias(DType::F32, 1, n);
        Matrix by_one(DType::F32, tokens, n, 2), by_eight(DType::F32, tokens, n, 2), by_choice(DType::F32, tokens, n, 2);
        x.randomize(rng);
        weight.randomize(rng);
        bias.randomize(rng);
        const Tensor bias_vector = Tensor::vector(bias.view().data, DType::F32, n);
        REQUIRE(one->linear(x.view(), weight.view(), bias_vector, by_one.view()).ok());
        REQUIRE(eight->linear(x.view(), weight.view(), bias_vector, by_eight.view()).ok());
        REQUIRE(chosen->linear(x.view(), weight.view(), bias_vector, by_choice.view()).ok());
        Compare same{0, 0}, same_as_chosen{0, 0};
        for (int64_t t = 0; t < tokens; t++)
          for (int64_t j = 0; j < n; j++) {
            same(by_eight.get(t, j), by_one.get(t, j), t, j, 0.0);
            same_as_chosen(by_choice.get(t, j), by_one.get(t, j), t, j, 0.0);
          }
        CHECK_COMPARE(same);
        CHECK_COMPARE(same_as_chosen);
        CHECK(by_eight.padding_untouched());
      }
  for (int rows : {-1, 2, 4, 16}) {
    CpuBackendOptions options;
    options.kernels = CpuKernels::fast_lowp;
    options.bf16_stream_rows = rows;
    const auto made = make_cpu_backend(options);
    REQUIRE_FALSE(made.ok());
    CHECK(made.error().code == ErrorCode::invalid_argument);
    CHECK(made.error().message.find("bf16_stream_rows") != std::string::npos);
  }
}

TEST_CASE("fast-lowp: weights its kernels do not take run fast's kernels, bit for bit") {
  Random rng(4606);
  for (CpuIsa isa : machine_isas()) {
    CAPTURE(std::string(cpu_isa_name(isa)));
    auto lowp = cpu(CpuKernels::fast_lowp, isa, 2);
    auto fast = cpu(CpuKernels::fast, isa, 2);
    std::vector<quant_test::OwnedWeight> weights;
    weights.push_back(quant_test::make_int4(9, 96, 32, DType::BF16, false, false, rng));     // K not whole 128s
    weights.push_back(quant_test::make_int4(9, 256, 64, DType::BF16, true, false, rng));     // groups of 64
    weights.push_back(quant_test::make_int4(9, 256, 128, DType::BF16, false, true, rng));    // act-order
    weights.push_back(quant_test::make_int8(9, 256, 128, DType::BF16, false, false, true, rng));  // W8A8
    weights.push_back(quant_test::make_int8(9, 256, 128, DType::BF16, false, true, false, rng));  // act-order
    weights.push_back(quant_test::make_fp8(9, 256, ScaleGranularity::channel, 0, 0, DType::F32, DequantRounding::scale_dtype, rng));
    for (const quant_test::OwnedWeight& owned : weights) {
      CAPTURE(owned.weight.name); CAPTURE(owned.weight.in_features); CAPTURE(owned.weight.group_size);
      Matrix x(DType::F32, 3, owned.weight.in_features), a(DType::F32, 3, 9, 1), b(DType::F32, 3, 9, 1);
      x.randomize(rng);
      REQUIRE(lowp->quant_linear(x.view(), owned.weight, a.view()).ok());
      REQUIRE(fast->quant_linear(x.view(), owned.weight, b.view()).ok());
      CHECK(a.bytes == b.bytes);
    }
    for (DType dtype : {DType::F16, DType::F32}) {  // only BF16 weights take bf16 activations
      Matrix x(DType::F32, 2, 64), weight(dtype, 5, 64), a(DType::F32, 2, 5), b(DType::F32, 2, 5);
      x.randomize(rng);
      weight.randomize(rng);
      REQUIRE(lowp->linear(x.view(), weight.view(), Tensor{}, a.view()).ok());
      REQUIRE(fast->linear(x.view(), weight.view(), Tensor{}, b.view()).ok());
      CHECK(a.bytes == b.bytes);
    }
  }
}

TEST_CASE("engines with --cpu-kernels fast-lowp stay within the activation rounding of transformers' logits") {
  // the tiny dense fixtures (BF16 weights take bf16 activations; F32 / F16 ones run fast's kernels) and the
  // W4A16 one (its K of 64 is no whole 128s: fast's kernels)
  for (const std::string& dir : model_fixtures::dense_and_w4a16_dirs()) {
    CAPTURE(dir);
    EngineOptions options;
    options.backend = BackendChoice::cpu;
    options.plan.device_mem = 64 * MiB;
    options.cpu_kernels = CpuKernels::fast_lowp;
    auto engine = Engine::open(dir, options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    CHECK((*engine)->info().backend_name.find("fast-lowp") != std::string::npos);
    // the plan's workspace row is the backend's scratch with the activation buffer (it differs from fast's)
    const Plan& plan = (*engine)->plan();
    EngineOptions fast_options = options;
    fast_options.cpu_kernels = CpuKernels::fast;
    auto fast_plan = plan_engine(dir, fast_options);
    REQUIRE_MESSAGE(fast_plan, fast_plan.error().message);
    auto workspace = [](const Plan& p) {
      for (const PlanItem& item : p.items)
        if (item.key == "workspace") return item.bytes;
      return uint64_t(0);
    };
    CHECK(workspace(plan) > workspace(*fast_plan));
    const nlohmann::json config = nlohmann::json::parse(model_fixtures::read_file(dir + "/config.json"));
    const bool bf16_weights = config.value("dtype", config.value("torch_dtype", "")) == "bfloat16";
    const nlohmann::json reference = nlohmann::json::parse(model_fixtures::read_file(dir + "/reference.json"));
    size_t prompt_index = 0;
    for (const auto& prompt : reference["prompts"]) {
      const std::vector<int32_t> ids = model_fixtures::ids_of(prompt["input_ids"]);
      model_fixtures::Npy expected = model_fixtures::read_npy(dir + "/" + prompt["logits_file"].get<std::string>());
      auto logits = (*engine)->logits(ids);
      REQUIRE_MESSAGE(logits, logits.error().message);
      REQUIRE(logits->tokens == expected.rows);
      REQUIRE(logits->vocab == expected.cols);
      const double diff = model_fixtures::relative_max_diff(logits->values, expected.values);
      MESSAGE("relative max difference from transformers: " << diff << " (bf16 weights: " << bf16_weights << ")");
      // BF16 weights take bf16 activations: within transformers' own drift when it runs the model in bfloat16
      // (dtype_drift.json: all activations rounded, where lowp rounds only the Linears' inputs); the others run
      // fast's exact kernels
      const double tolerance =
          bf16_weights ? nlohmann::json::parse(model_fixtures::read_file(dir + "/dtype_drift.json"))["drift"]["bfloat16"]
                             .at(prompt_index).get<double>()
                       : 1e-4;
      CHECK(diff <= tolerance);
      prompt_index++;
    }
  }
}

TEST_CASE("engines with --cpu-lm-head int8 stay within the copy's rounding of transformers' logits, every kernel set") {
  // Tied (F32, F16) and untied (BF16) lm_heads. The copy moves logit v by h . (w_v - q_v s_v): relative to the
  // logits, about the copy's relative rms weight error eps (measured here on the fixture's own table), so the
  // bound is each kernel set's own tolerance (as in the test above) + 3 eps (measured: 1.0-1.6 eps). Where the
  // copy's K is whole 128-column chunks fast-lowp's int8 activations add their own rounding, which the layer
  // test above bounds by 1% rms (so + 3%); the fixtures' K of 64 runs fast's kernels, and that test covers the copy
  // at K = 1024.
  for (const std::string& dir : model_fixtures::dense_and_w4a16_dirs()) {
    CAPTURE(dir);
    Result<TensorStore> store = TensorStore::open_dir(dir);
    REQUIRE_MESSAGE(store, store.error().message);
    const TensorInfo* table = store->find("lm_head.weight");
    if (!table) table = store->find("model.embed_tokens.weight");
    REQUIRE(table != nullptr);
    const int64_t vocab = table->shape[0], hidden = table->shape[1];
    const Tensor stored = Tensor::matrix(const_cast<uint8_t*>(store->data(*table)), table->dtype, vocab, hidden);
    Result<QuantWeight> copy = quantize_int8_copy(stored, "lm_head", 2);
    REQUIRE_MESSAGE(copy, copy.error().message);
    std::vector<float> back(size_t(vocab * hidden));
    REQUIRE(dequantize_rows(*copy, 0, vocab, back.data()).ok());
    double error2 = 0, weight2 = 0;
    for (int64_t i = 0; i < vocab * hidden; i++) {
      const double w = scale_at(static_cast<const uint8_t*>(stored.data), stored.dtype, i);
      error2 += (w - back[size_t(i)]) * (w - back[size_t(i)]);
      weight2 += w * w;
    }
    const double eps = std::sqrt(error2 / weight2);
    MESSAGE("the int8 copy's relative rms weight error: " << eps);
    CHECK(eps > 0);
    CHECK(eps < 0.01);  // half a step of max/127 over groups of 64 random weights

    const nlohmann::json config = nlohmann::json::parse(model_fixtures::read_file(dir + "/config.json"));
    const bool bf16_weights = config.value("dtype", config.value("torch_dtype", "")) == "bfloat16";
    const nlohmann::json reference = nlohmann::json::parse(model_fixtures::read_file(dir + "/reference.json"));
    for (CpuKernels kernels : {CpuKernels::reference, CpuKernels::fast, CpuKernels::fast_lowp}) {
      const std::string kernel_set = cpu_kernels_name(kernels);
      CAPTURE(kernel_set);
      EngineOptions options;
      options.backend = BackendChoice::cpu;
      options.plan.device_mem = 64 * MiB;
      options.cpu_kernels = kernels;
      EngineOptions stored_options = options;
      options.cpu_lm_head = CpuLmHead::int8;
      auto engine = Engine::open(dir, options);
      REQUIRE_MESSAGE(engine, engine.error().message);
      auto stored_engine = Engine::open(dir, stored_options);
      REQUIRE_MESSAGE(stored_engine, stored_engine.error().message);
      // the plan's repack row holds the copy; a decode step reads it instead of the stored table
      auto repack = [](const Plan& p) {
        const PlanItem* item = p.item("repack");
        return item ? item->bytes : uint64_t(0);
      };
      CHECK(repack((*engine)->plan()) >= repack((*stored_engine)->plan()) + int8_copy_bytes(vocab, hidden));
      CHECK((*engine)->info().decode_weight_bytes + table->nbytes ==
            (*stored_engine)->info().decode_weight_bytes + int8_copy_bytes(vocab, hidden));
      size_t prompt_index = 0;
      for (const auto& prompt : reference["prompts"]) {
        const std::vector<int32_t> ids = model_fixtures::ids_of(prompt["input_ids"]);
        model_fixtures::Npy expected = model_fixtures::read_npy(dir + "/" + prompt["logits_file"].get<std::string>());
        auto logits = (*engine)->logits(ids);
        REQUIRE_MESSAGE(logits, logits.error().message);
        REQUIRE(logits->tokens == expected.rows);
        REQUIRE(logits->vocab == expected.cols);
        const double diff = model_fixtures::relative_max_diff(logits->values, expected.values);
        double tolerance = 1e-4 + 3 * eps;
        if (kernels == CpuKernels::fast_lowp) {
          if (hidden % 128 == 0) tolerance += 0.03;  // the copy takes the int8 kernels (whole 128-column chunks)
          if (bf16_weights)
            tolerance += nlohmann::json::parse(model_fixtures::read_file(dir + "/dtype_drift.json"))["drift"]["bfloat16"]
                             .at(prompt_index).get<double>();
        }
        MESSAGE("relative max difference from transformers: " << diff << " (bound " << tolerance << ")");
        CHECK(diff <= tolerance);
        prompt_index++;
      }
    }
  }
}
