// cuda-quant: the CUDA backend's quantized GEMMs (kernels.cu section 3b) against the CPU backend's
// quant_linear, the bit-exact reference, on a real GPU. Every kernel is forced in turn (cuda::set_quant_kernel):
// W4A16 and W8A16 mma, W8A8 mma (sm_89+, against the CPU's fp8-activation reference), dequantize + cuBLAS, the
// W4A16 / W8A16 GEMV for decode rows, and
// the automatic choice; at M = 1 .. 64 and 100+, N odd multiples of 64 and ragged, K not a multiple of 128;
// fresh seeded random data (never zeros); outputs poisoned with NaN and padded with NaN between rows.
//
// Tolerances (per output element, from S = sum_k |x_k w_k| computed on the CPU): the output's own rounding to
// the activation dtype (one step), plus
//   exact weights (scale dtype = compute dtype, or F32 activations): the GPU's weights are the reference's
//     bits, so only fp32 summation order differs: 2 (K + 16) 2^-24 S, the classic gamma_K bound for both sides;
//   weights rounded once (other scale dtypes, CudaBackendOptions::fp32_scale_products, which these tests turn on
//     unless they say otherwise): the GPU's weights are the reference's rounded once to the compute dtype
//     (quant_gpu.hpp's ScaleProduct; unit-quant-gpu-host proves it per weight), so the reference is the CPU's
//     matmul over those rounded weights and the bound is exact_weights' again;
//   weights rounded twice (other scale dtypes, the default pair multiply): each weight within 2 steps of the
//     compute dtype plus one of the scale dtype of the reference's: 3 x 2^-7 S (bf16);
//   W8A8: the reference rounds each dequantized weight to the scale dtype (<= 2^-8 relative for bf16), the
//     GPU multiplies exact e4m3 products by the scales in fp32: 2^-8 S plus 2^-10 S of slack for the fp8 tensor
//     cores' accumulation inside one k32 step.
// A misplaced weight or group costs an error of order |x_k w_k| in every output it touches, far above the
// exact-weight bound, which most cases use.
//
// Without a CUDA GPU (or in a build without CUDA) every case says "no CUDA GPU: skipped" and passes, unless
// KVLITE_REQUIRE_GPU=1 (tools/gpu-check.sh sets it), when it fails.
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include "gpu_test_support.hpp"
#include "host_floats.hpp"
#include "quant_weights.hpp"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

using namespace kvlite;
using namespace gpu_test;
using namespace host_floats;
using namespace quant_test;
using json = nlohmann::json;

namespace {

int device_sm() { return cuda::query_device(0).value().sm; }

// One step of `dtype` at |value| (relative, at the bottom of a binade).
double step_of(DType dtype, double value) {
  const double relative = dtype == DType::BF16 ? 1.0 / 128 : dtype == DType::F16 ? 1.0 / 1024 : 1.0 / (1 << 23);
  return relative * std::fabs(value) + (dtype == DType::F16 ? 6e-8 : 1e-38);
}

// A CUDA backend of one activation dtype and the CPU references (plain and with fp8 activations).
struct Gpu {
  DType activation;
  DeviceMemory memory;
  std::unique_ptr<Backend> cuda, cpu, cpu_w8a8;
  // scratch_bytes: the workspace's scratch (the quantized GEMMs' staging, partials, weight chunks)
  explicit Gpu(DType activation_, uint64_t scratch_bytes = kCudaScratchBytes, bool fp32_scale_products = true)
      : activation(activation_), memory(1536 * MiB) {
    CudaBackendOptions options;
    options.activation_dtype = activation;
    options.fp32_scale_products = fp32_scale_products;
    options.workspace_bytes = kCudaCublasWorkspaceBytes + 256 + scratch_bytes;  // + the fault record
    options.workspace = memory.take(options.workspace_bytes);
    options.cublas_workspace_bytes = kCudaCublasWorkspaceBytes;
    auto made = make_cuda_backend(options);
    if (!made.ok()) FAIL(made.error().message);
    cuda = std::move(*made);
    cpu = make_cpu_backend().value();
    CpuBackendOptions w8a8;
    w8a8.fp8_activations = true;
    cpu_w8a8 = make_cpu_backend(w8a8).value();
  }
  QuantWeight upload(const QuantWeight& host) {
    const uint64_t bytes = cuda::quant_device_bytes(host);
    Result<QuantWeight> device = cuda::upload_quant_weight(*cuda, host, memory.take(bytes), bytes);
    if (!device.ok()) FAIL(device.error().message);
    CHECK(device->layout == QuantLayout::cuda_tiles);
    return *device;
  }
};

// How far the GPU may be from the CPU (see the top of the file).
enum class Bound { exact_weights, rounded_once, rounded_twice, w8a8 };
// For the A16 and dequantize paths: the GPU's weights are the reference's bits when the activations are F32
// (exact dequantization) or when the reference rounds each weight to the activation dtype itself (its scale's
// dtype, compressed-tensors' rounding); transformers' weight_scale_inv keeps the float32 product.
Bound a16_bound(const QuantWeight& w, DType activation) {
  const bool exact = activation == DType::F32 ||
                     (w.scale_dtype == activation && w.rounding == DequantRounding::scale_dtype);
  return exact ? Bound::exact_weights : Bound::rounded_once;
}

// x [M, K] random in [-1, 1] (never near 0), exactly representable in the activation dtype; the GPU copy in
// the activation dtype with `pad` extra elements per row (NaN) and `skew` bytes of misalignment.
struct Activations {
  int64_t rows, cols, stride;
  std::vector<float> values;  // [rows, cols], the CPU's
  std::vector<uint8_t> host;  // [rows, stride] in the activation dtype
  void* device = nullptr;
  Activations(Gpu& g, Random& rng, int64_t m, int64_t k, int64_t pad, uint64_t skew)
      : rows(m), cols(k), stride(k + pad), values(size_t(m * k)) {
    const size_t element = size_t(dtype_bytes(g.activation, 1));
    host.assign(size_t(m * stride) * element, 0);
    for (int64_t i = 0; i < m * stride; i++) encode(g.activation, NAN, &host[size_t(i) * element]);
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < k; c++) {
        float v = rng.uniform(0.05f, 1.0f) * (rng.below(2) ? 1.0f : -1.0f);
        encode(g.activation, v, &host[size_t(r * stride + c) * element]);
        values[size_t(r * k + c)] = decode(g.activation, &host[size_t(r * stride + c) * element]);
      }
    device = g.memory.take_unaligned(host.size(), skew);
    REQUIRE_OK(g.cuda->copy_from_host(host.data(), Tensor::matrix(device, DType::U8, 1, int64_t(host.size()))));
  }
  Tensor on_gpu(DType activation) const { return Tensor{device, activation, rows, cols, stride}; }
};

// Runs `device` (the upload of `host`) on x through the kernel `kernel`, and compares with the CPU.
// Output columns are padded by 3 NaN elements per row, which must stay NaN.
void check_quant_linear(Gpu& g, const QuantWeight& host, const QuantWeight& device, const Activations& x,
                        cuda::QuantKernel kernel, Bound bound) {
  const int64_t m = x.rows, n = host.out_features, k = host.in_features;
  CAPTURE(host.name);
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(std::string(cuda::quant_kernel_name(kernel)));
  CAPTURE(std::string(dtype_name(g.activation)));
  REQUIRE_OK(cuda::set_quant_kernel(*g.cuda, kernel));
  // the reference
  const bool w8a8 = bound == Bound::w8a8;
  std::vector<float> ref(size_t(m * n));
  if (bound == Bound::rounded_once) {  // the CPU's matmul over the reference's weights rounded once to T
    std::vector<float> scratch(size_t(detail::kQuantRowBlock * k));
    for (int64_t n0 = 0; n0 < n; n0 += detail::kQuantRowBlock)
      detail::quant_linear_block(x.values.data(), k, m, host, n0, std::min(detail::kQuantRowBlock, n - n0),
                                 scratch.data(), ref.data(), n, DType::F32, g.activation);
  } else {
    REQUIRE_OK((w8a8 ? g.cpu_w8a8 : g.cpu)
                   ->quant_linear(Tensor::matrix(const_cast<float*>(x.values.data()), DType::F32, m, k), host,
                                  Tensor::matrix(ref.data(), DType::F32, m, n)));
  }
  // S = sum |x_k w_k| over the activations the reference multiplied
  std::vector<float> xs = x.values;
  if (w8a8) {
    const int64_t group = host.granularity == ScaleGranularity::block ? host.block_k : k;
    for (int64_t r = 0; r < m; r++) detail::fake_quantize_fp8_row(&xs[size_t(r * k)], k, group, &xs[size_t(r * k)]);
  }
  std::vector<float> w(size_t(n * k));
  REQUIRE_OK(dequantize_rows(host, 0, n, w.data()));
  // the GPU, into a poisoned output
  const int64_t out_stride = n + 3;
  const size_t element = size_t(dtype_bytes(g.activation, 1));
  std::vector<uint8_t> out(size_t(m * out_stride) * element);
  for (size_t i = 0; i < out.size(); i += element) encode(g.activation, NAN, &out[i]);
  void* out_device = g.memory.take(out.size());
  const Tensor out_bytes = Tensor::matrix(out_device, DType::U8, 1, int64_t(out.size()));
  REQUIRE_OK(g.cuda->copy_from_host(out.data(), out_bytes));
  REQUIRE_OK(g.cuda->quant_linear(x.on_gpu(g.activation), device, Tensor{out_device, g.activation, m, n, out_stride}));
  REQUIRE_OK(g.cuda->synchronize());
  REQUIRE_OK(g.cuda->copy_to_host(out_bytes, out.data()));
  REQUIRE_OK(cuda::set_quant_kernel(*g.cuda, cuda::QuantKernel::automatic));

  const double factor = bound == Bound::w8a8            ? 1.0 / 256 + 1.0 / 1024
                        : bound == Bound::rounded_twice ? (g.activation == DType::F16 ? 3.0 / 1024 + 1.0 / 128 : 3.0 / 128)
                                                        : 2.0 * double(k + 16) / 16777216.0;
  int64_t bad = 0, nonfinite = 0, padding = 0;
  std::string first;
  for (int64_t r = 0; r < m; r++) {
    for (int64_t c = 0; c < n; c++) {
      double s = 0;
      for (int64_t i = 0; i < k; i++) s += std::fabs(double(xs[size_t(r * k + i)]) * double(w[size_t(c * k + i)]));
      const double got = decode(g.activation, &out[size_t(r * out_stride + c) * element]);
      const double want = ref[size_t(r * n + c)];
      const double allowed = step_of(g.activation, want) + factor * s;
      if (!std::isfinite(got)) nonfinite++;
      if (!(std::fabs(got - want) <= allowed) && bad++ == 0)
        first = "[" + std::to_string(r) + ", " + std::to_string(c) + "]: got " + std::to_string(got) + ", CPU " +
                std::to_string(want) + ", allowed " + std::to_string(allowed);
    }
    for (int64_t c = n; c < out_stride; c++)
      padding += !std::isnan(decode(g.activation, &out[size_t(r * out_stride + c) * element]));
  }
  INFO(first);
  CHECK(nonfinite == 0);
  CHECK(bad == 0);
  CHECK(padding == 0);
}

// Uploads `o` and checks it at each row count through `kernel`.
void check_rows(Gpu& g, const OwnedWeight& o, cuda::QuantKernel kernel, Bound bound,
                const std::vector<int64_t>& rows, Random& rng, int64_t pad = 0, uint64_t skew = 0) {
  const QuantWeight device = g.upload(o.weight);
  for (int64_t m : rows) {
    Activations x(g, rng, m, o.weight.in_features, pad, skew);
    check_quant_linear(g, o.weight, device, x, kernel, bound);
  }
}

const DType kHalfActivations[] = {DType::BF16, DType::F16};

// The int4 weights the A16 kernels are checked on.
struct Int4Shape { int64_t n, k, group; bool asymmetric, act_order; };
const Int4Shape kInt4Shapes[] = {
    {192, 256, 128, false, false},     // N = 3 x 64
    {320, 4096, 128, true, false},     // N = 5 x 64, 32 stages: split-K at M <= 64
    {200, 96, 32, true, false},        // ragged N, K not a multiple of 128 (the last tile past K)
    {64 * 7, 200, 200, false, false},  // channel, K = 200
    {136, 1040, 16, true, false},      // groups of 16 (a new group every int4 tile), K = 1040 (8 stages + 16)
};
// The fp8 weights the A16 kernels (W8A16 mma, the GEMV) are checked on.
struct Fp8A16Shape { int64_t n, k; ScaleGranularity granularity; int64_t block_n, block_k; DequantRounding rounding; };
const Fp8A16Shape kFp8A16Shapes[] = {
    {192, 256, ScaleGranularity::tensor, 0, 0, DequantRounding::scale_dtype},
    {200, 160, ScaleGranularity::channel, 0, 0, DequantRounding::scale_dtype},
    {320, 2048, ScaleGranularity::block, 128, 128, DequantRounding::f32},
    {136, 160, ScaleGranularity::block, 128, 128, DequantRounding::f32},           // partial blocks both ways
    {40 * 3, 96, ScaleGranularity::block, 16, 32, DequantRounding::scale_dtype},  // small blocks: one per fp8 tile
};

}  // namespace

// ---- W4A16 ------------------------------------------------------------------------------------------------------

TEST_CASE("W4A16 mma matches the CPU: M 1..64 and 100+, N odd multiples of 64 and ragged, odd K, groups, zeros") {
  GPU_OR_SKIP();
  Random rng(201);
  for (DType activation : kHalfActivations) {
    Gpu g(activation);
    for (const Int4Shape& s : kInt4Shapes) {
      OwnedWeight o = make_int4(s.n, s.k, s.group, activation, s.asymmetric, s.act_order, rng);
      add_bias(o, activation, rng);
      check_rows(g, o, cuda::QuantKernel::mma_a16, Bound::exact_weights, {1, 2, 5, 16, 17, 33, 64, 100, 257}, rng);
    }
  }
}

TEST_CASE("W4A16 act-order (g_idx) and unaligned or strided activations run through the staged copy") {
  GPU_OR_SKIP();
  Random rng(202);
  Gpu g(DType::BF16);
  OwnedWeight act_order = make_int4(192, 512, 64, DType::BF16, true, true, rng);
  CHECK(cuda::quant_gpu_layout(act_order.weight).permuted);
  check_rows(g, act_order, cuda::QuantKernel::mma_a16, Bound::exact_weights, {1, 7, 64, 130}, rng);
  check_rows(g, act_order, cuda::QuantKernel::dequant_cublas, Bound::exact_weights, {3, 300}, rng);
  OwnedWeight plain = make_int4(128, 384, 128, DType::BF16, false, false, rng);
  check_rows(g, plain, cuda::QuantKernel::mma_a16, Bound::exact_weights, {1, 9, 70}, rng, /*pad=*/5, /*skew=*/2);
  check_rows(g, plain, cuda::QuantKernel::mma_a16, Bound::exact_weights, {3, 40}, rng, /*pad=*/8, /*skew=*/0);
  OwnedWeight odd_k = make_int4(128, 100, 100, DType::BF16, true, false, rng);  // K % 8 != 0: staged
  check_rows(g, odd_k, cuda::QuantKernel::mma_a16, Bound::exact_weights, {1, 20}, rng);
}

// ---- the GEMV (decode rows) ---------------------------------------------------------------------------------------

TEST_CASE("W4A16 and W8A16 GEMVs match the CPU: rows 1..16 and passes past them, every int4 and fp8 layout, staged "
          "rows") {
  GPU_OR_SKIP();
  Random rng(211);
  for (cuda::QuantKernel gemv : {cuda::QuantKernel::gemv_a16, cuda::QuantKernel::gemv_mma}) {
    INFO("kernel ", cuda::quant_kernel_name(gemv));
    // gemv_a16 computes 4 rows a launch, gemv_mma 16: rows on both sides of each, and passes past them
    const std::vector<int64_t> int4_rows = gemv == cuda::QuantKernel::gemv_a16
                                               ? std::vector<int64_t>{1, 2, 3, 4, 6, 9}
                                               : std::vector<int64_t>{1, 2, 7, 8, 9, 16, 17, 35};
    const std::vector<int64_t> fp8_rows = gemv == cuda::QuantKernel::gemv_a16 ? std::vector<int64_t>{1, 2, 3, 4, 5}
                                                                               : std::vector<int64_t>{1, 5, 9, 16, 21};
    // the mma kernel's shapes, and act-order and K % 8 != 0 (both staged)
    std::vector<Int4Shape> int4_shapes(std::begin(kInt4Shapes), std::end(kInt4Shapes));
    int4_shapes.push_back({192, 512, 64, true, true});
    int4_shapes.push_back({128, 100, 100, true, false});
    for (DType activation : kHalfActivations) {
      Gpu g(activation);
      for (const Int4Shape& s : int4_shapes) {
        OwnedWeight o = make_int4(s.n, s.k, s.group, activation, s.asymmetric, s.act_order, rng);
        add_bias(o, activation, rng);
        check_rows(g, o, gemv, Bound::exact_weights, int4_rows, rng);
      }
      for (const Fp8A16Shape& s : kFp8A16Shapes) {
        OwnedWeight o = make_fp8(s.n, s.k, s.granularity, s.block_n, s.block_k, activation, s.rounding, rng);
        add_bias(o, DType::F32, rng);
        check_rows(g, o, gemv, a16_bound(o.weight, activation), fp8_rows, rng);
      }
      // rows padded and misaligned (staged), and padded but aligned (read in place)
      OwnedWeight plain = make_int4(128, 384, 128, activation, false, false, rng);
      check_rows(g, plain, gemv, Bound::exact_weights, {1, 3}, rng, /*pad=*/5, /*skew=*/2);
      check_rows(g, plain, gemv, Bound::exact_weights, {2, 4}, rng, /*pad=*/8, /*skew=*/0);
    }
  }
}

// ---- FP8 ------------------------------------------------------------------------------------------------------------

TEST_CASE("W8A16 mma matches the CPU: tensor, channel and block scales, odd shapes") {
  GPU_OR_SKIP();
  Random rng(203);
  for (DType activation : kHalfActivations) {
    Gpu g(activation);
    for (const Fp8A16Shape& s : kFp8A16Shapes) {
      OwnedWeight o = make_fp8(s.n, s.k, s.granularity, s.block_n, s.block_k, activation, s.rounding, rng);
      check_rows(g, o, cuda::QuantKernel::mma_a16, a16_bound(o.weight, activation), {1, 3, 16, 31, 64, 65, 200}, rng);
    }
  }
}

TEST_CASE("W8A8 mma (sm_89+) matches the CPU's fp8-activation reference") {
  GPU_OR_SKIP();
  if (device_sm() < cuda::kQuantW8A8MinSm) {
    Gpu g(DType::BF16);
    CHECK(cuda::set_quant_kernel(*g.cuda, cuda::QuantKernel::mma_w8a8).error().code == ErrorCode::unsupported);
    MESSAGE("sm_" << device_sm() << " has no e4m3 tensor cores: W8A8 not run");
    return;
  }
  Random rng(204);
  struct Shape { int64_t n, k; ScaleGranularity granularity; int64_t block_n, block_k; DType scale_dtype; };
  const Shape shapes[] = {
      {192, 128, ScaleGranularity::channel, 0, 0, DType::F32},
      {200, 256, ScaleGranularity::tensor, 0, 0, DType::BF16},
      {320, 4096, ScaleGranularity::block, 128, 128, DType::F32},
      {136, 160, ScaleGranularity::block, 128, 128, DType::BF16},
      {64 * 5, 96, ScaleGranularity::block, 16, 32, DType::F16},
  };
  for (DType activation : kHalfActivations) {
    Gpu g(activation);
    for (const Shape& s : shapes) {
      OwnedWeight o = make_fp8(s.n, s.k, s.granularity, s.block_n, s.block_k, s.scale_dtype,
                               DequantRounding::scale_dtype, rng);
      add_bias(o, DType::F32, rng);
      check_rows(g, o, cuda::QuantKernel::mma_w8a8, Bound::w8a8, {1, 2, 16, 17, 64, 100, 300}, rng);
    }
  }
}

// ---- dequantize + cuBLAS, the automatic choice, mixed dtypes --------------------------------------------------

TEST_CASE("dequantize + cuBLAS matches the CPU for every layout, F32 activations with exact weights") {
  GPU_OR_SKIP();
  Random rng(205);
  for (DType activation : {DType::F32, DType::BF16, DType::F16}) {
    Gpu g(activation);
    const DType scale_dtype = activation == DType::F32 ? DType::BF16 : activation;
    // exact on every side: F32 activations hold any scale dtype's product; BF16/F16 hold their own
    OwnedWeight groups24 = make_int4(136, 240, 24, scale_dtype, true, true, rng);  // no mma: groups of 24
    OwnedWeight int4 = make_int4(192, 1024, 128, scale_dtype, false, false, rng);
    OwnedWeight fp8 = make_fp8(200, 300, ScaleGranularity::block, 24, 48, scale_dtype, DequantRounding::scale_dtype, rng);
    add_bias(int4, DType::BF16, rng);
    // int8 (GPTQ 8-bit, compressed-tensors INT8) runs only here: asymmetric act-order groups, channel with a bias
    OwnedWeight int8_groups = make_int8(136, 240, 48, scale_dtype, true, true, /*w8a8=*/false, rng);
    OwnedWeight int8_channel = make_int8(200, 300, 300, scale_dtype, false, false, /*w8a8=*/false, rng);
    add_bias(int8_channel, DType::BF16, rng);
    for (const OwnedWeight* o : {&groups24, &int4, &fp8, &int8_groups, &int8_channel})
      check_rows(g, *o, cuda::QuantKernel::dequant_cublas, Bound::exact_weights, {1, 5, 64, 300}, rng);
    if (activation == DType::F32) {
      // F32 activations: the automatic choice is this path, and the mma kernels refuse
      check_rows(g, int4, cuda::QuantKernel::automatic, Bound::exact_weights, {1, 2}, rng);
      const QuantWeight device = g.upload(int4.weight);
      Activations x(g, rng, 2, 1024, 0, 0);
      std::vector<uint8_t> out(2 * 192 * 4);
      void* out_device = g.memory.take(out.size());
      REQUIRE_OK(cuda::set_quant_kernel(*g.cuda, cuda::QuantKernel::mma_a16));
      const Status refused = g.cuda->quant_linear(x.on_gpu(DType::F32), device,
                                                  Tensor::matrix(out_device, DType::F32, 2, 192));
      REQUIRE_FALSE(refused.ok());
      CHECK(refused.error().code == ErrorCode::unsupported);
      CHECK(refused.error().message.find("BF16 or F16") != std::string::npos);
      REQUIRE_OK(cuda::set_quant_kernel(*g.cuda, cuda::QuantKernel::automatic));
    }
  }
}

TEST_CASE("the automatic choice runs every format at decode and prefill sizes") {
  GPU_OR_SKIP();
  Random rng(206);
  const bool w8a8 = cuda::quant_w8a8_preferred(device_sm());  // what automatic picks for fp8
  for (DType activation : kHalfActivations) {
    Gpu g(activation);
    OwnedWeight int4 = make_int4(64 * 9, 2048, 128, activation, true, false, rng);
    check_rows(g, int4, cuda::QuantKernel::automatic, Bound::exact_weights,
               {1, 4, cuda::quant_gemv_mma_auto_rows(WeightFormat::int4) + 1, 64, cuda::kQuantMmaMaxRows + 44}, rng);
    OwnedWeight fp8 = make_fp8(64 * 9, 2048, ScaleGranularity::block, 128, 128, activation, DequantRounding::f32, rng);
    // up to quant_gemv_mma_auto_rows rows the tensor-core GEMV (A16 arithmetic), then W8A8 where it is native
    const int64_t gemv_rows = cuda::quant_gemv_mma_auto_rows(WeightFormat::fp8);
    check_rows(g, fp8, cuda::QuantKernel::automatic, a16_bound(fp8.weight, activation), {1, 8, gemv_rows}, rng);
    check_rows(g, fp8, cuda::QuantKernel::automatic, w8a8 ? Bound::w8a8 : a16_bound(fp8.weight, activation),
               {gemv_rows + 1, 64, cuda::kQuantMmaMaxRows + 44}, rng);
    // int8: dequantize + cuBLAS at every row count, weights as exact as the reference's
    OwnedWeight int8 = make_int8(64 * 9 + 5, 2048, 128, activation, true, false, /*w8a8=*/false, rng);
    check_rows(g, int8, cuda::QuantKernel::automatic, Bound::exact_weights, {1, 4, 17, 64, cuda::kQuantMmaMaxRows + 44}, rng);
  }
}

TEST_CASE("scales of another dtype than the activations: each weight the reference's rounded once with fp32 "
          "products (and the dequantize path), within two roundings without") {
  GPU_OR_SKIP();
  Random rng(207);
  for (DType activation : kHalfActivations)
    for (bool fp32_products : {true, false}) {
    CAPTURE(fp32_products);
    Gpu g(activation, kCudaScratchBytes, fp32_products);
    const Bound bound = fp32_products ? Bound::rounded_once : Bound::rounded_twice;
    const DType other = activation == DType::BF16 ? DType::F16 : DType::BF16;
    for (DType scale_dtype : {DType::F32, other}) {
      for (DequantRounding rounding : {DequantRounding::scale_dtype, DequantRounding::f32}) {
        CAPTURE(std::string(dtype_name(scale_dtype)));
        CAPTURE(int(rounding));
        OwnedWeight int4 = make_int4(192, 512, 64, scale_dtype, true, false, rng);
        OwnedWeight fp8 = make_fp8(192, 512, ScaleGranularity::block, 64, 128, scale_dtype, rounding, rng);
        for (const OwnedWeight* o : {&int4, &fp8}) {
          if (o == &int4 && rounding == DequantRounding::f32) continue;  // int4 rounds in the scale's dtype only
          for (cuda::QuantKernel kernel : {cuda::QuantKernel::mma_a16, cuda::QuantKernel::dequant_cublas,
                                           cuda::QuantKernel::gemv_a16, cuda::QuantKernel::gemv_mma})
            check_rows(g, *o, kernel, kernel == cuda::QuantKernel::dequant_cublas ? Bound::rounded_once : bound,
                       {1, 3, 17}, rng);
        }
      }
    }
  }
}

// ---- split-K, passes, workspace ------------------------------------------------------------------------------------

TEST_CASE("split-K at M = 1 is deterministic and leaves its counters at rest, and a small workspace runs in passes") {
  GPU_OR_SKIP();
  Random rng(208);
  Gpu g(DType::BF16);
  OwnedWeight o = make_int4(128, 8192, 128, DType::BF16, false, false, rng);  // 2 column tiles, 64 stages
  const QuantWeight device = g.upload(o.weight);
  Activations x(g, rng, 1, 8192, 0, 0);
  std::vector<uint8_t> first(128 * 2), again(128 * 2);
  void* out_device = g.memory.take(first.size());
  const Tensor out = Tensor::matrix(out_device, DType::BF16, 1, 128);
  const Tensor out_bytes = Tensor::matrix(out_device, DType::U8, 1, int64_t(first.size()));
  for (int call = 0; call < 5; call++) {
    REQUIRE_OK(g.cuda->quant_linear(x.on_gpu(DType::BF16), device, out));
    REQUIRE_OK(g.cuda->copy_to_host(out_bytes, call == 0 ? first.data() : again.data()));
    if (call > 0) CHECK(first == again);
  }
  const cuda::QuantGpuLayout layout = cuda::quant_gpu_layout(device);
  std::vector<uint32_t> counters(size_t(layout.n_tiles), 1);
  REQUIRE_OK(g.cuda->copy_to_host(
      Tensor::matrix(const_cast<uint8_t*>(device.packed) + layout.counters_offset, DType::U32, 1, layout.n_tiles),
      counters.data()));
  CHECK(std::all_of(counters.begin(), counters.end(), [](uint32_t c) { return c == 0; }));
  check_quant_linear(g, o.weight, device, x, cuda::QuantKernel::mma_a16, Bound::exact_weights);
  check_quant_linear(g, o.weight, device, x, cuda::QuantKernel::gemv_a16, Bound::exact_weights);
  check_quant_linear(g, o.weight, device, x, cuda::QuantKernel::gemv_mma, Bound::exact_weights);

  // 256 KiB of scratch: fewer splits, staged rows in passes of 64, the dequantized weights 128 rows at a time
  Gpu tight(DType::BF16, 256 * KiB);
  OwnedWeight act_order = make_int4(256, 1024, 128, DType::BF16, true, true, rng);
  check_rows(tight, act_order, cuda::QuantKernel::mma_a16, Bound::exact_weights, {1, 64, 200}, rng);
  check_rows(tight, act_order, cuda::QuantKernel::dequant_cublas, Bound::exact_weights, {3}, rng);
  check_rows(tight, act_order, cuda::QuantKernel::gemv_a16, Bound::exact_weights, {1, 4, 7}, rng);
  check_rows(tight, act_order, cuda::QuantKernel::gemv_mma, Bound::exact_weights, {1, 16, 20}, rng);
  if (device_sm() >= cuda::kQuantW8A8MinSm) {
    OwnedWeight fp8 = make_fp8(256, 1024, ScaleGranularity::channel, 0, 0, DType::BF16, DequantRounding::scale_dtype, rng);
    check_rows(tight, fp8, cuda::QuantKernel::mma_w8a8, Bound::w8a8, {1, 300}, rng);
  }
}

// ---- fixtures, errors ------------------------------------------------------------------------------------------

TEST_CASE("the quantized fixture Linears run on the GPU as on the CPU") {
  GPU_OR_SKIP();
  Random rng(209);
  Gpu g(DType::BF16);
  const std::string base = std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/quant/";
  const bool w8a8 = device_sm() >= cuda::kQuantW8A8MinSm;
  auto run = [&](const QuantWeight& host) {
    const QuantWeight device = g.upload(host);
    const cuda::QuantGpuLayout layout = cuda::quant_gpu_layout(host);
    for (int64_t m : {1, 3, 70}) {
      Activations x(g, rng, m, host.in_features, 0, 0);
      const Bound bound = a16_bound(host, DType::BF16);
      check_quant_linear(g, host, device, x, cuda::QuantKernel::dequant_cublas, bound);
      if (layout.mma) check_quant_linear(g, host, device, x, cuda::QuantKernel::mma_a16, bound);
      if (layout.mma) check_quant_linear(g, host, device, x, cuda::QuantKernel::gemv_a16, bound);
      if (layout.mma) check_quant_linear(g, host, device, x, cuda::QuantKernel::gemv_mma, bound);
      if (layout.mma && w8a8 && host.format == WeightFormat::fp8)
        check_quant_linear(g, host, device, x, cuda::QuantKernel::mma_w8a8, Bound::w8a8);
    }
  };
  TensorStore odd = TensorStore::open_files({base + "odd-linears/model.safetensors"}).value();
  const json doc = json::parse(detail::read_text_file(base + "odd-linears/linears.json"));
  for (const json& entry : doc["linears"]) run(quant_weight(odd_linear_desc(entry), odd).value());
  for (const char* name : {"tiny-w4a16", "tiny-fp8", "tiny-fp8-qwen", "../quant_formats/awq-g32-zp-skip",
                           "../quant_formats/gptq-g32-asym-actorder", "../quant_formats/gptq-v2-channel-asym"}) {
    const std::string dir = base + name;
    TensorStore store = TensorStore::open_dir(dir).value();
    const std::vector<LinearDesc> linears = describe_linears(load_config(dir).value(), &store).value();
    for (const LinearDesc& desc : linears)
      if (desc.format != WeightFormat::dense) run(quant_weight(desc, store).value());
  }
}

TEST_CASE("fused Linears (q|k|v, gate|up) uploaded as one run every kernel as their rows stacked do on the CPU") {
  GPU_OR_SKIP();
  Random rng(212);
  const bool w8a8 = device_sm() >= cuda::kQuantW8A8MinSm;
  for (DType activation : kHalfActivations) {
    Gpu g(activation);
    // the reference: the parts' rows stacked into one checkpoint weight (concatenate_rows), on the CPU
    auto run = [&](const std::vector<const QuantWeight*>& parts) {
      REQUIRE(cuda::quant_fusion_refusal(parts) == "");
      const OwnedWeight stacked = concatenate_rows(parts);
      const uint64_t bytes = cuda::quant_device_bytes(parts);
      Result<QuantWeight> device = cuda::upload_quant_weight(*g.cuda, parts, g.memory.take(bytes), bytes);
      REQUIRE_OK(device);
      CHECK(device->out_features == stacked.weight.out_features);
      CHECK(device->name.find('+') != std::string::npos);
      const Bound bound = a16_bound(stacked.weight, activation);
      for (int64_t m : {1, 2, 9, 70}) {
        Activations x(g, rng, m, stacked.weight.in_features, 0, 0);
        for (cuda::QuantKernel kernel : {cuda::QuantKernel::automatic, cuda::QuantKernel::gemv_a16,
                                         cuda::QuantKernel::gemv_mma, cuda::QuantKernel::mma_a16,
                                         cuda::QuantKernel::dequant_cublas}) {
          const bool automatic_w8a8 = kernel == cuda::QuantKernel::automatic &&
                                      stacked.weight.format == WeightFormat::fp8 &&
                                      m > cuda::quant_gemv_mma_auto_rows(WeightFormat::fp8) &&
                                      cuda::quant_w8a8_preferred(device_sm());
          check_quant_linear(g, stacked.weight, *device, x, kernel, automatic_w8a8 ? Bound::w8a8 : bound);
        }
        if (w8a8 && stacked.weight.format == WeightFormat::fp8)
          check_quant_linear(g, stacked.weight, *device, x, cuda::QuantKernel::mma_w8a8, Bound::w8a8);
      }
    };
    // int4 q | k | v of a GQA layer, 4,096 input features (split-K at decode), zero points, the last part ragged,
    // biases in q and v only
    OwnedWeight q = make_int4(256, 4096, 128, activation, true, false, rng);
    OwnedWeight k = make_int4(64, 4096, 128, activation, true, false, rng);
    OwnedWeight v = make_int4(64 + 8, 4096, 128, activation, true, false, rng);
    add_bias(q, activation, rng);
    add_bias(v, DType::F32, rng);
    run({&q.weight, &k.weight, &v.weight});
    // int4 act-order q | k | v sharing one g_idx (the activations permuted once for all three)
    OwnedWeight aq = make_int4(128, 1024, 64, activation, false, true, rng);
    OwnedWeight ak = make_int4(64, 1024, 64, activation, false, true, rng);
    OwnedWeight av = make_int4(64, 1024, 64, activation, false, true, rng);
    for (OwnedWeight* o : {&ak, &av}) {
      o->g_idx = aq.g_idx;
      o->weight.g_idx = o->g_idx.data();
    }
    run({&aq.weight, &ak.weight, &av.weight});
    // int4 gate | up
    OwnedWeight gate = make_int4(320, 1024, 32, activation, false, false, rng);
    OwnedWeight up = make_int4(320, 1024, 32, activation, false, false, rng);
    run({&gate.weight, &up.weight});
    // fp8 q | k | v with per-tensor scales of their own (one scale a column on the device), and block-scaled gate | up
    OwnedWeight fq = make_fp8(128, 1024, ScaleGranularity::tensor, 0, 0, activation, DequantRounding::scale_dtype, rng);
    OwnedWeight fk = make_fp8(64, 1024, ScaleGranularity::tensor, 0, 0, activation, DequantRounding::scale_dtype, rng);
    OwnedWeight fv = make_fp8(64, 1024, ScaleGranularity::channel, 0, 0, activation, DequantRounding::scale_dtype, rng);
    run({&fq.weight, &fk.weight, &fv.weight});
    OwnedWeight fgate = make_fp8(256, 2048, ScaleGranularity::block, 128, 128, DType::F32, DequantRounding::f32, rng);
    OwnedWeight fup = make_fp8(256, 2048, ScaleGranularity::block, 128, 128, DType::F32, DequantRounding::f32, rng);
    run({&fgate.weight, &fup.weight});
  }
}

TEST_CASE("upload_quant_weight and quant_linear refuse what they cannot run, naming it") {
  GPU_OR_SKIP();
  Random rng(210);
  Gpu g(DType::BF16);
  OwnedWeight o = make_int4(128, 256, 128, DType::BF16, false, false, rng);
  const uint64_t bytes = cuda::quant_device_bytes(o.weight);
  auto refused = [](const Result<QuantWeight>& r, ErrorCode code, const std::string& words) {
    REQUIRE_FALSE(r.ok());
    INFO(r.error().message);
    CHECK(r.error().code == code);
    CHECK(r.error().message.find(words) != std::string::npos);
  };
  refused(cuda::upload_quant_weight(*g.cpu, o.weight, g.memory.take(bytes), bytes), ErrorCode::invalid_argument,
          "not a CUDA backend");
  refused(cuda::upload_quant_weight(*g.cuda, o.weight, g.memory.take(bytes), bytes - 1), ErrorCode::invalid_argument,
          "hand.int4");
  refused(cuda::upload_quant_weight(*g.cuda, o.weight, g.memory.take_unaligned(bytes, 16), bytes),
          ErrorCode::invalid_argument, "256-byte aligned");
  const QuantWeight device = g.upload(o.weight);
  refused(cuda::upload_quant_weight(*g.cuda, device, g.memory.take(bytes), bytes), ErrorCode::invalid_argument,
          "uploaded");
  OwnedWeight nan = make_fp8(64, 128, ScaleGranularity::tensor, 0, 0, DType::BF16, DequantRounding::scale_dtype, rng);
  nan.fp8[70] = 0x7f;
  refused(cuda::upload_quant_weight(*g.cuda, nan.weight, g.memory.take(bytes), bytes), ErrorCode::bad_format,
          "hand.fp8.weight[0, 70]");
  // each backend takes its own view
  Activations x(g, rng, 2, 256, 0, 0);
  void* out_device = g.memory.take(2 * 128 * 2);
  const Status host_view = g.cuda->quant_linear(x.on_gpu(DType::BF16), o.weight,
                                                Tensor::matrix(out_device, DType::BF16, 2, 128));
  REQUIRE_FALSE(host_view.ok());
  CHECK(host_view.error().message.find("upload it with cuda::upload_quant_weight") != std::string::npos);
  std::vector<float> xs(2 * 256, 0.5f), out(2 * 128);
  const Status device_view = g.cpu->quant_linear(Tensor::matrix(xs.data(), DType::F32, 2, 256), device,
                                                 Tensor::matrix(out.data(), DType::F32, 2, 128));
  REQUIRE_FALSE(device_view.ok());
  CHECK(device_view.error().message.find("repacked for the CUDA backend") != std::string::npos);
  CHECK(g.cuda->supports(Op::quant_linear, DType::I32));
  CHECK(g.cuda->supports(Op::quant_linear, DType::F8_E4M3));
  CHECK_FALSE(g.cuda->supports(Op::quant_linear, DType::BF16));
}
