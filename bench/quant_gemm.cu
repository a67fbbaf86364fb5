// bench/quant_gemm.cu -> build/bench-quant_gemm: kvlite's quantized GEMMs (kernels.cu section 3b) on this GPU,
// in llm.c's manner: for every shape, validate against the CPU reference first (sampled outputs, each compared
// with a float64 dot product over dequantize_rows), then time, then print the achieved bandwidth next to the
// copy bandwidth measured in the same run and the time of cuBLAS BF16 on the same shape.
//
// Shapes: the Linears of Llama-3.1-8B and Qwen3-VL-4B (qkv, o, gate_up fused, down, and an lm_head-sized one),
// each as W4A16 (int4, group 128, BF16 scales) and as FP8 (e4m3, 128 x 128 blocks, BF16 weight_scale_inv), at
// M = 1, 2, 4, 8, 16, 32, 64, 512, 2048 rows of BF16 activations. kvlite runs its automatic choice
// (cuda::choose_quant_kernel); at decode rows (M <= 16) and M >= 512 the other paths are validated and timed too
// (mma vs dequantize + cuBLAS), and for FP8 on sm_89+ cuBLASLt's FP8 GEMM (per-tensor scales: the same tensor-core
// work) is the prefill reference.
// Times are per call, from CUDA events around a CUDA graph of repeated calls (no launch overhead).
//
//   build/bench-quant_gemm [--format int4|fp8] [--model llama|qwen] [--layer qkv|o|gate_up|down|lm_head]
//                          [--rows 1,16,512]     (--layer: one shape, e.g. for ncu)
// Exit status 1 when a validation fails.
#include "kvlite.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace kvlite;

namespace {

#define BENCH_CUDA(call)                                                                               \
  do {                                                                                                 \
    cudaError_t bench_status_ = (call);                                                                \
    if (bench_status_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(bench_status_));              \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)
#define BENCH_CUBLAS(call)                                                                             \
  do {                                                                                                 \
    cublasStatus_t bench_status_ = (call);                                                             \
    if (bench_status_ != CUBLAS_STATUS_SUCCESS) {                                                      \
      std::fprintf(stderr, "%s failed: %s\n", #call, cublasGetStatusString(bench_status_));           \
      std::exit(2);                                                                                    \
    }                                                                                                  \
  } while (0)
template <class T>
T ok_or_exit(Result<T> result, const char* what) {
  if (!result.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, result.error().message.c_str());
    std::exit(2);
  }
  return std::move(*result);
}
void ok_or_exit(const Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.error().message.c_str());
    std::exit(2);
  }
}

struct Shape {
  const char* model;
  const char* layer;
  int64_t n, k;
};
const Shape kShapes[] = {
    {"llama", "qkv", 6144, 4096},   {"llama", "o", 4096, 4096},    {"llama", "gate_up", 28672, 4096},
    {"llama", "down", 4096, 14336}, {"llama", "lm_head", 128256, 4096},
    {"qwen", "qkv", 6144, 2560},    {"qwen", "o", 2560, 4096},     {"qwen", "gate_up", 19456, 2560},
    {"qwen", "down", 2560, 9728},   {"qwen", "lm_head", 151936, 2560},
};
const int64_t kDefaultRows[] = {1, 2, 4, 8, 16, 32, 64, 512, 2048};

// ---- device data -------------------------------------------------------------------------------------------------
// Random bf16 in [-1, 1) / random finite e4m3 bytes, from a hash of the index (no host round trip).
__device__ __forceinline__ uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}
__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(float(mix(seed + uint64_t(i)) >> 8) * (2.0f / 16777216.0f) - 1.0f);
}
__global__ void fill_fp8_kernel(uint8_t* p, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    uint8_t byte = uint8_t(mix(seed + uint64_t(i)));
    if ((byte & 0x7f) == 0x7f) byte ^= 0x08;  // no NaN codes
    if ((byte & 0x78) >= 0x58) byte &= 0xcf;  // keep |q| small: products of two stay well inside bf16
    p[i] = byte;
  }
}

// The copy ceiling: 16-byte loads and stores, a grid-stride loop over the whole buffer (each byte read once and
// written once). On an H200 (2026-11-27) a cudaMemcpy of 1 GiB captured into a graph moved 2.77 TB/s, an eager one
// 4.27 and this kernel 3.93 (bench/RESULTS.md), so the ceiling is the faster of this kernel and an eager copy.
__global__ void __launch_bounds__(256) copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                                   int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(uint64_t bytes) { BENCH_CUDA(cudaMalloc(&p, std::max<uint64_t>(bytes, 256))); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// ---- timing ---------------------------------------------------------------------------------------------------------
// Microseconds per call of `call` (which queues work on `stream`): a CUDA graph of `reps` calls replayed,
// timed with events; reps chosen so that one replay takes ~20 ms. Without graph capture (an API the call uses
// refuses it) the calls are queued back to back instead.
double time_us(cudaStream_t stream, const std::function<void()>& call) {
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  call();  // warm-up: kernels configured, caches and clocks settled
  BENCH_CUDA(cudaEventRecord(start, stream));
  call();
  BENCH_CUDA(cudaEventRecord(stop, stream));
  BENCH_CUDA(cudaEventSynchronize(stop));
  float once_ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&once_ms, start, stop));
  const int reps = int(std::clamp(20.0 / std::max(once_ms, 0.001f), 3.0, 300.0));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool graphed = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
  if (graphed) {
    for (int r = 0; r < reps; r++) call();
    graphed = cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph != nullptr &&
              cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  }
  cudaGetLastError();
  float ms = 0;
  for (int trial = 0; trial < 2; trial++) {  // the second replay is the one reported
    BENCH_CUDA(cudaEventRecord(start, stream));
    if (graphed) BENCH_CUDA(cudaGraphLaunch(exec, stream));
    else
      for (int r = 0; r < reps; r++) call();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1000.0 * ms / reps;
}

// ---- weights ----------------------------------------------------------------------------------------------------------
// A host QuantWeight with the tensors it views: int4 group 128 (BF16 scales) or fp8 128 x 128 blocks (BF16
// weight_scale_inv), random.
struct HostWeight {
  QuantWeight view;
  std::vector<uint8_t> data, scales;
};
HostWeight make_weight(bool fp8, int64_t n, int64_t k, uint64_t seed) {
  HostWeight h;
  QuantWeight& w = h.view;
  w.name = fp8 ? "bench.fp8" : "bench.int4";
  w.out_features = n;
  w.in_features = k;
  const int64_t bytes = fp8 ? n * k : n * k / 2;
  h.data.resize(size_t(bytes));
  // random bytes from a few threads (xorshift per slice)
  const int workers = int(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  std::vector<std::thread> threads;
  for (int t = 0; t < workers; t++)
    threads.emplace_back([&, t] {
      uint64_t state = seed * 0x9e3779b97f4a7c15ull + uint64_t(t) + 1;
      for (int64_t i = bytes * t / workers; i < bytes * (t + 1) / workers; i++) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        uint8_t byte = uint8_t(state >> 24);
        if (fp8 && (byte & 0x7f) == 0x7f) byte ^= 0x08;
        h.data[size_t(i)] = byte;
      }
    });
  for (std::thread& thread : threads) thread.join();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> scale(fp8 ? 0.0005f : 0.002f, fp8 ? 0.004f : 0.02f);
  if (fp8) {
    w.format = WeightFormat::fp8;
    w.granularity = ScaleGranularity::block;
    w.block_n = w.block_k = 128;
    w.fp8 = h.data.data();
    w.scale_rows = (n + 127) / 128;
    w.scale_cols = (k + 127) / 128;
    w.rounding = DequantRounding::f32;
  } else {
    w.format = WeightFormat::int4;
    w.granularity = ScaleGranularity::group;
    w.group_size = 128;
    w.packed = h.data.data();
    w.packed_cols = k / 8;
    w.scale_rows = n;
    w.scale_cols = k / 128;
    w.rounding = DequantRounding::scale_dtype;
  }
  w.scale_dtype = DType::BF16;
  h.scales.resize(size_t(w.scale_rows * w.scale_cols) * 2);
  for (size_t i = 0; i < h.scales.size(); i += 2) {
    const uint16_t bits = float_to_bf16(scale(rng));
    memcpy(&h.scales[i], &bits, 2);
  }
  w.scales = h.scales.data();
  return h;
}

// ---- cuBLASLt FP8 (the prefill reference) -----------------------------------------------------------------------------
// out [M, N] bf16 = x [M, K] e4m3 @ w [N, K]^T e4m3, per-tensor fp32 scales; "TN" as cuBLASLt FP8 requires.
struct LtFp8 {
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ready = false;
  LtFp8(int64_t m, int64_t n, int64_t k, const float* scale_one, uint64_t workspace_bytes) {
    if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_one, sizeof scale_one);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_one, sizeof scale_one);
    cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(n), k);
    cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(m), k);
    cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, uint64_t(n), uint64_t(m), n);
    cublasLtMatmulPreference_t preference = nullptr;
    cublasLtMatmulPreferenceCreate(&preference);
    cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                         sizeof workspace_bytes);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    ready = cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, preference, 1, &result, &found) ==
                CUBLAS_STATUS_SUCCESS &&
            found > 0;
    if (ready) algo = result.algo;
    cublasLtMatmulPreferenceDestroy(preference);
  }
  ~LtFp8() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (handle) cublasLtDestroy(handle);
  }
  void run(const void* w, const void* x, void* out, void* workspace, uint64_t workspace_bytes, cudaStream_t stream) {
    const float alpha = 1.0f, beta = 0.0f;
    BENCH_CUBLAS(cublasLtMatmul(handle, desc, &alpha, w, a, x, b, &beta, out, c, out, c, &algo, workspace,
                                workspace_bytes, stream));
  }
};

// ---- validation ---------------------------------------------------------------------------------------------------------
// 48 sampled outputs (first and last row and column among them) against a float64 dot product over the
// dequantized weight row (and, for W8A8, the fp8-quantized activation row). Bound: one bf16 step of the output
// plus 2^-7 of sum |x w| (weights rounded to bf16 by the kernels; W8A8's per-tile scaling).
bool validate(const QuantWeight& host, const std::vector<float>& x, int64_t m, const std::vector<uint16_t>& out,
              bool w8a8, std::string* worst) {
  const int64_t n = host.out_features, k = host.in_features;
  std::mt19937_64 rng(uint64_t(m * 7919 + n));
  std::vector<float> w(static_cast<size_t>(k)), xq(static_cast<size_t>(k));
  bool ok = true;
  double worst_ratio = 0;
  for (int sample = 0; sample < 48; sample++) {
    const int64_t r = sample == 0 ? 0 : sample == 1 ? m - 1 : int64_t(rng() % uint64_t(m));
    const int64_t c = sample == 0 ? 0 : sample == 1 ? n - 1 : int64_t(rng() % uint64_t(n));
    ok_or_exit(dequantize_rows(host, c, 1, w.data()), "dequantize_rows");
    const float* xr = &x[size_t(r * k)];
    if (w8a8) {
      detail::fake_quantize_fp8_row(xr, k, detail::fp8_activation_group(host), xq.data());
      xr = xq.data();
    }
    double dot = 0, sum = 0;
    for (int64_t i = 0; i < k; i++) {
      dot += double(xr[i]) * double(w[size_t(i)]);
      sum += std::fabs(double(xr[i]) * double(w[size_t(i)]));
    }
    const double got = bf16_to_float(out[size_t(r * n + c)]);
    const double allowed = std::fabs(dot) / 128 + sum / 128 + 1e-30;
    const double ratio = std::fabs(got - dot) / allowed;
    if (!(ratio <= 1.0)) ok = false;
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      char text[160];
      std::snprintf(text, sizeof text, "[%lld, %lld] got %.6g want %.6g", (long long)r, (long long)c, got, dot);
      *worst = text;
    }
  }
  return ok;
}

std::vector<int64_t> parse_rows(const char* text) {
  std::vector<int64_t> rows;
  for (const char* p = text; *p;) {
    rows.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') p++;
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  std::string only_format, only_model, only_layer;
  std::vector<int64_t> rows_list(std::begin(kDefaultRows), std::end(kDefaultRows));
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--format") only_format = argv[i + 1];
    else if (flag == "--model") only_model = argv[i + 1];
    else if (flag == "--layer") only_layer = argv[i + 1];
    else if (flag == "--rows") rows_list = parse_rows(argv[i + 1]);
  }
  if (!cuda::built_with_cuda() || cuda::device_count() == 0) {
    std::printf("bench-quant_gemm: no CUDA GPU; nothing to time\n");
    return 0;
  }
  const auto bench_start = std::chrono::steady_clock::now();
  const DeviceSpec device = ok_or_exit(cuda::query_device(0), "query_device");
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));

  // the backend, BF16 activations, the standard workspace
  DeviceBuffer workspace(kCudaWorkspaceBytes);
  CudaBackendOptions options;
  options.workspace = workspace.p;
  options.workspace_bytes = kCudaWorkspaceBytes;
  std::unique_ptr<Backend> backend = ok_or_exit(make_cuda_backend(options), "make_cuda_backend");
  cudaStream_t stream = static_cast<cudaStream_t>(ok_or_exit(cuda::backend_stream(*backend), "backend_stream"));

  // copy bandwidth: device-to-device over 1 GiB (20x the L2), bytes read + written; the faster of a copy kernel
  // (graphed like the GEMMs) and cudaMemcpy launched eagerly (a captured one may take a slower copy engine)
  double copy_gbs = 0, kernel_copy_gbs = 0, memcpy_gbs = 0;
  {
    const uint64_t bytes = 1 * GiB;
    DeviceBuffer a(bytes), b(bytes);
    BENCH_CUDA(cudaMemsetAsync(a.p, 1, bytes, stream));
    const int64_t vectors = int64_t(bytes / sizeof(uint4));
    const int copy_blocks = prop.multiProcessorCount * 8;
    const double kernel_us = time_us(stream, [&] {
      copy_kernel<<<copy_blocks, 256, 0, stream>>>(a.as<const uint4>(), b.as<uint4>(), vectors);
      BENCH_CUDA(cudaGetLastError());
    });
    kernel_copy_gbs = 2.0 * double(bytes) / (kernel_us * 1e3);
    // the library's own measure (Engine::measure_copy_bandwidth's): eager cudaMemcpy on the backend's stream
    memcpy_gbs = ok_or_exit(cuda::copy_bandwidth(*backend, b.p, a.p, bytes, 10), "copy_bandwidth") / 1e9;
    copy_gbs = std::max(kernel_copy_gbs, memcpy_gbs);
  }
  cublasHandle_t cublas;
  BENCH_CUBLAS(cublasCreate(&cublas));
  BENCH_CUBLAS(cublasSetStream(cublas, stream));
  DeviceBuffer cublas_workspace(kCudaCublasWorkspaceBytes);
  BENCH_CUBLAS(cublasSetWorkspace(cublas, cublas_workspace.p, kCudaCublasWorkspaceBytes));
  DeviceBuffer scale_one(4);
  const float one = 1.0f;
  BENCH_CUDA(cudaMemcpy(scale_one.p, &one, 4, cudaMemcpyHostToDevice));
  const bool fp8_cores = device.sm >= cuda::kQuantW8A8MinSm;

  std::printf("# kvlite quantized GEMMs on %s (sm_%d, %d SMs)\n", device.name.c_str(), device.sm,
              prop.multiProcessorCount);
  std::printf("copy bandwidth (device to device, read + write, 1 GiB): %.0f GB/s (copy kernel %.0f, eager cudaMemcpy %.0f)\n",
              copy_gbs, kernel_copy_gbs, memcpy_gbs);
  std::printf("kernel: the automatic choice; GB/s = (weight bytes on the device + x + out) / time; x = cuBLAS BF16 "
              "time / kvlite time\n");
  std::printf("%-6s %-8s %7s %6s %-5s %5s %-15s %9s %7s %6s %10s %6s %s\n", "model", "layer", "N", "K", "fmt", "M",
              "kernel", "us", "GB/s", "%copy", "cublas_us", "x", "check / other paths");
  bool all_ok = true;
  for (const char* format : {"int4", "fp8"}) {
    if (!only_format.empty() && only_format != format) continue;
    const bool fp8 = std::string(format) == "fp8";
    for (const Shape& shape : kShapes) {
      if (!only_model.empty() && only_model != shape.model) continue;
      if (!only_layer.empty() && only_layer != shape.layer) continue;
      const int64_t n = shape.n, k = shape.k, max_rows = *std::max_element(rows_list.begin(), rows_list.end());
      HostWeight host = make_weight(fp8, n, k, uint64_t(n * 31 + k));
      const uint64_t device_bytes = cuda::quant_device_bytes(host.view);
      DeviceBuffer weight_memory(device_bytes);
      const QuantWeight weight =
          ok_or_exit(cuda::upload_quant_weight(*backend, host.view, weight_memory.p, device_bytes), "upload");
      const cuda::QuantGpuLayout layout = cuda::quant_gpu_layout(host.view);
      const uint64_t weight_read = layout.tiles_bytes + layout.scales_bytes + layout.zeros_bytes;
      // the dense BF16 twin for cuBLAS, and e4m3 operands for cuBLASLt
      DeviceBuffer dense(uint64_t(n * k) * 2), x_device(uint64_t(max_rows * k) * 2), out_device(uint64_t(max_rows * n) * 2);
      fill_bf16_kernel<<<1024, 256, 0, stream>>>(dense.as<__nv_bfloat16>(), n * k, 17);
      // activations: random bf16 on the host (kept for validation), uploaded
      std::vector<uint16_t> x_bits(size_t(max_rows * k));
      std::vector<float> x(x_bits.size());
      std::mt19937 rng(uint32_t(n + k));
      std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
      for (size_t i = 0; i < x.size(); i++) {
        x_bits[i] = float_to_bf16(uniform(rng));
        x[i] = bf16_to_float(x_bits[i]);
      }
      BENCH_CUDA(cudaMemcpyAsync(x_device.p, x_bits.data(), x_bits.size() * 2, cudaMemcpyHostToDevice, stream));
      BENCH_CUDA(cudaStreamSynchronize(stream));
      for (int64_t m : rows_list) {
        const Tensor xt = Tensor::matrix(x_device.p, DType::BF16, m, k);
        const Tensor ot = Tensor::matrix(out_device.p, DType::BF16, m, n);
        const cuda::QuantKernel chosen = cuda::choose_quant_kernel(layout, DType::BF16, device.sm, m,
                                                                   cuda::QuantKernel::automatic);
        // validate
        BENCH_CUDA(cudaMemsetAsync(out_device.p, 0xff, uint64_t(m * n) * 2, stream));  // NaN
        ok_or_exit(backend->quant_linear(xt, weight, ot), "quant_linear");
        std::vector<uint16_t> out(size_t(m * n));
        ok_or_exit(backend->copy_to_host(Tensor::matrix(out_device.p, DType::U16, 1, m * n), out.data()), "copy");
        std::string worst;
        const bool ok = validate(host.view, x, m, out, chosen == cuda::QuantKernel::mma_w8a8, &worst);
        all_ok = all_ok && ok;
        // time
        const double us = time_us(stream, [&] { ok_or_exit(backend->quant_linear(xt, weight, ot), "quant_linear"); });
        const float alpha = 1.0f, beta = 0.0f;
        const double cublas_us = time_us(stream, [&] {
          BENCH_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &alpha, dense.p,
                                    CUDA_R_16BF, int(k), x_device.p, CUDA_R_16BF, int(k), &beta, out_device.p,
                                    CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        });
        const double bytes = double(weight_read) + double(m * k * 2) + double(m * n * 2);
        const double gbs = bytes / (us * 1e3);
        std::string others = ok ? "ok" : "FAIL " + worst;
        // the paths not chosen (fp8: at every M, W8A8 against W8A16; decode rows: the GEMV against the mma
        // kernel), and cuBLASLt FP8
        if (m >= 512 || fp8 || m <= cuda::kQuantGemvMmaMaxRows) {
          for (cuda::QuantKernel other : {cuda::QuantKernel::gemv_mma, cuda::QuantKernel::gemv_a16,
                                          cuda::QuantKernel::mma_a16, cuda::QuantKernel::mma_w8a8,
                                          cuda::QuantKernel::dequant_cublas}) {
            if (other == cuda::QuantKernel::gemv_a16 && m > cuda::kQuantGemvMaxRows) continue;
            if (other == cuda::QuantKernel::gemv_mma && m > cuda::kQuantGemvMmaMaxRows) continue;
            if (other == chosen || !cuda::quant_kernel_refusal(layout, other, DType::BF16, device.sm).empty()) continue;
            ok_or_exit(cuda::set_quant_kernel(*backend, other), "set_quant_kernel");
            // validated as the chosen kernel is, then timed
            BENCH_CUDA(cudaMemsetAsync(out_device.p, 0xff, uint64_t(m * n) * 2, stream));  // NaN
            ok_or_exit(backend->quant_linear(xt, weight, ot), "quant_linear");
            ok_or_exit(backend->copy_to_host(Tensor::matrix(out_device.p, DType::U16, 1, m * n), out.data()), "copy");
            std::string other_worst;
            const bool other_ok =
                validate(host.view, x, m, out, other == cuda::QuantKernel::mma_w8a8, &other_worst);
            all_ok = all_ok && other_ok;
            const double other_us =
                time_us(stream, [&] { ok_or_exit(backend->quant_linear(xt, weight, ot), "quant_linear"); });
            char text[160];
            std::snprintf(text, sizeof text, "; %s %.1f us%s", cuda::quant_kernel_name(other), other_us,
                          other_ok ? "" : (" FAIL " + other_worst).c_str());
            others += text;
          }
          ok_or_exit(cuda::set_quant_kernel(*backend, cuda::QuantKernel::automatic), "set_quant_kernel");
          if (fp8 && fp8_cores && m >= 512) {
            DeviceBuffer lt_workspace(kCudaCublasWorkspaceBytes), w8(uint64_t(n * k)), x8(uint64_t(m * k));
            fill_fp8_kernel<<<1024, 256, 0, stream>>>(w8.as<uint8_t>(), n * k, 5);
            fill_fp8_kernel<<<1024, 256, 0, stream>>>(x8.as<uint8_t>(), m * k, 6);
            LtFp8 lt(m, n, k, scale_one.as<float>(), kCudaCublasWorkspaceBytes);
            if (lt.ready) {
              const double lt_us = time_us(stream, [&] {
                lt.run(w8.p, x8.p, out_device.p, lt_workspace.p, kCudaCublasWorkspaceBytes, stream);
              });
              char text[96];
              std::snprintf(text, sizeof text, "; cuBLASLt fp8 %.1f us (kvlite at %.0f%%)", lt_us, 100.0 * lt_us / us);
              others += text;
            } else {
              others += "; cuBLASLt fp8: no algorithm";
            }
          }
        }
        std::printf("%-6s %-8s %7lld %6lld %-5s %5lld %-15s %9.1f %7.0f %6.1f %10.1f %6.2f %s\n", shape.model,
                    shape.layer, (long long)n, (long long)k, format, (long long)m, cuda::quant_kernel_name(chosen), us,
                    gbs, 100.0 * gbs / copy_gbs, cublas_us, cublas_us / us, others.c_str());
        std::fflush(stdout);
      }
    }
  }
  cublasDestroy(cublas);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - bench_start).count();
  std::printf("%s in %.0f s\n", all_ok ? "all outputs validated" : "VALIDATION FAILED", seconds);
  return all_ok ? 0 : 1;
}
