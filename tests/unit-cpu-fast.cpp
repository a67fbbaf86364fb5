// cpu-fast: the CPU backend's fast Linear kernels (CpuKernels::fast, the default) against its reference kernels,
// on fresh random inputs (never zeros) at odd shapes, outputs poisoned with NaN first, every instruction set this
// machine has forced in turn (portable always; AVX2, AVX-512 where the CPU has them; NEON on AArch64, where
// tests/neon_qemu.sh runs this file under qemu-user). The two sum in different
// orders, so they are compared within float32 rounding of the row's sum of |w| |x|; the int4, int8 and fp8
// weights the fast kernels multiply are the reference's dequantized values exactly (checked bit for bit with
// one-hot activations), so nothing else may differ.
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include "host_floats.hpp"
#include "quant_weights.hpp"
#include "model_fixtures.hpp"
#include "paged_attention.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

using namespace kvlite;
using namespace host_floats;

namespace {

std::unique_ptr<Backend> cpu(CpuKernels kernels, CpuIsa isa, int threads, int64_t max_head_dim = 64) {
  CpuBackendOptions options;
  options.threads = threads;
  options.max_head_dim = max_head_dim;
  options.kernels = kernels;
  options.isa = isa;
  return make_cpu_backend(options).value();
}

// The instruction sets this machine runs: portable, then AVX2 and AVX-512 if present.
std::vector<CpuIsa> machine_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::portable, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::neon})
    if (cpu_isa_supported(isa)) isas.push_back(isa);
  return isas;
}

// Both kernels' float32 sums over k products, each off the exact sum by at most (additions in its longest
// chain + the lane reduction + the bias) unit roundoffs of the magnitude: the reference k / 8 + 8, the fast ones
// at most k / 8 + 16 (8 lanes; 16 lanes has fewer); the difference of the two is below their sum. For
// k <= 400 this is below 1e-5 of the magnitude.
double allowance(int64_t k, double magnitude) { return double(2 * (k / 8) + 32) * 0x1p-24 * magnitude; }

const DType kWeightTypes[] = {DType::F32, DType::BF16, DType::F16};

// A backend for quant_linear tests: int8 W8A8 needs its activation buffer; fp8_activations: W8A8 for fp8.
std::unique_ptr<Backend> quant_cpu(CpuKernels kernels, CpuIsa isa, int threads, bool fp8_activations = false) {
  CpuBackendOptions options;
  options.threads = threads;
  options.max_head_dim = 64;
  options.kernels = kernels;
  options.isa = isa;
  options.int8_activations = true;
  options.fp8_activations = fp8_activations;
  // the largest K below (int8 groups of 128: 3 and a half): the fast kernels keep their tables (act-order int8: 2
  // floats a group a row) in the backend's per-thread dequantization scratch of 16 rows of K floats, no buffer
  // of their own; sized to the largest weight, tables that outgrew it would overrun the last thread's slice
  options.max_quant_in_features = 448;
  return make_cpu_backend(options).value();
}

// The activation rows the matmul multiplies: W8A8 int8 / fp8 quantize-dequantize them first (as both kernels do).
std::vector<float> matmul_rows(const Matrix& x, const QuantWeight& w, bool fp8_activations) {
  std::vector<float> rows(size_t(x.rows * x.cols));
  for (int64_t t = 0; t < x.rows; t++)
    for (int64_t k = 0; k < x.cols; k++) rows[size_t(t * x.cols + k)] = x.get(t, k);
  for (int64_t t = 0; t < x.rows; t++) {
    float* row = rows.data() + t * x.cols;
    if (w.format == WeightFormat::int8 && w.int8_activations) detail::fake_quantize_int8_row(row, x.cols, row);
    if (w.format == WeightFormat::fp8 && fp8_activations)
      detail::fake_quantize_fp8_row(row, x.cols, detail::fp8_activation_group(w), row);
  }
  return rows;
}

// quant_linear of `weight` on random x ([tokens, K], never zeros) through the fast backends (each thread
// count; outputs poisoned) against the reference: within float32 rounding of each output's sum of |w x| (+ |bias|),
// and every fast backend's bits the same (threads change no bit).
void check_quant_linear(Backend& reference, const std::vector<Backend*>& fasts, const QuantWeight& weight,
                        int64_t tokens, Random& rng, bool fp8_activations = false) {
  const int64_t k = weight.in_features, n = weight.out_features;
  std::vector<float> dequantized(size_t(n * k));
  REQUIRE(dequantize_rows(weight, 0, n, dequantized.data()).ok());
  Matrix x(DType::F32, tokens, k, 3), want(DType::F32, tokens, n, 2);
  x.randomize(rng);
  REQUIRE(reference.quant_linear(x.view(), weight, want.view()).ok());
  const std::vector<float> rows = matmul_rows(x, weight, fp8_activations);
  std::vector<Matrix> gots;
  for (Backend* fast : fasts) {
    gots.emplace_back(DType::F32, tokens, n, 2);
    REQUIRE(fast->quant_linear(x.view(), weight, gots.back().view()).ok());
  }
  Compare cmp{0, 0};
  bool same_for_all_threads = true;
  for (int64_t t = 0; t < tokens; t++)
    for (int64_t j = 0; j < n; j++) {
      double magnitude = weight.bias ? std::fabs(double(scale_at(weight.bias, weight.bias_dtype, j))) : 0.0;
      for (int64_t i = 0; i < k; i++)
        magnitude += std::fabs(double(rows[size_t(t * k + i)]) * dequantized[size_t(j * k + i)]);
      cmp(gots[0].get(t, j), want.get(t, j), t, j, allowance(k, magnitude));
      for (const Matrix& got : gots)
        same_for_all_threads = same_for_all_threads && got.get(t, j) == gots[0].get(t, j);
    }
  CHECK_COMPARE(cmp);
  CHECK(same_for_all_threads);
  for (const Matrix& got : gots) CHECK(got.padding_untouched());
}

// The dequantized weights the fast kernels multiply are dequantize_rows' bit for bit: with one-hot activation
// rows (token t is column t), out[t, j] = 1 x w[j, t] plus signed zeros, exactly w[j, t] (+ 0: -0 compares
// equal). Without a bias; K tokens.
void check_dequantized_exactly(Backend& fast, const QuantWeight& weight) {
  const int64_t k = weight.in_features, n = weight.out_features;
  std::vector<float> dequantized(size_t(n * k));
  REQUIRE(dequantize_rows(weight, 0, n, dequantized.data()).ok());
  Matrix x(DType::F32, k, k), got(DType::F32, k, n, 1);
  for (int64_t t = 0; t < k; t++)
    for (int64_t i = 0; i < k; i++) x.set(t, i, t == i ? 1.0f : 0.0f);
  REQUIRE(fast.quant_linear(x.view(), weight, got.view()).ok());
  int64_t differing = 0;
  for (int64_t t = 0; t < k; t++)
    for (int64_t j = 0; j < n; j++)
      if (!(got.get(t, j) == dequantized[size_t(j * k + t)])) {
        if (differing++ == 0)
          MESSAGE("w[" << j << ", " << t << "]: fast " << got.get(t, j) << ", dequantize_rows " << dequantized[size_t(j * k + t)]);
      }
  CHECK(differing == 0);
}

}  // namespace

TEST_CASE("the fast kernels' instruction sets: portable always, and what this CPU reports") {
  CHECK(cpu_isa_supported(CpuIsa::portable));
  CHECK(cpu_isa_supported(CpuIsa::automatic));
  for (CpuIsa isa : machine_isas()) MESSAGE("this machine runs the fast kernels on " << std::string(cpu_isa_name(isa)));
  MESSAGE("automatic picks " << std::string(cpu_isa_name(best_cpu_isa())));
  CHECK(cpu_isa_supported(best_cpu_isa()));
  for (CpuIsa isa : {CpuIsa::avx2, CpuIsa::avx512, CpuIsa::neon})
    if (!cpu_isa_supported(isa)) {  // forcing one the CPU lacks is an error, never a crash
      CpuBackendOptions options;
      options.kernels = CpuKernels::fast;
      options.isa = isa;
      auto backend = make_cpu_backend(options);
      REQUIRE_FALSE(backend.ok());
      CHECK(backend.error().code == ErrorCode::invalid_argument);
    }
  // the fast kernels are the default (issue 45); the reference is one option away
  CHECK(CpuBackendOptions{}.kernels == CpuKernels::fast);
  CHECK(EngineOptions{}.cpu_kernels == CpuKernels::fast);
  CHECK(make_cpu_backend().value()->name().find(std::string("fast ") + cpu_isa_name(best_cpu_isa())) != std::string::npos);
  CHECK(cpu(CpuKernels::reference, CpuIsa::automatic, 1)->name().find("fast") == std::string::npos);
  CHECK(cpu(CpuKernels::fast, CpuIsa::portable, 1)->name().find("fast portable") != std::string::npos);
}

TEST_CASE("fast dense linear matches the reference for BF16/F16/F32 weights at odd shapes, every ISA") {
  auto reference = cpu(CpuKernels::reference, CpuIsa::automatic, 2);
  Random rng(4501);
  for (CpuIsa isa : machine_isas()) {
    auto fast = cpu(CpuKernels::fast, isa, 2);
    auto fast_one = cpu(CpuKernels::fast, isa, 1);
    for (DType dtype : kWeightTypes)
      for (int64_t k : {1, 7, 8, 15, 16, 17, 33, 64, 129, 389})
        for (int64_t n : {1, 3, 4, 5, 17, 33})
          for (int64_t tokens : {1, 2, 3, 7, 8, 17})
            for (bool with_bias : {false, true}) {
              CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(std::string(dtype_name(dtype)));
              CAPTURE(k); CAPTURE(n); CAPTURE(tokens); CAPTURE(with_bias);
              Matrix x(DType::F32, tokens, k, 3), weight(dtype, n, k, 5), bias(dtype, 1, n);
              Matrix want(DType::F32, tokens, n, 2), got(DType::F32, tokens, n, 2), got_one(DType::F32, tokens, n, 1);
              x.randomize(rng);
              weight.randomize(rng);
              bias.randomize(rng);
              const Tensor bias_view = with_bias ? bias.view() : Tensor{};
              REQUIRE(reference->linear(x.view(), weight.view(), bias_view, want.view()).ok());
              REQUIRE(fast->linear(x.view(), weight.view(), bias_view, got.view()).ok());
              REQUIRE(fast_one->linear(x.view(), weight.view(), bias_view, got_one.view()).ok());
              Compare cmp{0, 0};
              bool same_for_one_thread = true;
              for (int64_t t = 0; t < tokens; t++)
                for (int64_t j = 0; j < n; j++) {
                  double magnitude = with_bias ? std::fabs(double(bias.get(0, j))) : 0.0;
                  for (int64_t i = 0; i < k; i++) magnitude += std::fabs(double(x.get(t, i)) * weight.get(j, i));
                  cmp(got.get(t, j), want.get(t, j), t, j, allowance(k, magnitude));
                  same_for_one_thread = same_for_one_thread && got.get(t, j) == got_one.get(t, j);
                }
              CHECK_COMPARE(cmp);
              CHECK(same_for_one_thread);  // threads change no bit
              CHECK(got.padding_untouched());
            }
  }
}

TEST_CASE("fast int4 quant_linear matches the reference: groups 8..128 and channel, zero points, every ISA") {
  auto reference = cpu(CpuKernels::reference, CpuIsa::automatic, 2);
  Random rng(4502);
  for (CpuIsa isa : machine_isas()) {
    auto fast = cpu(CpuKernels::fast, isa, 2);
    auto fast_one = cpu(CpuKernels::fast, isa, 1);
    for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
      for (int64_t group : {16, 24, 32, 40, 64, 128, 0})  // 0: channel (one group of K)
        for (int64_t groups : {1, 3})
          for (int64_t n : {1, 3, 5, 17, 34})
            for (bool asymmetric : {false, true}) {
              const int64_t k = group == 0 ? 8 * 37 : group * groups;
              if (group == 0 && groups > 1) continue;
              quant_test::OwnedWeight owned =
                  quant_test::make_int4(n, k, group == 0 ? k : group, scale_dtype, asymmetric, false, rng);
              const bool with_bias = n % 2 == 1;
              if (with_bias) {  // F32 bias [n]
                owned.bias.resize(size_t(n) * 4);
                for (int64_t j = 0; j < n; j++) {
                  const float value = rng.value(1.0f);
                  memcpy(&owned.bias[size_t(j) * 4], &value, 4);
                }
                owned.weight.bias = owned.bias.data();
                owned.weight.bias_dtype = DType::F32;
              }
              const QuantWeight& weight = owned.weight;
              std::vector<float> dequantized(size_t(n * k));
              REQUIRE(dequantize_rows(weight, 0, n, dequantized.data()).ok());
              for (int64_t tokens : {1, 2, 3, 7, 8, 17}) {
                CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(std::string(dtype_name(scale_dtype))); CAPTURE(group);
                CAPTURE(k); CAPTURE(n); CAPTURE(asymmetric); CAPTURE(tokens);
                Matrix x(DType::F32, tokens, k, 3);
                Matrix want(DType::F32, tokens, n, 2), got(DType::F32, tokens, n, 2), got_one(DType::F32, tokens, n);
                x.randomize(rng);
                REQUIRE(reference->quant_linear(x.view(), weight, want.view()).ok());
                REQUIRE(fast->quant_linear(x.view(), weight, got.view()).ok());
                REQUIRE(fast_one->quant_linear(x.view(), weight, got_one.view()).ok());
                Compare cmp{0, 0};
                bool same_for_one_thread = true;
                for (int64_t t = 0; t < tokens; t++)
                  for (int64_t j = 0; j < n; j++) {
                    double magnitude = 0;
                    if (with_bias) {
                      float b;
                      memcpy(&b, &owned.bias[size_t(j) * 4], 4);
                      magnitude = std::fabs(double(b));
                    }
                    for (int64_t i = 0; i < k; i++)
                      magnitude += std::fabs(double(x.get(t, i)) * dequantized[size_t(j * k + i)]);
                    cmp(got.get(t, j), want.get(t, j), t, j, allowance(k, magnitude));
                    same_for_one_thread = same_for_one_thread && got.get(t, j) == got_one.get(t, j);
                  }
                CHECK_COMPARE(cmp);
                CHECK(same_for_one_thread);
                CHECK(got.padding_untouched());
              }
            }
  }
}

TEST_CASE("int4 weights the fast kernels do not cover (act-order g_idx, groups of 8) run the reference, bit for bit") {
  auto reference = cpu(CpuKernels::reference, CpuIsa::automatic, 2);
  Random rng(4503);
  for (CpuIsa isa : machine_isas())
    for (bool act_order : {true, false}) {
      CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(act_order);
      auto fast = cpu(CpuKernels::fast, isa, 2);
      quant_test::OwnedWeight owned = quant_test::make_int4(19, 96, act_order ? 32 : 8, DType::BF16, true, act_order, rng);
      Matrix x(DType::F32, 5, 96), want(DType::F32, 5, 19), got(DType::F32, 5, 19);
      x.randomize(rng);
      REQUIRE(reference->quant_linear(x.view(), owned.weight, want.view()).ok());
      REQUIRE(fast->quant_linear(x.view(), owned.weight, got.view()).ok());
      CHECK(want.bytes == got.bytes);
    }
}

TEST_CASE("fast int8 quant_linear matches the reference: groups, act-order, zero points, W8A8, scale dtypes, every ISA") {
  auto reference = quant_cpu(CpuKernels::reference, CpuIsa::automatic, 2);
  Random rng(4505);
  for (CpuIsa isa : machine_isas()) {
    auto fast = quant_cpu(CpuKernels::fast, isa, 2), fast_one = quant_cpu(CpuKernels::fast, isa, 1),
         fast_three = quant_cpu(CpuKernels::fast, isa, 3);
    const std::vector<Backend*> fasts{fast.get(), fast_one.get(), fast_three.get()};
    for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
      for (int64_t group : {2, 7, 16, 24, 32, 128, 0})  // 0: channel (one group of K)
        for (int64_t groups : {1, 3})
          for (bool act_order : {false, true})
            for (bool asymmetric : {false, true}) {
              if (group == 0 && (groups > 1 || act_order)) continue;
              const int64_t k = group == 0 ? 389 : group * groups + (act_order ? 0 : group / 2);  // a short last group
              const int64_t n = 1 + int64_t(rng.below(37));
              quant_test::OwnedWeight owned = quant_test::make_int8(n, k, group == 0 ? k : group, scale_dtype,
                                                                    asymmetric, act_order, false, rng);
              CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(std::string(dtype_name(scale_dtype))); CAPTURE(group);
              CAPTURE(k); CAPTURE(n); CAPTURE(act_order); CAPTURE(asymmetric);
              check_dequantized_exactly(*fast, owned.weight);
              if (n % 2 == 1) quant_test::add_bias(owned, scale_dtype, rng);
              for (bool w8a8 : {false, true}) {
                owned.weight.int8_activations = w8a8;
                for (int64_t tokens : {1, 2, 3, 7, 17}) {
                  CAPTURE(w8a8); CAPTURE(tokens);
                  check_quant_linear(*reference, fasts, owned.weight, tokens, rng);
                }
              }
            }
  }
}

TEST_CASE("fast fp8 quant_linear matches the reference: tensor, channel and block scales, both roundings, W8A8, every ISA") {
  Random rng(4506);
  for (bool fp8_activations : {false, true}) {
    auto reference = quant_cpu(CpuKernels::reference, CpuIsa::automatic, 2, fp8_activations);
    for (CpuIsa isa : machine_isas()) {
      auto fast = quant_cpu(CpuKernels::fast, isa, 2, fp8_activations);
      auto fast_one = quant_cpu(CpuKernels::fast, isa, 1, fp8_activations);
      auto fast_three = quant_cpu(CpuKernels::fast, isa, 3, fp8_activations);
      const std::vector<Backend*> fasts{fast.get(), fast_one.get(), fast_three.get()};
      for (DType scale_dtype : {DType::BF16, DType::F16, DType::F32})
        for (DequantRounding rounding : {DequantRounding::scale_dtype, DequantRounding::f32})
          for (ScaleGranularity granularity : {ScaleGranularity::tensor, ScaleGranularity::channel, ScaleGranularity::block})
            for (int64_t k : {1, 15, 17, 64, 131, 389}) {
              const int64_t n = 1 + int64_t(rng.below(37));
              const int64_t block_n = granularity == ScaleGranularity::block ? 1 + int64_t(rng.below(8)) : 0;
              const int64_t block_k = granularity == ScaleGranularity::block ? int64_t(std::vector<int64_t>{3, 16, 24, 128}[size_t(rng.below(4))]) : 0;
              quant_test::OwnedWeight owned =
                  quant_test::make_fp8(n, k, granularity, block_n, block_k, scale_dtype, rounding, rng);
              CAPTURE(fp8_activations); CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(std::string(dtype_name(scale_dtype)));
              CAPTURE(int(rounding)); CAPTURE(int(granularity)); CAPTURE(k); CAPTURE(n); CAPTURE(block_n); CAPTURE(block_k);
              if (!fp8_activations) check_dequantized_exactly(*fast, owned.weight);
              if (n % 2 == 0) quant_test::add_bias(owned, DType::BF16, rng);
              for (int64_t tokens : {1, 2, 3, 7, 17}) {
                CAPTURE(tokens);
                check_quant_linear(*reference, fasts, owned.weight, tokens, rng, fp8_activations);
              }
            }
    }
  }
}

TEST_CASE("fast e4m3 decoding is fp8_e4m3_to_float for all 254 finite codes, every ISA") {
  // one row holding every finite code, scale 1 (F32): the one-hot products are the decoded values themselves
  Random rng(4507);
  for (CpuIsa isa : machine_isas()) {
    CAPTURE(std::string(cpu_isa_name(isa)));
    auto fast = quant_cpu(CpuKernels::fast, isa, 1);
    quant_test::OwnedWeight owned =
        quant_test::make_fp8(1, 254, ScaleGranularity::tensor, 0, 0, DType::F32, DequantRounding::f32, rng);
    const float one = 1.0f;
    memcpy(owned.scales.data(), &one, 4);
    std::vector<bool> seen(256, false);
    for (uint8_t code : owned.fp8) seen[code] = true;
    CHECK(std::count(seen.begin(), seen.end(), true) == 254);
    check_dequantized_exactly(*fast, owned.weight);
  }
}

TEST_CASE("16-bit activations run the reference under fast kernels, bit for bit") {
  Random rng(4504);
  for (DType act : {DType::BF16, DType::F16}) {
    CpuBackendOptions options;
    options.threads = 2;
    options.activation_dtype = act;
    options.kernels = CpuKernels::reference;
    auto reference = make_cpu_backend(options).value();
    options.kernels = CpuKernels::fast;
    auto fast = make_cpu_backend(options).value();
    Matrix x(act, 3, 37), weight(DType::BF16, 11, 37), want(act, 3, 11), got(act, 3, 11);
    x.randomize(rng);
    weight.randomize(rng);
    REQUIRE(reference->linear(x.view(), weight.view(), Tensor{}, want.view()).ok());
    REQUIRE(fast->linear(x.view(), weight.view(), Tensor{}, got.view()).ok());
    CHECK(want.bytes == got.bytes);
  }
}

// ---- attention ----------------------------------------------------------------------------------------------
// The fast kernels' attention (src/cpu_attention.inl): blocks of keys scored by the Linear tiles, one softmax
// rescale a block, p V in SIMD. Against the naive softmax in double (tests/paged_attention.hpp) within the
// tolerance the reference loop meets in cpu-ops:, and against that loop itself.
namespace {
std::unique_ptr<Backend> attention_cpu(CpuKernels kernels, CpuIsa isa, int threads) {
  return cpu(kernels, isa, threads, 128);  // head dims up to 128
}
}  // namespace

TEST_CASE("fast attention matches the naive softmax: GQA, head dims 8..128, pages, windows, soft caps, KV dtypes, every ISA") {
  using namespace paged_attention;
  Random rng(4610);
  struct Case { int64_t heads, kv_heads, head_dim, page_tokens; DType kv; int64_t window; float cap; };
  const Case cases[] = {
      {4, 2, 16, 5, DType::F32, 0, 0},      {6, 3, 40, 16, DType::BF16, 0, 0}, {8, 1, 72, 1, DType::F16, 0, 0},
      {16, 1, 64, 16, DType::BF16, 0, 0},   // two passes of 8 heads
      {16, 8, 128, 64, DType::F32, 0, 0},   // Qwen3-0.6B's heads; 64-token pages: two key blocks a page
      {12, 4, 8, 7, DType::F16, 0, 0},      {2, 2, 128, 16, DType::BF16, 9, 0},  // a sliding window of 9
      {4, 1, 64, 5, DType::F32, 30, 50.0f}, // window and Gemma 2's soft cap
      {8, 4, 40, 64, DType::F16, 0, 30.0f}};
  const std::vector<int64_t> contexts = {1, 23, 100};
  for (CpuIsa isa : machine_isas()) {
    auto fast = attention_cpu(CpuKernels::fast, isa, 3);
    for (const Case& c : cases) {
      CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(c.heads); CAPTURE(c.kv_heads); CAPTURE(c.head_dim);
      CAPTURE(c.page_tokens); CAPTURE(std::string(dtype_name(c.kv))); CAPTURE(c.window); CAPTURE(c.cap);
      PagedFixture fx(c.heads, c.kv_heads, c.head_dim, c.page_tokens, c.kv, contexts, rng);
      std::vector<Matrix> q, k, v;
      make_qkv(fx, contexts, rng, q, k, v);
      AttentionOptions options;
      options.window = c.window;
      options.logit_softcap = c.cap;
      const Matrix out = run_step(*fast, fx, Step{{0, 1, 2}, {0, 0, 0}, {1, 23, 100}}, q, k, v, options);
      Compare cmp{2e-6, 2e-6};
      int64_t row = 0;
      for (size_t s = 0; s < contexts.size(); s++) {
        const Matrix stored_k = as_stored(fx, k[s]), stored_v = as_stored(fx, v[s]);
        for (int64_t position = 0; position < contexts[s]; position++, row++) {
          const std::vector<double> want = reference_attention(fx, q[s], stored_k, stored_v, position, c.window, c.cap);
          for (int64_t col = 0; col < out.cols; col++) cmp(out.get(row, col), want[size_t(col)], row, col);
        }
      }
      CHECK_COMPARE(cmp);
    }
  }
}

TEST_CASE("fast attention: a prefill in chunks, decode steps and any thread count give the bits of one prefill") {
  using namespace paged_attention;
  Random rng(4611);
  for (CpuIsa isa : machine_isas())
    for (int64_t page_tokens : {5, 64}) {
      CAPTURE(std::string(cpu_isa_name(isa))); CAPTURE(page_tokens);
      auto one = attention_cpu(CpuKernels::fast, isa, 1), three = attention_cpu(CpuKernels::fast, isa, 3);
      const std::vector<int64_t> contexts = {70};
      PagedFixture whole(6, 3, 40, page_tokens, DType::BF16, contexts, rng);
      PagedFixture chunked = whole;
      std::vector<Matrix> q, k, v;
      make_qkv(whole, contexts, rng, q, k, v);
      const Matrix all = run_step(*one, whole, Step{{0}, {0}, {70}}, q, k, v);
      std::vector<Matrix> parts;
      parts.push_back(run_step(*three, chunked, Step{{0}, {0}, {33}}, q, k, v));
      parts.push_back(run_step(*three, chunked, Step{{0}, {33}, {34}}, q, k, v));
      for (int64_t position = 67; position < 70; position++)
        parts.push_back(run_step(*three, chunked, Step{{0}, {position}, {1}}, q, k, v));
      int64_t row = 0, differing = 0;
      for (const Matrix& part : parts)
        for (int64_t r = 0; r < part.rows; r++, row++)
          for (int64_t col = 0; col < part.cols; col++) differing += part.get(r, col) != all.get(row, col);
      CHECK(row == 70);
      CHECK(differing == 0);
    }
}

TEST_CASE("fast attention: fp8 KV runs the reference loop, bit for bit") {
  using namespace paged_attention;
  Random rng(4612);
  auto reference = attention_cpu(CpuKernels::reference, CpuIsa::automatic, 2);
  auto fast = attention_cpu(CpuKernels::fast, CpuIsa::automatic, 2);
  const std::vector<int64_t> contexts = {9, 40};
  PagedFixture for_reference(8, 2, 64, 16, DType::F8_E4M3, contexts, rng);
  PagedFixture for_fast = for_reference;
  std::vector<Matrix> q, k, v;
  make_qkv(for_reference, contexts, rng, q, k, v);
  const Step step{{0, 1}, {0, 0}, {9, 40}};
  const Matrix want = run_step(*reference, for_reference, step, q, k, v);
  const Matrix got = run_step(*fast, for_fast, step, q, k, v);
  CHECK(want.bytes == got.bytes);
}

TEST_CASE("engines with --cpu-kernels fast reproduce transformers' logits and greedy tokens (fixtures, W4A16)") {
  // the three tiny dense fixtures (BF16, F32, F16 weights) and the W4A16 one (groups of 32 and 16, channel
  // scales, zero points, and act-order o_proj, which runs the reference)
  for (const std::string& dir : model_fixtures::dense_and_w4a16_dirs()) {
    CAPTURE(dir);
    EngineOptions options;
    options.backend = BackendChoice::cpu;
    options.plan.device_mem = 64 * MiB;
    options.cpu_kernels = CpuKernels::fast;
    auto engine = Engine::open(dir, options);
    REQUIRE_MESSAGE(engine, engine.error().message);
    CHECK((*engine)->info().backend_name.find("fast") != std::string::npos);
    const nlohmann::json reference = nlohmann::json::parse(model_fixtures::read_file(dir + "/reference.json"));
    for (const auto& prompt : reference["prompts"]) {
      const std::vector<int32_t> ids = model_fixtures::ids_of(prompt["input_ids"]);
      model_fixtures::Npy expected = model_fixtures::read_npy(dir + "/" + prompt["logits_file"].get<std::string>());
      auto logits = (*engine)->logits(ids);
      REQUIRE_MESSAGE(logits, logits.error().message);
      REQUIRE(logits->tokens == expected.rows);
      REQUIRE(logits->vocab == expected.cols);
      CHECK(model_fixtures::relative_max_diff(logits->values, expected.values) <= 1e-4);
      SamplingParams params;  // temperature 0: greedy
      params.max_tokens = prompt["greedy"]["max_new_tokens"].get<int64_t>();
      auto generation = (*engine)->generate(ids, params);
      REQUIRE_MESSAGE(generation, generation.error().message);
      CHECK(generation->ids == model_fixtures::ids_of(prompt["greedy"]["new_ids"]));
    }
  }
}
