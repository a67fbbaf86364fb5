// cuda-ops: every op of the CUDA backend against the CPU backend (the reference) on a real GPU, for each
// activation dtype (BF16, F16, F32): fresh seeded random inputs (never zeros) at many shapes including odd
// ones and strided views, outputs poisoned with NaN first and padded with NaN between rows (so a missed or
// stray write shows up), results compared within the activation dtype's rounding.
//
// Without a CUDA GPU (or in a build without CUDA) every case says "no CUDA GPU: skipped" and passes, unless
// KVLITE_REQUIRE_GPU=1 (tools/gpu-check.sh sets it), when it fails.
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include "gpu_test_support.hpp"
#include "host_floats.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numeric>
#include <random>

using namespace kvlite;
using namespace gpu_test;
using namespace host_floats;

namespace {

// `value` rounded to what `dtype` holds.
float round_to(DType dtype, float value) {
  uint8_t bytes[4];
  encode(dtype, value, bytes);
  return decode(dtype, bytes);
}

// One rounding step of the activation dtype, relative (an ulp at the bottom of a binade): the GPU rounds
// each stored result once, the CPU reference keeps F32.
double ulp(DType activation) {
  switch (activation) {
    case DType::BF16: return 1.0 / 128;
    case DType::F16: return 1.0 / 1024;
    default: return 1.0 / (1 << 20);  // F32: a few ulps of fp32 for different summation orders
  }
}

const DType kActivations[] = {DType::BF16, DType::F16, DType::F32};
const DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16};
// KV cache element types: the floats and e4m3 (with per-layer scales, make_cache).
const DType kKvTypes[] = {DType::F32, DType::BF16, DType::F16, DType::F8_E4M3};

// ---- the two backends -------------------------------------------------------------------------------------
struct Gpu {
  DType activation;
  DeviceMemory memory;
  std::unique_ptr<Backend> cuda, cpu;
  explicit Gpu(DType activation_, uint64_t workspace_bytes = kCudaWorkspaceBytes,
               uint64_t cublas_bytes = kCudaCublasWorkspaceBytes)
      : activation(activation_), memory(512 * MiB) {
    CudaBackendOptions options;
    options.activation_dtype = activation;
    options.workspace = memory.take(workspace_bytes);
    options.workspace_bytes = workspace_bytes;
    options.cublas_workspace_bytes = cublas_bytes;
    auto made = make_cuda_backend(options);
    if (!made.ok()) FAIL(made.error().message);
    cuda = std::move(*made);
    CHECK(cuda->activation_dtype() == activation);
    cpu = make_cpu_backend().value();
  }
};

// One tensor on both backends: `host` holds the bytes of the device copy (the GPU-side dtype), `ref` the CPU
// backend's tensor (its dtype: F32 for activations). Both start as NaN, rows padded by `pad` NaNs.
struct Twin {
  Gpu* gpu;
  Matrix host, ref;
  void* device;
  Twin(Gpu& g, DType gpu_dtype, DType cpu_dtype, int64_t rows, int64_t cols, int64_t pad = 0)
      : gpu(&g), host(gpu_dtype, rows, cols, pad), ref(cpu_dtype, rows, cols, pad) {
    device = g.memory.take(host.bytes.size());
    upload();
  }
  // An activation: the GPU's activation dtype, F32 on the CPU.
  static Twin activation(Gpu& g, int64_t rows, int64_t cols, int64_t pad = 0) {
    return Twin(g, g.activation, DType::F32, rows, cols, pad);
  }
  // Values exactly representable on both sides (rounded to the narrower dtype), then uploaded.
  void randomize(Random& rng, float scale = 1.0f) {
    for (int64_t r = 0; r < host.rows; r++)
      for (int64_t c = 0; c < host.cols; c++) set(r, c, rng.value(scale));
    upload();
  }
  void set(int64_t r, int64_t c, float v) {
    const float both = round_to(host.dtype, round_to(ref.dtype, v));
    host.set(r, c, both);
    ref.set(r, c, both);
  }
  Tensor whole() const { return Tensor::matrix(device, host.dtype, 1, host.elements()); }
  void upload() { REQUIRE_OK(gpu->cuda->copy_from_host(host.bytes.data(), whole())); }
  void download() { REQUIRE_OK(gpu->cuda->copy_to_host(whole(), host.bytes.data())); }
  Tensor on_gpu() const { return Tensor{device, host.dtype, host.rows, host.cols, host.stride}; }
  Tensor on_cpu() { return Tensor{ref.bytes.data(), ref.dtype, ref.rows, ref.cols, ref.stride}; }
  // The GPU's values (exact in the CPU's F32) on both sides: the next op then starts from the same input.
  void adopt_gpu_values() {
    download();
    for (int64_t r = 0; r < host.rows; r++)
      for (int64_t c = 0; c < host.cols; c++) ref.set(r, c, host.get(r, c));
  }
  // Downloads the GPU's result and compares it with the CPU's; the padding must still be NaN.
  void check(double abs_tol, double rel_tol) {
    download();
    Compare cmp{abs_tol, rel_tol};
    for (int64_t r = 0; r < host.rows; r++)
      for (int64_t c = 0; c < host.cols; c++) cmp(host.get(r, c), ref.get(r, c), r, c);
    CHECK_COMPARE(cmp);
    CHECK(host.padding_untouched());
  }
};

// An I32 vector on both backends.
struct IntTwin {
  Gpu* gpu;
  std::vector<int32_t> values;
  void* device;
  IntTwin(Gpu& g, std::vector<int32_t> v) : gpu(&g), values(std::move(v)) {
    device = g.memory.take(std::max<size_t>(values.size(), 1) * 4);
    upload();
  }
  void upload() {
    if (!values.empty()) REQUIRE_OK(gpu->cuda->copy_from_host(values.data(), on_gpu()));
  }
  Tensor on_gpu() const { return Tensor::matrix(device, DType::I32, 1, int64_t(values.size())); }
  Tensor on_cpu() { return Tensor::matrix(values.data(), DType::I32, 1, int64_t(values.size())); }
};

// A Status that must fail with `code` and say `words`.
void check_fails(const Status& status, ErrorCode code, const std::string& words) {
  REQUIRE_FALSE(status.ok());
  INFO(status.error().message);
  CHECK(status.error().code == code);
  CHECK(status.error().message.find(words) != std::string::npos);
}

// cos / sin tables [tokens, half] of random angles (up to 100 radians), on both backends.
void random_angles(Twin& cos, Twin& sin, Random& rng) {
  for (int64_t t = 0; t < cos.host.rows; t++)
    for (int64_t i = 0; i < cos.host.cols; i++) {
      const float angle = rng.value(100.0f);
      cos.set(t, i, std::cos(angle));
      sin.set(t, i, std::sin(angle));
    }
  cos.upload();
  sin.upload();
}

}  // namespace

// ---- gather_rows ----------------------------------------------------------------------------------------------

TEST_CASE("gather_rows matches the CPU for BF16/F16/F32 tables") {
  GPU_OR_SKIP();
  Random rng(101);
  struct Shape { int64_t vocab, hidden, tokens; };
  const Shape shapes[] = {{50, 64, 7}, {1000, 129, 33}, {3, 1, 5}, {17, 300, 1}, {4099, 2048, 3}};
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType table_dtype : kFloatTypes)
      for (const Shape& s : shapes) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(table_dtype))); CAPTURE(s.vocab); CAPTURE(s.hidden);
        Twin table(g, table_dtype, table_dtype, s.vocab, s.hidden, 3);
        table.randomize(rng);
        std::vector<int32_t> ids(size_t(s.tokens));
        for (auto& id : ids) id = int32_t(rng.below(s.vocab));
        IntTwin id_twin(g, ids);
        Twin out = Twin::activation(g, s.tokens, s.hidden, 2);
        REQUIRE_OK(g.cpu->gather_rows(table.on_cpu(), id_twin.on_cpu(), out.on_cpu()));
        REQUIRE_OK(g.cuda->gather_rows(table.on_gpu(), id_twin.on_gpu(), out.on_gpu()));
        out.check(0, table_dtype == activation ? 0 : ulp(activation));  // same dtype: a copy
      }
  }
}

TEST_CASE("gather_rows reports an id outside the table at the next synchronize, then runs clean") {
  GPU_OR_SKIP();
  Random rng(102);
  Gpu g(DType::BF16);
  Twin table(g, DType::BF16, DType::BF16, 5, 8);
  table.randomize(rng);
  IntTwin ids(g, {2, 5, 1});
  Twin out = Twin::activation(g, 3, 8);
  REQUIRE_OK(g.cuda->gather_rows(table.on_gpu(), ids.on_gpu(), out.on_gpu()));  // queued; checked on the device
  check_fails(g.cuda->synchronize(), ErrorCode::invalid_argument, "ids[1] = 5 is outside the table's 5 rows");
  out.download();
  CHECK(std::isnan(out.host.get(1, 0)));
  CHECK(out.host.get(0, 0) == table.host.get(2, 0));
  ids.values = {-1, 0, 4};
  ids.upload();
  REQUIRE_OK(g.cuda->gather_rows(table.on_gpu(), ids.on_gpu(), out.on_gpu()));
  check_fails(g.cuda->synchronize(), ErrorCode::invalid_argument, "ids[0] = -1");
  ids.values = {4, 0, 3};
  ids.upload();
  REQUIRE_OK(g.cuda->gather_rows(table.on_gpu(), ids.on_gpu(), out.on_gpu()));
  REQUIRE_OK(g.cuda->synchronize());  // the record was cleared
}

// ---- rms_norm, add_rms_norm ---------------------------------------------------------------------------------

TEST_CASE("rms_norm matches the CPU: whole rows (warp and block teams) and per-head groups, in place too") {
  GPU_OR_SKIP();
  Random rng(103);
  struct Shape { int64_t cols, group; };
  const Shape shapes[] = {{64, 64},   {129, 129},  {300, 300},     {4096, 4096}, {4 * 16, 16},
                          {32 * 128, 128}, {6 * 80, 80}, {3 * 257, 257}, {7, 7},
                          {4097, 4097}, {2 * 5000, 5000}};  // past what a block keeps in registers: the loop
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType weight_dtype : kFloatTypes)
      for (const Shape& s : shapes)
        for (int64_t tokens : {1, 5, 33}) {
          CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(weight_dtype))); CAPTURE(s.cols); CAPTURE(s.group);
          CAPTURE(tokens);
          Twin x = Twin::activation(g, tokens, s.cols, 3);
          x.randomize(rng, 3.0f);
          Twin weight(g, weight_dtype, weight_dtype, 1, s.group);
          weight.randomize(rng);
          Twin out = Twin::activation(g, tokens, s.cols, 1);
          REQUIRE_OK(g.cpu->rms_norm(x.on_cpu(), weight.on_cpu(), 1e-6f, out.on_cpu()));
          REQUIRE_OK(g.cuda->rms_norm(x.on_gpu(), weight.on_gpu(), 1e-6f, out.on_gpu()));
          out.check(1e-6, ulp(activation) + 1e-5);
          // in place: out is x
          REQUIRE_OK(g.cpu->rms_norm(x.on_cpu(), weight.on_cpu(), 1e-5f, x.on_cpu()));
          REQUIRE_OK(g.cuda->rms_norm(x.on_gpu(), weight.on_gpu(), 1e-5f, x.on_gpu()));
          x.check(1e-6, ulp(activation) + 1e-5);
        }
  }
}

TEST_CASE("add_rms_norm matches the CPU: the residual updated, then normalised, out in place too") {
  GPU_OR_SKIP();
  Random rng(104);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType weight_dtype : kFloatTypes)
      for (int64_t hidden : {64, 129, 256, 257, 2048, 4096, 4097, 5120})  // 4096: a block's registers; past: the loop
        for (int64_t tokens : {1, 4, 19})
          for (bool in_place : {false, true}) {
            CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(weight_dtype))); CAPTURE(hidden); CAPTURE(tokens);
            CAPTURE(in_place);
            Twin x = Twin::activation(g, tokens, hidden, 2);
            x.randomize(rng, 2.0f);
            Twin residual = Twin::activation(g, tokens, hidden, 5);
            residual.randomize(rng, 4.0f);
            Twin weight(g, weight_dtype, weight_dtype, 1, hidden);
            weight.randomize(rng);
            Twin out = Twin::activation(g, tokens, hidden, 1);
            Twin& target = in_place ? x : out;
            REQUIRE_OK(g.cpu->add_rms_norm(x.on_cpu(), residual.on_cpu(), weight.on_cpu(), 1e-6f, target.on_cpu()));
            REQUIRE_OK(g.cuda->add_rms_norm(x.on_gpu(), residual.on_gpu(), weight.on_gpu(), 1e-6f, target.on_gpu()));
            // the GPU stores the residual in the activation dtype and normalises what it stored
            residual.check(1e-6, ulp(activation));
            target.check(1e-6, 2 * ulp(activation) + 1e-5);
          }
  }
}

// ---- rope ---------------------------------------------------------------------------------------------------

TEST_CASE("rope matches the CPU: full and partial rotary, odd head counts, strided rows") {
  GPU_OR_SKIP();
  Random rng(105);
  struct Shape { int64_t heads, head_dim, half; };
  const Shape shapes[] = {{1, 16, 8}, {3, 64, 32}, {4, 128, 64}, {2, 64, 16}, {5, 80, 40}, {2, 10, 3}, {32, 128, 64}};
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (const Shape& s : shapes)
      for (int64_t tokens : {1, 6, 41}) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(s.heads); CAPTURE(s.head_dim); CAPTURE(s.half); CAPTURE(tokens);
        Twin x = Twin::activation(g, tokens, s.heads * s.head_dim, 7);  // q inside a fused qkv row
        x.randomize(rng);
        Twin cos(g, DType::F32, DType::F32, tokens, s.half, 1), sin(g, DType::F32, DType::F32, tokens, s.half, 2);
        random_angles(cos, sin, rng);
        REQUIRE_OK(g.cpu->rope(x.on_cpu(), cos.on_cpu(), sin.on_cpu(), s.head_dim));
        REQUIRE_OK(g.cuda->rope(x.on_gpu(), cos.on_gpu(), sin.on_gpu(), s.head_dim));
        x.check(1.0 / (1 << 20), ulp(activation));  // abs: a*c - b*s may cancel; fused or not, 2^-20 covers it
      }
  }
}

// ---- linear -------------------------------------------------------------------------------------------------

TEST_CASE("linear (cuBLAS) matches the CPU, with and without bias, on strided views and odd sizes") {
  GPU_OR_SKIP();
  Random rng(106);
  struct Shape { int64_t tokens, out_features, in_features; };
  const Shape shapes[] = {{1, 1, 1},     {1, 64, 64},    {3, 7, 5},      {17, 255, 129}, {64, 1000, 256},
                          {130, 33, 1024}, {1, 4096, 4096}, {5, 4, 0},    {2, 1, 3000},   {257, 129, 65}};
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (const Shape& s : shapes)
      for (bool with_bias : {false, true}) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(s.tokens); CAPTURE(s.out_features); CAPTURE(s.in_features);
        CAPTURE(with_bias);
        Twin x = Twin::activation(g, s.tokens, s.in_features, 3);
        x.randomize(rng);
        Twin weight(g, activation, activation, s.out_features, s.in_features, 1);  // weights in the activation dtype
        weight.randomize(rng);
        Twin bias(g, activation, activation, 1, s.out_features);
        bias.randomize(rng);
        Twin out = Twin::activation(g, s.tokens, s.out_features, 5);
        const Tensor no_bias{};
        REQUIRE_OK(g.cpu->linear(x.on_cpu(), weight.on_cpu(), with_bias ? bias.on_cpu() : no_bias, out.on_cpu()));
        REQUIRE_OK(g.cuda->linear(x.on_gpu(), weight.on_gpu(), with_bias ? bias.on_gpu() : no_bias, out.on_gpu()));
        out.download();
        // fp32 sums in another order: within K * 2^-23 of sum |x w|; then one rounding to the activation dtype
        Compare cmp{1e-6, ulp(activation)};
        for (int64_t t = 0; t < s.tokens; t++)
          for (int64_t n = 0; n < s.out_features; n++) {
            double magnitude = 0;
            for (int64_t k = 0; k < s.in_features; k++) magnitude += std::fabs(double(x.ref.get(t, k)) * weight.ref.get(n, k));
            cmp(out.host.get(t, n), out.ref.get(t, n), t, n, double(s.in_features) * magnitude / (1 << 23));
          }
        CHECK_COMPARE(cmp);
        CHECK(out.host.padding_untouched());
      }
  }
}

// ---- silu_mul, add, copy ------------------------------------------------------------------------------------

TEST_CASE("silu_mul matches the CPU on the halves of a fused gate_up buffer, out in place too") {
  GPU_OR_SKIP();
  Random rng(107);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (int64_t width : {1, 160, 1000, 4097})
      for (int64_t tokens : {1, 3, 17})
        for (bool in_place : {false, true}) {
          CAPTURE(std::string(dtype_name(activation))); CAPTURE(width); CAPTURE(tokens); CAPTURE(in_place);
          Twin gate_up = Twin::activation(g, tokens, 2 * width, 3);
          gate_up.randomize(rng, 6.0f);
          Twin out = Twin::activation(g, tokens, width, 1);
          const Tensor gate_gpu = gate_up.on_gpu().slice_cols(0, width), up_gpu = gate_up.on_gpu().slice_cols(width, width);
          const Tensor gate_cpu = gate_up.on_cpu().slice_cols(0, width), up_cpu = gate_up.on_cpu().slice_cols(width, width);
          REQUIRE_OK(g.cpu->silu_mul(gate_cpu, up_cpu, in_place ? gate_cpu : out.on_cpu()));
          REQUIRE_OK(g.cuda->silu_mul(gate_gpu, up_gpu, in_place ? gate_gpu : out.on_gpu()));
          if (in_place) gate_up.check(1e-6, ulp(activation) + 1e-6);
          else out.check(1e-6, ulp(activation) + 1e-6);
        }
  }
}

TEST_CASE("gelu_mul, scale and soft_cap match the CPU (Gemma's GeGLU, embedding normalizer, final soft-cap)") {
  GPU_OR_SKIP();
  Random rng(118);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (int64_t width : {1, 160, 4097}) {
      CAPTURE(std::string(dtype_name(activation))); CAPTURE(width);
      Twin gate_up = Twin::activation(g, 3, 2 * width, 3);
      gate_up.randomize(rng, 6.0f);
      Twin out = Twin::activation(g, 3, width, 1);
      for (GeluApprox approx : {GeluApprox::tanh, GeluApprox::none}) {
        REQUIRE_OK(g.cpu->gelu_mul(gate_up.on_cpu().slice_cols(0, width), gate_up.on_cpu().slice_cols(width, width),
                                   approx, out.on_cpu()));
        REQUIRE_OK(g.cuda->gelu_mul(gate_up.on_gpu().slice_cols(0, width), gate_up.on_gpu().slice_cols(width, width),
                                    approx, out.on_gpu()));
        out.check(1e-6, 2 * ulp(activation) + 1e-6);  // tanhf / erff within 2 ulps, then one product
      }
      REQUIRE_OK(g.cpu->scale(gate_up.on_cpu(), 48.0f, gate_up.on_cpu()));
      REQUIRE_OK(g.cuda->scale(gate_up.on_gpu(), 48.0f, gate_up.on_gpu()));
      // one product, which the GPU rounds once to the activation dtype and the CPU keeps in F32 (an H200, 2026-12-04:
      // 238.5 on the CPU, 238 in bf16, which a tolerance of 1e-6 had called wrong)
      gate_up.check(1e-6, ulp(activation) + 1e-6);
      // the GPU's rounded products are soft_cap's input on both sides, so that its check is of soft_cap alone (fed
      // the CPU's unrounded ones, its bf16 result once differed by 0.073 at -8.8: the two roundings compounded)
      gate_up.adopt_gpu_values();
      REQUIRE_OK(g.cpu->soft_cap(gate_up.on_cpu(), 30.0f, gate_up.on_cpu()));
      REQUIRE_OK(g.cuda->soft_cap(gate_up.on_gpu(), 30.0f, gate_up.on_gpu()));
      gate_up.check(1e-6, ulp(activation) + 1e-6);
    }
  }
}

TEST_CASE("add matches the CPU, out separate or the same view as a or b") {
  GPU_OR_SKIP();
  Random rng(108);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (int64_t width : {1, 64, 333, 4096})
      for (int64_t tokens : {1, 2, 31})
        for (int target : {0, 1, 2}) {  // out, a, b
          CAPTURE(std::string(dtype_name(activation))); CAPTURE(width); CAPTURE(tokens); CAPTURE(target);
          Twin a = Twin::activation(g, tokens, width, 2), b = Twin::activation(g, tokens, width, 0);
          a.randomize(rng, 10.0f);
          b.randomize(rng);
          Twin out = Twin::activation(g, tokens, width, 4);
          Twin& result = target == 0 ? out : (target == 1 ? a : b);
          REQUIRE_OK(g.cpu->add(a.on_cpu(), b.on_cpu(), result.on_cpu()));
          REQUIRE_OK(g.cuda->add(a.on_gpu(), b.on_gpu(), result.on_gpu()));
          result.check(0, ulp(activation));
        }
  }
}

TEST_CASE("copy converts between F32, BF16 and F16 with the CPU's bits, special values included") {
  GPU_OR_SKIP();
  Random rng(109);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, 65504.0f, 65519.99f, 65520.0f, -70000.0f, 1e-8f,
                            -3e-7f, 1.4e-45f, 1.1754942e-38f, 3.0e38f, 1.00390625f /* bf16 tie to even */,
                            1.01171875f /* bf16 tie, rounds up */, 1.00048828125f /* f16 tie */};
  Gpu g(DType::BF16);
  for (DType from : kFloatTypes)
    for (DType to : kFloatTypes)
      for (int64_t width : {1, 16, 300}) {
        CAPTURE(std::string(dtype_name(from))); CAPTURE(std::string(dtype_name(to))); CAPTURE(width);
        const int64_t rows = 5;
        Twin src(g, from, from, rows, width, 3);
        for (int64_t r = 0; r < rows; r++)
          for (int64_t c = 0; c < width; c++) {
            const int64_t i = r * width + c;
            // specials first, then magnitudes from 2^-30 to 2^20
            const float v = i < int64_t(std::size(specials))
                                ? specials[i]
                                : rng.value() * std::ldexp(1.0f, int(rng.below(51)) - 30);
            src.host.set(r, c, v);  // the source's own dtype on both sides: the same bits
            src.ref.set(r, c, v);
          }
        src.upload();
        Twin dst(g, to, to, rows, width, 2);
        REQUIRE_OK(g.cpu->copy(src.on_cpu(), dst.on_cpu()));
        REQUIRE_OK(g.cuda->copy(src.on_gpu(), dst.on_gpu()));
        dst.download();
        int64_t differing = 0;
        std::string first;
        for (int64_t r = 0; r < rows; r++)
          for (int64_t c = 0; c < width; c++)
            if (memcmp(&dst.host.bytes[size_t((r * dst.host.stride + c) * dst.host.element_bytes())],
                       &dst.ref.bytes[size_t((r * dst.ref.stride + c) * dst.ref.element_bytes())],
                       size_t(dst.host.element_bytes())) != 0 &&
                differing++ == 0)
              first = Compare::at(dst.host.get(r, c), dst.ref.get(r, c), r, c) + ", from " +
                      std::to_string(src.ref.get(r, c));
        INFO(first);
        CHECK(differing == 0);
        CHECK(dst.host.padding_untouched());
      }
}

// ---- kv_write -----------------------------------------------------------------------------------------------

namespace {
struct CacheShape {
  int64_t layers, page_tokens, kv_heads, head_dim, pages;
};
// A KV cache on both backends with the same random contents (elements of `dtype`, [1, pages x page]).
Twin make_cache(Gpu& g, DType dtype, const CacheShape& s, Random& rng, KVCacheView* gpu_view, KVCacheView* cpu_view) {
  const KVPageLayout layout{s.layers, s.page_tokens, s.kv_heads, s.head_dim};
  Twin cache(g, dtype, dtype, 1, s.pages * layout.page_elements());
  cache.randomize(rng);
  *gpu_view = KVCacheView{cache.device, dtype, layout, s.pages};
  *cpu_view = KVCacheView{cache.ref.bytes.data(), dtype, layout, s.pages};
  if (dtype == DType::F8_E4M3) {  // a different scale per layer and for K and V (host memory on both backends)
    static const float k_scales[] = {0.02f, 0.0125f, 0.03f}, v_scales[] = {0.005f, 0.011f, 0.0078125f};
    REQUIRE(s.layers <= 3);
    gpu_view->k_scales = cpu_view->k_scales = k_scales;
    gpu_view->v_scales = cpu_view->v_scales = v_scales;
  }
  return cache;
}
}  // namespace

TEST_CASE("kv_write stores what the CPU stores, skipping negative slots") {
  GPU_OR_SKIP();
  Random rng(110);
  const CacheShape shapes[] = {{3, 5, 2, 16, 7}, {2, 16, 4, 128, 9}, {1, 1, 1, 80, 40}, {2, 3, 3, 72, 11}};
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType kv_dtype : kKvTypes)
      for (const CacheShape& s : shapes) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(kv_dtype))); CAPTURE(s.page_tokens); CAPTURE(s.head_dim);
        KVCacheView gpu_cache, cpu_cache;
        Twin cache = make_cache(g, kv_dtype, s, rng, &gpu_cache, &cpu_cache);
        const int64_t slots_total = s.pages * s.page_tokens, width = s.kv_heads * s.head_dim;
        const int64_t tokens = std::min<int64_t>(slots_total, 13);
        std::vector<int32_t> all(static_cast<size_t>(slots_total));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng.engine);
        std::vector<int32_t> slots(all.begin(), all.begin() + tokens);
        slots[size_t(rng.below(tokens))] = -1;  // padding
        IntTwin slot_twin(g, slots);
        Twin kv = Twin::activation(g, tokens, 2 * width, 3);  // k and v: the halves of one fused row
        kv.randomize(rng);
        const int64_t layer = rng.below(s.layers);
        REQUIRE_OK(g.cpu->kv_write(cpu_cache, layer, kv.on_cpu().slice_cols(0, width), kv.on_cpu().slice_cols(width, width),
                                   slot_twin.on_cpu()));
        REQUIRE_OK(g.cuda->kv_write(gpu_cache, layer, kv.on_gpu().slice_cols(0, width),
                                    kv.on_gpu().slice_cols(width, width), slot_twin.on_gpu()));
        cache.download();
        CHECK(cache.host.bytes == cache.ref.bytes);  // same rounding (to nearest even), same places
      }
  }
}

TEST_CASE("kv_write and rope_kv_write report a slot past the cache's pages at the next synchronize, and "
          "rope_kv_write refuses a k outside qk") {
  GPU_OR_SKIP();
  Random rng(111);
  Gpu g(DType::BF16);
  KVCacheView gpu_cache, cpu_cache;
  Twin cache = make_cache(g, DType::BF16, {2, 4, 2, 16, 3}, rng, &gpu_cache, &cpu_cache);
  IntTwin slots(g, {0, 12, 5});
  Twin kv = Twin::activation(g, 3, 32);
  kv.randomize(rng);
  REQUIRE_OK(g.cuda->kv_write(gpu_cache, 1, kv.on_gpu(), kv.on_gpu(), slots.on_gpu()));
  check_fails(g.cuda->synchronize(), ErrorCode::invalid_argument, "slots[1] = 12 is page 3, past the cache's 3 pages");
  // the fused op: q (2 heads of 16) | k (2 heads) | v (2 heads), 8 frequencies
  Twin qkv = Twin::activation(g, 3, 96);
  qkv.randomize(rng);
  Twin cos(g, DType::F32, DType::F32, 3, 8), sin(g, DType::F32, DType::F32, 3, 8);
  random_angles(cos, sin, rng);
  const Tensor t = qkv.on_gpu();
  REQUIRE_OK(g.cuda->rope_kv_write(t.slice_cols(0, 64), cos.on_gpu(), sin.on_gpu(), 16, gpu_cache, 1,
                                   t.slice_cols(32, 32), t.slice_cols(64, 32), slots.on_gpu()));
  check_fails(g.cuda->synchronize(), ErrorCode::invalid_argument, "slots[1] = 12 is page 3, past the cache's 3 pages");
  // k must be qk's last columns: the keys the rope rotates are the ones stored
  check_fails(g.cuda->rope_kv_write(t.slice_cols(0, 64), cos.on_gpu(), sin.on_gpu(), 16, gpu_cache, 1,
                                    t.slice_cols(0, 32), t.slice_cols(64, 32), slots.on_gpu()),
              ErrorCode::invalid_argument, "must be the last 32 columns of qk");
}

// ---- rope_kv_write ------------------------------------------------------------------------------------------

TEST_CASE("rope_kv_write (one kernel) stores the bits rope then kv_write store: partial rotary, GQA, padding, every KV "
          "type") {
  GPU_OR_SKIP();
  Random rng(112);
  struct Shape { int64_t q_heads, kv_heads, head_dim, half, page_tokens, pages; };
  // Llama's GQA with a full rotary; 1 KV head with 16 of 40 frequencies (partial); MHA with one-token pages; odd
  // sizes (head_dim 10, 3 frequencies)
  const Shape shapes[] = {{4, 2, 64, 32, 16, 6}, {3, 1, 80, 16, 5, 7}, {8, 8, 128, 64, 1, 40}, {2, 2, 10, 3, 3, 11}};
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType kv_dtype : kKvTypes)
      for (const Shape& s : shapes) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(kv_dtype))); CAPTURE(s.head_dim); CAPTURE(s.half);
        const CacheShape cs{2, s.page_tokens, s.kv_heads, s.head_dim, s.pages};
        KVCacheView fused_view, split_view, unused_a, unused_b;
        Twin fused = make_cache(g, kv_dtype, cs, rng, &fused_view, &unused_a);
        Twin split = make_cache(g, kv_dtype, cs, rng, &split_view, &unused_b);
        split.host.bytes = fused.host.bytes;  // the same cache contents before
        split.upload();
        const int64_t slots_total = s.pages * s.page_tokens, width = s.kv_heads * s.head_dim;
        const int64_t qk_cols = (s.q_heads + s.kv_heads) * s.head_dim, tokens = std::min<int64_t>(slots_total, 13);
        std::vector<int32_t> all(static_cast<size_t>(slots_total));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng.engine);
        std::vector<int32_t> slots(all.begin(), all.begin() + tokens);
        slots[size_t(rng.below(tokens))] = -1;  // padding: rotated, not stored
        IntTwin slot_twin(g, slots);
        Twin x = Twin::activation(g, tokens, qk_cols + width, 5);  // q | k | v of one fused row
        x.randomize(rng);
        Twin y = Twin::activation(g, tokens, qk_cols + width, 5);
        y.host.bytes = x.host.bytes;
        y.upload();
        Twin cos(g, DType::F32, DType::F32, tokens, s.half), sin(g, DType::F32, DType::F32, tokens, s.half);
        random_angles(cos, sin, rng);
        const int64_t layer = rng.below(2), k_first = s.q_heads * s.head_dim;
        const Tensor xs = x.on_gpu(), ys = y.on_gpu();
        REQUIRE_OK(g.cuda->rope_kv_write(xs.slice_cols(0, qk_cols), cos.on_gpu(), sin.on_gpu(), s.head_dim, fused_view,
                                         layer, xs.slice_cols(k_first, width), xs.slice_cols(qk_cols, width),
                                         slot_twin.on_gpu()));
        REQUIRE_OK(g.cuda->rope(ys.slice_cols(0, qk_cols), cos.on_gpu(), sin.on_gpu(), s.head_dim));
        REQUIRE_OK(g.cuda->kv_write(split_view, layer, ys.slice_cols(k_first, width), ys.slice_cols(qk_cols, width),
                                    slot_twin.on_gpu()));
        fused.download();
        split.download();
        CHECK(fused.host.bytes == split.host.bytes);
        x.download();
        y.download();
        CHECK(x.host.bytes == y.host.bytes);  // q and k rotated alike, v untouched, the padding still NaN
        CHECK(x.host.padding_untouched());
      }
  }
}

// ---- attention ----------------------------------------------------------------------------------------------

namespace {
struct AttentionCase {
  int64_t heads, kv_heads, head_dim, page_tokens;
  std::vector<std::pair<int64_t, int64_t>> seqs;  // (context, queries)
};
// Sequences with pages dealt from a shuffled pool, K/V random everywhere, q random; runs both backends.
struct AttentionRun {
  CacheShape shape;
  std::vector<int32_t> starts, context, tables;
  int64_t rows = 0, table_cols = 0, max_context = 0;
  AttentionRun(const AttentionCase& c, Random& rng) {
    int64_t pages = 0;
    for (const auto& seq : c.seqs) {
      const int64_t seq_pages = (seq.first + c.page_tokens - 1) / c.page_tokens;
      table_cols = std::max(table_cols, seq_pages + 1);  // one column more than needed: -1
      pages += seq_pages;
      max_context = std::max(max_context, seq.first);
    }
    shape = {2, c.page_tokens, c.kv_heads, c.head_dim, pages + 3};
    std::vector<int32_t> pool(size_t(shape.pages));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng.engine);
    tables.assign(size_t(int64_t(c.seqs.size()) * table_cols), -1);
    starts.push_back(0);
    size_t next = 0;
    for (size_t s = 0; s < c.seqs.size(); s++) {
      const auto [context_len, queries] = c.seqs[s];
      for (int64_t p = 0; p < (context_len + c.page_tokens - 1) / c.page_tokens; p++)
        tables[s * size_t(table_cols) + size_t(p)] = pool[next++];
      context.push_back(int32_t(context_len));
      starts.push_back(starts.back() + int32_t(queries));
    }
    rows = starts.back();
  }
};
}  // namespace

TEST_CASE("attention matches the CPU: decode, chunked prefill, GQA groups, paged, long split contexts") {
  GPU_OR_SKIP();
  Random rng(112);
  const AttentionCase cases[] = {
      {4, 2, 16, 5, {{7, 7}, {12, 3}, {1, 1}, {20, 1}}},  // prefill, a chunk, a first token, decode
      {8, 8, 64, 16, {{33, 33}}},                          // MHA prefill
      {12, 2, 80, 16, {{50, 1}, {70, 20}}},                // group 6
      {16, 1, 128, 16, {{3000, 1}, {1500, 1}}},            // long decode: split; group 16: two head passes
      {28, 4, 128, 16, {{200, 17}}},                       // group 7 (Qwen2.5-VL-7B)
      {8, 2, 256, 8, {{600, 1}, {9, 4}}},                  // head_dim 256: 8 dims per lane
      {32, 8, 128, 16, {{2500, 1}, {7, 1}, {300, 1}}},     // Llama/Qwen3 decode batch
      {6, 3, 72, 3, {{40, 40}}},                           // 3 dims per lane
      {2, 1, 160, 7, {{300, 2}}},                          // 5 dims rounded to 8
  };
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType kv_dtype : kKvTypes)
      for (const AttentionCase& c : cases) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(kv_dtype))); CAPTURE(c.heads); CAPTURE(c.kv_heads);
        CAPTURE(c.head_dim); CAPTURE(c.page_tokens);
        AttentionRun run(c, rng);
        KVCacheView gpu_cache, cpu_cache;
        Twin cache = make_cache(g, kv_dtype, run.shape, rng, &gpu_cache, &cpu_cache);
        IntTwin starts(g, run.starts), context(g, run.context), tables(g, run.tables);
        const int64_t seqs = int64_t(c.seqs.size());
        const AttentionBatch gpu_batch{starts.on_gpu(), context.on_gpu(),
                                       Tensor::matrix(tables.device, DType::I32, seqs, run.table_cols), run.max_context};
        const AttentionBatch cpu_batch{starts.on_cpu(), context.on_cpu(),
                                       Tensor::matrix(tables.values.data(), DType::I32, seqs, run.table_cols),
                                       run.max_context};
        Twin q = Twin::activation(g, run.rows, c.heads * c.head_dim, 5);
        q.randomize(rng, 3.0f);  // peaked softmax
        Twin out = Twin::activation(g, run.rows, c.heads * c.head_dim, 2);
        const float scale = 1.0f / std::sqrt(float(c.head_dim));
        REQUIRE_OK(g.cpu->attention(q.on_cpu(), cpu_cache, 1, cpu_batch, scale, out.on_cpu()));
        REQUIRE_OK(g.cuda->attention(q.on_gpu(), gpu_cache, 1, gpu_batch, scale, out.on_gpu()));
        out.check(1e-4, ulp(activation));  // V in [-1, 1]; fp32 sums in another order
      }
  }
}

TEST_CASE("attention with a sliding window and a score soft-cap matches the CPU: inside, at and past the window") {
  GPU_OR_SKIP();
  Random rng(117);
  const AttentionCase cases[] = {
      {4, 2, 16, 5, {{7, 7}, {12, 3}, {1, 1}, {20, 1}}},  // prefill, a chunk, a first token, decode
      {16, 1, 128, 16, {{3000, 1}, {1500, 1}}},            // long decode: split over the window only
      {8, 4, 256, 16, {{600, 40}, {9, 4}}},                // Gemma-2's head_dim, a chunk across the window edge
  };
  struct Options { int64_t window; float softcap; };
  const Options options[] = {{1, 0.0f}, {8, 0.0f}, {8, 2.0f}, {100, 50.0f}, {4096, 0.0f}, {0, 50.0f}};
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (const AttentionCase& c : cases)
      for (const Options& o : options) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(c.heads); CAPTURE(c.head_dim); CAPTURE(o.window);
        CAPTURE(o.softcap);
        AttentionRun run(c, rng);
        KVCacheView gpu_cache, cpu_cache;
        Twin cache = make_cache(g, activation, run.shape, rng, &gpu_cache, &cpu_cache);
        IntTwin starts(g, run.starts), context(g, run.context), tables(g, run.tables);
        const int64_t seqs = int64_t(c.seqs.size());
        const AttentionBatch gpu_batch{starts.on_gpu(), context.on_gpu(),
                                       Tensor::matrix(tables.device, DType::I32, seqs, run.table_cols), run.max_context};
        const AttentionBatch cpu_batch{starts.on_cpu(), context.on_cpu(),
                                       Tensor::matrix(tables.values.data(), DType::I32, seqs, run.table_cols),
                                       run.max_context};
        Twin q = Twin::activation(g, run.rows, c.heads * c.head_dim, 5);
        q.randomize(rng, 3.0f);
        Twin out = Twin::activation(g, run.rows, c.heads * c.head_dim, 2);
        AttentionOptions attention_options;
        attention_options.window = o.window;
        attention_options.logit_softcap = o.softcap;
        const float scale = 1.0f / std::sqrt(float(c.head_dim));
        REQUIRE_OK(g.cpu->attention(q.on_cpu(), cpu_cache, 1, cpu_batch, scale, out.on_cpu(), attention_options));
        REQUIRE_OK(g.cuda->attention(q.on_gpu(), gpu_cache, 1, gpu_batch, scale, out.on_gpu(), attention_options));
        out.check(1e-4, ulp(activation));
      }
  }
}

TEST_CASE("attention with little scratch splits less and still matches the CPU") {
  GPU_OR_SKIP();
  Random rng(113);
  // cuBLAS 512 KiB, scratch just over the minimum: at most a few splits fit
  Gpu g(DType::BF16, 512 * KiB + 256 + kCudaMinScratchBytes, 512 * KiB);
  const AttentionCase c{16, 2, 128, 16, {{4000, 1}, {2100, 1}, {129, 1}}};
  AttentionRun run(c, rng);
  KVCacheView gpu_cache, cpu_cache;
  Twin cache = make_cache(g, DType::BF16, run.shape, rng, &gpu_cache, &cpu_cache);
  IntTwin starts(g, run.starts), context(g, run.context), tables(g, run.tables);
  const int64_t seqs = int64_t(c.seqs.size());
  Twin q = Twin::activation(g, run.rows, c.heads * c.head_dim);
  q.randomize(rng, 3.0f);
  Twin out = Twin::activation(g, run.rows, c.heads * c.head_dim, 1);
  REQUIRE_OK(g.cpu->attention(q.on_cpu(), cpu_cache, 0,
                              {starts.on_cpu(), context.on_cpu(),
                               Tensor::matrix(tables.values.data(), DType::I32, seqs, run.table_cols), run.max_context},
                              0.125f, out.on_cpu()));
  REQUIRE_OK(g.cuda->attention(q.on_gpu(), gpu_cache, 0,
                               {starts.on_gpu(), context.on_gpu(),
                                Tensor::matrix(tables.device, DType::I32, seqs, run.table_cols), run.max_context},
                               0.125f, out.on_gpu()));
  out.check(1e-4, ulp(DType::BF16));
}

TEST_CASE("attention reports malformed batches found on the device at the next synchronize") {
  GPU_OR_SKIP();
  Random rng(114);
  Gpu g(DType::BF16);
  const AttentionCase c{4, 2, 16, 4, {{10, 3}, {6, 1}}};
  AttentionRun run(c, rng);
  KVCacheView gpu_cache, cpu_cache;
  Twin cache = make_cache(g, DType::BF16, run.shape, rng, &gpu_cache, &cpu_cache);
  Twin q = Twin::activation(g, run.rows, c.heads * c.head_dim);
  q.randomize(rng);
  Twin out = Twin::activation(g, run.rows, c.heads * c.head_dim);
  auto attempt = [&](std::vector<int32_t> starts, std::vector<int32_t> context, std::vector<int32_t> tables) {
    IntTwin s(g, std::move(starts)), ctx(g, std::move(context)), t(g, std::move(tables));
    REQUIRE_OK(g.cuda->attention(q.on_gpu(), gpu_cache, 0,
                                 {s.on_gpu(), ctx.on_gpu(), Tensor::matrix(t.device, DType::I32, 2, run.table_cols),
                                  run.max_context},
                                 0.25f, out.on_gpu()));
    return g.cuda->synchronize();
  };
  // rows 0..2 are sequence 0's queries, row 3 sequence 1's
  SUBCASE("fewer cached tokens than queries") {
    check_fails(attempt(run.starts, {2, 6}, run.tables), ErrorCode::invalid_argument,
                "sequence 0 has context_lens 2; it must be at least its 3 queries");
    out.download();
    CHECK(std::isnan(out.host.get(0, 0)));
    CHECK(std::isnan(out.host.get(2, 17)));
    CHECK_FALSE(std::isnan(out.host.get(3, 0)));
  }
  SUBCASE("a page id outside the cache") {
    std::vector<int32_t> tables = run.tables;
    tables[size_t(run.table_cols)] = int32_t(run.shape.pages);  // sequence 1's first page
    check_fails(attempt(run.starts, run.context, tables), ErrorCode::invalid_argument,
                "block_tables[1][0] = " + std::to_string(run.shape.pages) + " is not a page of the cache");
    out.download();
    CHECK(std::isnan(out.host.get(3, 0)));
    CHECK_FALSE(std::isnan(out.host.get(0, 0)));
  }
  SUBCASE("query_starts not starting at 0") {
    check_fails(attempt({1, 3, 4}, run.context, run.tables), ErrorCode::invalid_argument,
                "query row 0 belongs to no sequence");
    out.download();
    CHECK(std::isnan(out.host.get(0, 5)));
  }
  REQUIRE_OK(attempt(run.starts, run.context, run.tables));  // a good batch runs clean afterwards
  out.download();
  CHECK_FALSE(std::isnan(out.host.get(0, 0)));
}

// ---- argmax -------------------------------------------------------------------------------------------------

TEST_CASE("cuda::argmax gives the sampler's greedy token: ties to the lowest id, NaN never wins") {
  GPU_OR_SKIP();
  Random rng(115);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (int64_t vocab : {1, 7, 1000, 151936})
      for (int64_t tokens : {1, 3, 8}) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(vocab); CAPTURE(tokens);
        Twin logits = Twin::activation(g, tokens, vocab, 3);
        logits.randomize(rng, 20.0f);
        for (int64_t t = 0; t < tokens && vocab > 2; t++) {
          const int64_t winner = 1 + rng.below(vocab - 1);
          logits.set(t, winner, 30.0f);
          if (t % 2 == 0) logits.set(t, 1 + rng.below(vocab - 1), 30.0f);  // a tie: the lower id wins
          logits.set(t, 1 + rng.below(vocab - 1), NAN);                     // never wins
          if (t == 2) logits.set(t, 0, -INFINITY);
        }
        logits.upload();
        IntTwin ids(g, std::vector<int32_t>(size_t(tokens), -5));
        REQUIRE_OK(cuda::argmax(*g.cuda, logits.on_gpu(), ids.on_gpu()));
        std::vector<int32_t> got(size_t(tokens), -9);
        REQUIRE_OK(g.cuda->copy_to_host(ids.on_gpu(), got.data()));
        for (int64_t t = 0; t < tokens; t++) {
          std::vector<float> row(static_cast<size_t>(vocab));
          for (int64_t v = 0; v < vocab; v++) row[size_t(v)] = logits.ref.get(t, v);
          CHECK(got[size_t(t)] == kvlite::argmax(row.data(), vocab));
        }
      }
  }
}

// ---- memory -------------------------------------------------------------------------------------------------

TEST_CASE("a whole layer's ops, run three times, make no device allocation") {
  GPU_OR_SKIP();
  Random rng(116);
  Gpu g(DType::BF16);
  const int64_t tokens = 9, hidden = 512, heads = 8, kv_heads = 2, head_dim = 64, vocab = 3000;
  Twin table(g, DType::BF16, DType::BF16, vocab, hidden);
  table.randomize(rng);
  IntTwin ids(g, {1, 5, 9, 2999, 0, 7, 7, 100, 4});
  Twin x = Twin::activation(g, tokens, hidden), residual = Twin::activation(g, tokens, hidden);
  Twin norm_weight(g, DType::BF16, DType::BF16, 1, hidden);
  norm_weight.randomize(rng);
  Twin w_qkv(g, DType::BF16, DType::BF16, (heads + 2 * kv_heads) * head_dim, hidden);
  w_qkv.randomize(rng, 0.05f);
  Twin qkv = Twin::activation(g, tokens, (heads + 2 * kv_heads) * head_dim);
  Twin cos(g, DType::F32, DType::F32, tokens, head_dim / 2), sin(g, DType::F32, DType::F32, tokens, head_dim / 2);
  cos.randomize(rng);
  sin.randomize(rng);
  KVCacheView gpu_cache, cpu_cache;
  Twin cache = make_cache(g, DType::BF16, {1, 16, kv_heads, head_dim, 40}, rng, &gpu_cache, &cpu_cache);
  std::vector<int32_t> slot_values(static_cast<size_t>(tokens));
  std::iota(slot_values.begin(), slot_values.end(), 600);  // one sequence at tokens 600..608 (pages 37, 38)
  IntTwin slots(g, slot_values);
  std::vector<int32_t> table_row(40);
  std::iota(table_row.begin(), table_row.end(), 0);
  IntTwin starts(g, {0, int32_t(tokens)}), context(g, {609}), tables(g, table_row);
  Twin attn = Twin::activation(g, tokens, heads * head_dim);
  Twin logits = Twin::activation(g, tokens, vocab);
  IntTwin next(g, std::vector<int32_t>(size_t(tokens), -1));  // -1: not a token
  const Tensor no_bias{};
  auto pass = [&] {
    Backend& b = *g.cuda;
    REQUIRE_OK(b.gather_rows(table.on_gpu(), ids.on_gpu(), x.on_gpu()));
    REQUIRE_OK(b.copy(x.on_gpu(), residual.on_gpu()));
    REQUIRE_OK(b.add_rms_norm(x.on_gpu(), residual.on_gpu(), norm_weight.on_gpu(), 1e-6f, x.on_gpu()));
    REQUIRE_OK(b.linear(x.on_gpu(), w_qkv.on_gpu(), no_bias, qkv.on_gpu()));
    const Tensor q = qkv.on_gpu().slice_cols(0, heads * head_dim);
    const Tensor k = qkv.on_gpu().slice_cols(heads * head_dim, kv_heads * head_dim);
    const Tensor v = qkv.on_gpu().slice_cols((heads + kv_heads) * head_dim, kv_heads * head_dim);
    REQUIRE_OK(b.rms_norm(q, norm_weight.on_gpu().slice_cols(0, head_dim), 1e-6f, q));
    REQUIRE_OK(b.rope(q, cos.on_gpu(), sin.on_gpu(), head_dim));
    REQUIRE_OK(b.kv_write(gpu_cache, 0, k, v, slots.on_gpu()));
    REQUIRE_OK(b.attention(q, gpu_cache, 0, {starts.on_gpu(), context.on_gpu(),
                                             Tensor::matrix(tables.device, DType::I32, 1, 40), 640},
                           0.125f, attn.on_gpu()));
    REQUIRE_OK(b.silu_mul(attn.on_gpu().slice_cols(0, 256), attn.on_gpu().slice_cols(256, 256), x.on_gpu().slice_cols(0, 256)));
    REQUIRE_OK(b.add(x.on_gpu(), residual.on_gpu(), x.on_gpu()));
    REQUIRE_OK(b.linear(x.on_gpu(), table.on_gpu(), no_bias, logits.on_gpu()));  // tied lm_head
    REQUIRE_OK(cuda::argmax(b, logits.on_gpu(), next.on_gpu()));
    REQUIRE_OK(b.synchronize());
  };
  // Free device memory is not compared: ctest runs other GPU tests in parallel, so it moves on its own.
  const uint64_t allocations = cuda::device_allocations();
  for (int i = 0; i < 3; i++) pass();
  CHECK(cuda::device_allocations() == allocations);
  // the pass computed something: every greedy id is a row of the table
  std::vector<int32_t> got(static_cast<size_t>(tokens), -1);
  REQUIRE_OK(g.cuda->copy_to_host(next.on_gpu(), got.data()));
  for (int32_t id : got) CHECK((id >= 0 && id < vocab));
}

// ---- what the backend refuses -------------------------------------------------------------------------------

// ---- the vision encoder's ops --------------------------------------------------------------------------------

TEST_CASE("embedding_bag matches the CPU: 4-tap bilinear rows of a position table, BF16/F16/F32 tables") {
  GPU_OR_SKIP();
  Random rng(131);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType table_dtype : kFloatTypes)
      for (int64_t cols : {16, 72, 1024})
        for (int64_t rows : {1, 9, 130}) {
          CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(table_dtype))); CAPTURE(cols); CAPTURE(rows);
          const int64_t table_rows = 144, taps = 4;
          Twin table(g, table_dtype, table_dtype, table_rows, cols, 2);
          table.randomize(rng);
          std::vector<int32_t> index_values;
          Twin weights(g, DType::F32, DType::F32, rows, taps);
          for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < taps; j++) {
              index_values.push_back(int32_t(rng.below(table_rows)));
              weights.set(r, j, std::fabs(rng.value()));
            }
          weights.upload();
          IntTwin indices(g, index_values);
          const Tensor gpu_indices = Tensor::matrix(indices.device, DType::I32, rows, taps);
          const Tensor cpu_indices = Tensor::matrix(indices.values.data(), DType::I32, rows, taps);
          Twin out = Twin::activation(g, rows, cols, 3);
          REQUIRE_OK(g.cpu->embedding_bag(table.on_cpu(), cpu_indices, weights.on_cpu(), out.on_cpu()));
          REQUIRE_OK(g.cuda->embedding_bag(table.on_gpu(), gpu_indices, weights.on_gpu(), out.on_gpu()));
          out.check(1e-6, ulp(activation));  // the same products summed in the same order: one rounding apart
        }
  }
}

TEST_CASE("embedding_bag reports an index outside the table at the next synchronize") {
  GPU_OR_SKIP();
  Random rng(137);
  Gpu g(DType::F32);
  Twin table(g, DType::F32, DType::F32, 10, 8);
  table.randomize(rng);
  IntTwin indices(g, {1, 2, 3, 4, 5, 6, 10, 7});
  Twin weights(g, DType::F32, DType::F32, 2, 4);
  weights.randomize(rng);
  Twin out = Twin::activation(g, 2, 8);
  REQUIRE_OK(g.cuda->embedding_bag(table.on_gpu(), Tensor::matrix(indices.device, DType::I32, 2, 4), weights.on_gpu(),
                                   out.on_gpu()));
  check_fails(g.cuda->synchronize(), ErrorCode::invalid_argument, "indices[1][2] = 10");
  REQUIRE_OK(g.cuda->synchronize());  // the record was cleared
}

TEST_CASE("layer_norm matches the CPU: narrow and wide rows, BF16/F16/F32 weights, in place too") {
  GPU_OR_SKIP();
  Random rng(139);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (DType weight_dtype : kFloatTypes)
      for (int64_t cols : {7, 64, 257, 1152, 4096})
        for (int64_t rows : {1, 6, 41}) {
          CAPTURE(std::string(dtype_name(activation))); CAPTURE(std::string(dtype_name(weight_dtype))); CAPTURE(cols); CAPTURE(rows);
          Twin x = Twin::activation(g, rows, cols, 2);
          for (int64_t r = 0; r < rows; r++)  // an offset per row, so subtracting the mean matters
            for (int64_t c = 0; c < cols; c++) x.set(r, c, 2.0f + 0.5f * float(r % 3) + rng.value());
          x.upload();
          Twin weight(g, weight_dtype, weight_dtype, 1, cols), bias(g, weight_dtype, weight_dtype, 1, cols);
          weight.randomize(rng);
          bias.randomize(rng);
          Twin out = Twin::activation(g, rows, cols, 1);
          REQUIRE_OK(g.cpu->layer_norm(x.on_cpu(), weight.on_cpu(), bias.on_cpu(), 1e-6f, out.on_cpu()));
          REQUIRE_OK(g.cuda->layer_norm(x.on_gpu(), weight.on_gpu(), bias.on_gpu(), 1e-6f, out.on_gpu()));
          // fp32 moments on the GPU, double on the CPU: a few fp32 ulps of the normalised value
          out.check(2e-5, ulp(activation) + 1e-5);
          REQUIRE_OK(g.cpu->layer_norm(x.on_cpu(), weight.on_cpu(), bias.on_cpu(), 1e-5f, x.on_cpu()));
          REQUIRE_OK(g.cuda->layer_norm(x.on_gpu(), weight.on_gpu(), bias.on_gpu(), 1e-5f, x.on_gpu()));
          x.check(2e-5, ulp(activation) + 1e-5);
        }
  }
}

TEST_CASE("gelu matches the CPU, exact (erf) and tanh, strided and in place") {
  GPU_OR_SKIP();
  Random rng(149);
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (GeluApprox approx : {GeluApprox::none, GeluApprox::tanh})
      for (int64_t cols : {1, 33, 4304}) {
        CAPTURE(std::string(dtype_name(activation))); CAPTURE(int(approx)); CAPTURE(cols);
        Twin x = Twin::activation(g, 5, cols, 3);
        x.randomize(rng, 6.0f);
        Twin out = Twin::activation(g, 5, cols, 1);
        REQUIRE_OK(g.cpu->gelu(x.on_cpu(), approx, out.on_cpu()));
        REQUIRE_OK(g.cuda->gelu(x.on_gpu(), approx, out.on_gpu()));
        out.check(1e-6, ulp(activation) + 1e-6);  // CUDA's erff / tanhf are within 2 ulps of the libm ones
        REQUIRE_OK(g.cpu->gelu(x.on_cpu(), approx, x.on_cpu()));
        REQUIRE_OK(g.cuda->gelu(x.on_gpu(), approx, x.on_gpu()));
        x.check(1e-6, ulp(activation) + 1e-6);
      }
  }
}

TEST_CASE("segment_attention matches the CPU: images of different sizes, q/k/v slices of one qkv, GQA") {
  GPU_OR_SKIP();
  Random rng(151);
  struct Shape { int64_t heads, kv_heads, head_dim; std::vector<int32_t> starts; };
  const Shape shapes[] = {
      {2, 2, 16, {0, 16, 36}},            // the tiny test model: two images
      {16, 16, 64, {0, 64, 64, 144}},     // Qwen3-VL-4B's vision heads; an empty segment in the middle
      {4, 2, 80, {0, 7}},                 // GQA, head_dim 80 (not a multiple of 32)
      {3, 1, 130, {0, 1, 40, 41}},        // head_dim over 128; one-row segments
      {1, 1, 256, {0, 300}},              // the widest head, a long segment
  };
  for (DType activation : kActivations) {
    Gpu g(activation);
    for (const Shape& s : shapes) {
      CAPTURE(std::string(dtype_name(activation))); CAPTURE(s.heads); CAPTURE(s.kv_heads); CAPTURE(s.head_dim);
      const int64_t rows = s.starts.back(), q_width = s.heads * s.head_dim, kv_width = s.kv_heads * s.head_dim;
      int64_t longest = 0;
      for (size_t i = 1; i < s.starts.size(); i++) longest = std::max<int64_t>(longest, s.starts[i] - s.starts[i - 1]);
      Twin qkv = Twin::activation(g, rows, q_width + 2 * kv_width, 2);
      qkv.randomize(rng, 2.0f);
      IntTwin starts(g, s.starts);
      Twin out = Twin::activation(g, rows, q_width, 3);
      auto run = [&](Backend& backend, Tensor fused, Tensor starts_tensor, Tensor result) {
        return backend.segment_attention(fused.slice_cols(0, q_width), fused.slice_cols(q_width, kv_width),
                                         fused.slice_cols(q_width + kv_width, kv_width), starts_tensor, longest,
                                         s.head_dim, 1.0f / std::sqrt(float(s.head_dim)), result);
      };
      REQUIRE_OK(run(*g.cpu, qkv.on_cpu(), starts.on_cpu(), out.on_cpu()));
      REQUIRE_OK(run(*g.cuda, qkv.on_gpu(), starts.on_gpu(), out.on_gpu()));
      out.check(1e-5, 2 * ulp(activation) + 1e-5);
    }
  }
}

TEST_CASE("segment_attention reports a segment longer than max_segment at the next synchronize") {
  GPU_OR_SKIP();
  Random rng(157);
  Gpu g(DType::F32);
  Twin qkv = Twin::activation(g, 10, 3 * 32);
  qkv.randomize(rng);
  IntTwin starts(g, {0, 3, 10});
  Twin out = Twin::activation(g, 10, 32);
  const Tensor fused = qkv.on_gpu();
  REQUIRE_OK(g.cuda->segment_attention(fused.slice_cols(0, 32), fused.slice_cols(32, 32), fused.slice_cols(64, 32),
                                       starts.on_gpu(), 5, 32, 0.2f, out.on_gpu()));
  check_fails(g.cuda->synchronize(), ErrorCode::invalid_argument, "segment 1 holds 7 rows, more than max_segment 5");
}

TEST_CASE("the CUDA backend says what it does not run: mixed linear dtypes, head_dim over 256") {
  GPU_OR_SKIP();
  Random rng(117);
  Gpu g(DType::BF16);
  CHECK(g.cuda->kind() == BackendKind::cuda);
  CHECK(g.cuda->supports(Op::linear, DType::BF16));
  CHECK_FALSE(g.cuda->supports(Op::linear, DType::F16));
  CHECK_FALSE(g.cuda->supports(Op::linear, DType::F32));
  CHECK(g.cuda->supports(Op::kv_write, DType::F16));
  CHECK(g.cuda->supports(Op::attention, DType::F8_E4M3));  // the fp8 KV cache
  CHECK_FALSE(g.cuda->supports(Op::rms_norm, DType::F8_E4M3));
  Twin x = Twin::activation(g, 2, 8);
  x.randomize(rng);
  Twin w(g, DType::F32, DType::F32, 3, 8), out = Twin::activation(g, 2, 3);
  check_fails(g.cuda->linear(x.on_gpu(), w.on_gpu(), Tensor{}, out.on_gpu()), ErrorCode::unsupported,
              "weight dtype F32");
  KVCacheView gpu_cache, cpu_cache;
  Twin cache = make_cache(g, DType::BF16, {1, 2, 1, 320, 2}, rng, &gpu_cache, &cpu_cache);
  IntTwin starts(g, {0, 1}), context(g, {1}), tables(g, {0, 1});
  Twin q = Twin::activation(g, 1, 320), attn = Twin::activation(g, 1, 320);
  check_fails(g.cuda->attention(q.on_gpu(), gpu_cache, 0,
                                {starts.on_gpu(), context.on_gpu(), Tensor::matrix(tables.device, DType::I32, 1, 2), 1},
                                0.1f, attn.on_gpu()),
              ErrorCode::unsupported, "head_dim 320");
}
