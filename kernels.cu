// kernels.cu - kvlite's CUDA backend: the one CUDA file an app compiles next to kvlite.hpp.
//
// What is here, in order:
//   1. errors: every CUDA / cuBLAS call's status checked and turned into a kvlite::Error naming the call;
//      every launch checked with cudaGetLastError. Nothing here aborts or exits.
//   2. device helpers: one small function per instruction or idiom, each with why it is used.
//   3. kernels, one per Backend op (their CPU twins are in backend_cpu.inl; tests/unit-cuda-ops.cpp compares
//      the two on every op), each kernel's body a sequence of named phases.
//   4. CudaBackend: the host side (dtype dispatch, launch geometry, cuBLAS), then the entry points declared
//      in device.hpp and backend_cuda.hpp.
// Index math shared with the host (sequence_of_row, online_softmax_step, split_key_range, ...) is in
// backend_cuda.hpp as __host__ __device__ functions, unit-tested on the CPU.
//
// Targets: sm_80, sm_86, sm_87 (Jetson Orin), sm_89, sm_90, sm_120, plus PTX for newer GPUs. Nothing here
// needs more than sm_80 (the bf16 conversions); no sm_90a-only instruction is used.
//
// These are first versions, written for correctness: row kernels use scalar loads, and attention runs on
// the CUDA cores, one query row per block (prefill re-reads K/V per row through L2). Next, measured on a
// GPU: 16-byte vector loads, tensor-core (mma.sync) flash attention for prefill, fused QKV/gate-up, graphs.
#include "kvlite.hpp"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <dlfcn.h>

#include <atomic>
#include <thread>
#include <cfloat>
#include <string>
#include <unordered_map>

namespace kvlite {
namespace cuda {
namespace {

// ==== 1. errors ============================================================================================

// Turns a failed CUDA call into an Error that names the call and the driver's words.
Error cuda_error(cudaError_t status, const char* call) {
  return Error(ErrorCode::device_error,
               detail::format("%s failed: %s (%s)", call, cudaGetErrorString(status), cudaGetErrorName(status)));
}
#define KVLITE_CUDA_TRY(call)                                                    \
  do {                                                                           \
    cudaError_t kvlite_status_ = (call);                                         \
    if (kvlite_status_ != cudaSuccess) return cuda_error(kvlite_status_, #call); \
  } while (0)

// The throwing forms, for code under detail::guard (the backend's ops).
void check_cuda(cudaError_t status, const char* call) {
  if (status != cudaSuccess) throw cuda_error(status, call);
}
#define KVLITE_CUDA_CHECK(call) check_cuda((call), #call)

// cuBLAS, opened the first time a CUDA backend is made, never linked. Linked, it (with cuBLASLt, which it
// loads) costs every process ~200 MB of resident memory at start (measured: `kvlite --version` peaked at 210 MB
// in a CUDA build linking it; 8.4 MB opening it here, 8.1 MB in a CPU build); an app that only plans, or runs
// the CPU engine, must not pay that. Its handful of functions are called through this table, each by its exported name.
#define KVLITE_STRINGIFY_(x) #x
#define KVLITE_STRINGIFY(x) KVLITE_STRINGIFY_(x)  // the name after macro expansion (cublasCreate_v2)
struct CublasLibrary {
  std::string error;  // why it could not be opened; empty when it was
  decltype(&::cublasCreate) create = nullptr;
  decltype(&::cublasDestroy) destroy = nullptr;
  decltype(&::cublasSetStream) set_stream = nullptr;
  decltype(&::cublasSetWorkspace) set_workspace = nullptr;
  decltype(&::cublasSetMathMode) set_math_mode = nullptr;
  // The exported cublasGemmEx (cublas_api.h adds a C++ inline overload taking a cudaDataType compute type).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  decltype(&::cublasGetStatusString) status_string = nullptr;
  decltype(&::cublasGetStatusName) status_name = nullptr;

  static CublasLibrary open() {
    CublasLibrary library;
    // The versioned name the toolkit we were compiled with installs; the loader's search path first, then the
    // toolkit's own directory (not always registered with ldconfig), then CUDA's usual prefix.
    const std::string name = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    std::vector<std::string> candidates = {name};
#ifdef KVLITE_CUDA_LIBRARY_DIR
    candidates.push_back(std::string(KVLITE_CUDA_LIBRARY_DIR) + "/" + name);
#endif
    candidates.push_back("/usr/local/cuda/lib64/" + name);
    void* handle = nullptr;
    std::string tried;
    for (const std::string& candidate : candidates) {
      handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      const char* why = dlerror();
      tried += "\n  " + candidate + ": " + (why ? why : "not found");
    }
    if (handle == nullptr) {
      library.error = "cuBLAS " + std::to_string(CUBLAS_VER_MAJOR) + " (" + name +
                      ") could not be loaded; install the CUDA toolkit's cuBLAS or add its directory to "
                      "LD_LIBRARY_PATH. Tried:" + tried;
      return library;
    }
    // Kept open for the life of the process: backends may come and go, and unloading cuBLAS is not safe
    // while the CUDA context it registered with lives.
    auto bind = [&](auto& function, const char* symbol) {
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(handle, symbol));
      if (function == nullptr && library.error.empty())
        library.error = std::string("cuBLAS (") + name + ") has no " + symbol + "; it is older than the toolkit "
                        "kvlite was compiled with (" + std::to_string(CUBLAS_VER_MAJOR) + "." +
                        std::to_string(CUBLAS_VER_MINOR) + ")";
    };
    bind(library.create, KVLITE_STRINGIFY(cublasCreate));
    bind(library.destroy, KVLITE_STRINGIFY(cublasDestroy));
    bind(library.set_stream, KVLITE_STRINGIFY(cublasSetStream));
    bind(library.set_workspace, KVLITE_STRINGIFY(cublasSetWorkspace));
    bind(library.set_math_mode, KVLITE_STRINGIFY(cublasSetMathMode));
    bind(library.gemm_ex, KVLITE_STRINGIFY(cublasGemmEx));
    bind(library.status_string, KVLITE_STRINGIFY(cublasGetStatusString));
    bind(library.status_name, KVLITE_STRINGIFY(cublasGetStatusName));
    return library;
  }
};

// Opened once per process, on first use (thread-safe: a function-local static).
const CublasLibrary& cublas() {
  static const CublasLibrary library = CublasLibrary::open();
  return library;
}

void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    detail::fail(ErrorCode::device_error, detail::format("%s failed: %s (%s)", call, cublas().status_string(status),
                                                         cublas().status_name(status)));
}
#define KVLITE_CUBLAS_CHECK(call) check_cublas((call), #call)
// A launch reports a bad configuration (grid too large, too much shared memory) at once; faults while the
// kernel runs surface at the next synchronizing call.
// (status: the launch's own, where the call returns one, as cudaLaunchKernelEx does)
void check_launch(const char* kernel, cudaError_t status = cudaGetLastError()) {
  if (status != cudaSuccess)
    detail::fail(ErrorCode::device_error, detail::format("launching %s failed: %s (%s)", kernel,
                                                         cudaGetErrorString(status), cudaGetErrorName(status)));
}

// cudaLaunchKernelEx and the programmatic stream serialization attribute: CUDA 12.0 and newer (older toolkits
// build kvlite with CudaBackendOptions::programmatic_launch ignored).
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12000
#define KVLITE_PROGRAMMATIC_LAUNCH_BUILT 1
#else
#define KVLITE_PROGRAMMATIC_LAUNCH_BUILT 0
#endif

// Every device allocation kvlite makes goes through here, so tests can count them (the arena is the one).
std::atomic<uint64_t> g_device_allocations{0};
cudaError_t counted_cuda_malloc(void** pointer, uint64_t bytes) {
  g_device_allocations.fetch_add(1);
  return cudaMalloc(pointer, bytes);
}

// ==== 2. device helpers ====================================================================================

// Programmatic dependent launch (CudaBackendOptions::programmatic_launch, sm_90+). A decode step is ~300
// kernels of a few microseconds each, and between two of them an ordinary stream leaves the GPU idle while the
// second one launches and its blocks ramp up. Launched with cudaLaunchAttributeProgrammaticStreamSerialization, a
// kernel may start as soon as every block of the kernel before it has executed launch_dependents, and its blocks
// sit resident until griddepcontrol.wait returns, which is when that kernel has completed and its writes are
// visible. So every kernel here starts with kernel_entry(): wait first (nothing read that a kernel wrote, nothing
// written that one reads, before it), then let the next kernel launch. Completion is transitive: kernel C waits
// for B's completion, and B completed only after its own wait returned, after A's -- so C sees every earlier
// kernel's writes, as with ordinary launches. Before the wait a kernel reads only what no kernel writes: the step's
// metadata that the host copies in (attention's query_starts and context_lens; every stream copy queued before a
// kernel has completed when it starts, since the kernel before it waited for all that came earlier); it writes
// nothing. Loading weights before the wait did not pay (the tensor-core GEMV's first batch, or its first bytes
// prefetched into L2, timed on an H200: bench/RESULTS.md, 2026-11-27 fifth session), so the GEMV too waits first.
// Launched without the attribute, or before sm_90 (where the instructions do not exist and compile to nothing),
// both are no-ops.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void kernel_entry() {
  wait_for_previous_kernel();
  let_next_kernel_launch();
}

// Storage <-> fp32. bf16 is the top half of an fp32, so widening is a shift (exact); narrowing is
// cvt.rn.bf16.f32 on sm_80+: round to nearest even in one instruction, as torch's .to(bfloat16) and
// base.hpp's float_to_bf16. fp16 narrowing is cvt.rn.f16.f32 (overflow to inf, as float_to_f16).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// An fp8 KV cache element: e4m3 bytes holding value / scale (base.hpp's conversions: saturating, nearest even;
// the same bits as the CPU backend's).
struct KvFp8 {
  uint8_t bits;
};
__device__ __forceinline__ float to_float(KvFp8 v) { return fp8_e4m3_to_float(v.bits); }
template <>
__device__ __forceinline__ KvFp8 from_float<KvFp8>(float v) { return KvFp8{float_to_fp8_e4m3(v)}; }

// ld.global.nc: the read-only data path. For K/V pages and weights, which no thread writes during the
// kernel, it lets loads bypass L1 coherence and be reordered freely.
template <class T>
__device__ __forceinline__ T load_readonly(const T* p) { return __ldg(p); }
template <>
__device__ __forceinline__ KvFp8 load_readonly<KvFp8>(const KvFp8* p) {
  return KvFp8{__ldg(reinterpret_cast<const unsigned char*>(p))};
}

// A quiet NaN: what an output becomes when its inputs were invalid (the fault record says why).
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// shfl.sync.bfly: a butterfly over the 32 lanes leaves the same total in every lane (each step adds the same
// two operands in both partners, and fp32 addition commutes), so warp-uniform branches can use it at once.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over a team of TEAM threads (a warp, or the whole block when TEAM > 32): warps first, then the warp
// totals through `shared` (32 floats). Every thread of the team returns the same value.
template <int TEAM>
__device__ __forceinline__ float team_sum(float v, float* shared) {
  v = warp_sum(v);
  if constexpr (TEAM > 32) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = warp_sum(lane < TEAM / 32 ? shared[lane] : 0.0f);
    __syncthreads();  // `shared` may be reused after this
  }
  return v;
}

// The fault record: the first invalid index value a kernel met (atom.cas keeps the first writer; the
// others see a non-zero kind and leave it). The host reads it at the next synchronizing call.
enum FaultKind : int {
  fault_none = 0,
  fault_gather_id,           // index: row t; value: ids[t]; limit: table rows
  fault_kv_slot,             // index: token t; value: slots[t]; limit: pages; extra: page
  fault_attention_row,       // index: query row; limit: query rows
  fault_attention_context,   // index: sequence; value: context_lens; limit: max_context; extra: queries
  fault_attention_page,      // index: sequence; value: page id; limit: pages; extra: block table column
  fault_embedding_index,     // index: row t; value: indices[t][j]; limit: table rows; extra: j
  fault_segment_row,         // index: row; limit: rows (segment_starts do not cover it)
  fault_segment_length,      // index: segment; value: its length; limit: max_segment
};
struct DeviceFault {
  int kind;  // FaultKind
  int unused;
  long long index, value, limit, extra;
};
static_assert(sizeof(DeviceFault) <= 256, "the workspace holds 256 bytes for the fault record");

__device__ void report_fault(DeviceFault* fault, int kind, long long index, long long value, long long limit,
                             long long extra) {
  if (atomicCAS(&fault->kind, int(fault_none), kind) == int(fault_none)) {
    fault->index = index;
    fault->value = value;
    fault->limit = limit;
    fault->extra = extra;
  }
}

// ==== 3. kernels ===========================================================================================
// Row kernels: grid.x = rows, grid.y = blocks along the row (row_grid: enough that each thread takes about one
// element), the threads of a row's blocks striding over its columns, so every view's row stride is honoured and
// any width works. (One block per row left decode's single row to one SM: silu_mul over Llama-3.1-8B's 14,336
// columns took 20 us of a 1 us job on an H100.)
__device__ __forceinline__ int64_t row_column_begin() { return int64_t(blockIdx.y) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t row_column_step() { return int64_t(gridDim.y) * blockDim.x; }

// out[t, :] = table[ids[t], :].
//   T: table element type; A: activation type.
template <class T, class A>
__global__ void gather_rows_kernel(const T* table,         // [table_rows, cols], row stride table_stride
                                   int64_t table_stride, int64_t table_rows,
                                   const int32_t* ids,     // [rows]
                                   A* out,                 // [rows, cols], row stride out_stride
                                   int64_t out_stride, int64_t cols, DeviceFault* fault) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const int64_t id = ids[row];
  A* dst = out + row * out_stride;
  if (id < 0 || id >= table_rows) {
    if (threadIdx.x == 0 && blockIdx.y == 0) report_fault(fault, fault_gather_id, row, id, table_rows, 0);
    for (int64_t c = row_column_begin(); c < cols; c += row_column_step()) dst[c] = from_float<A>(quiet_nan());
    return;
  }
  const T* src = table + id * table_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step())
    dst[c] = from_float<A>(to_float(load_readonly(src + c)));
}

// Elements of a row (or group) a norm thread keeps in registers: rows up to TEAM x kNormCached columns (4096 with a
// block of 256 threads, 512 with a warp) load everything first; wider ones take the loop.
constexpr int kNormCached = 16;

// The end of both norms' register path: the team's sum of squares -> 1 / rms (IEEE sqrt and division, as the CPU's
// 1 / std::sqrt), then dst[c] = w * (v * (1 / rms)) for the thread's elements c = member + TEAM i below n.
template <int TEAM, class A>
__device__ __forceinline__ void norm_cached_finish(float squares, float* team_partials, int64_t n, float eps, int member,
                                                   const float (&vs)[kNormCached], const float (&ws)[kNormCached],
                                                   A* dst) {
  const float variance = team_sum<TEAM>(squares, team_partials) / float(n);
  const float inv_rms = 1.0f / sqrtf(variance + eps);
#pragma unroll
  for (int i = 0; i < kNormCached; i++) {
    const int64_t c = member + int64_t(TEAM) * i;
    if (c < n) dst[c] = from_float<A>(ws[i] * (vs[i] * inv_rms));
  }
}

// RMSNorm of groups of `group` columns (LlamaRMSNorm in fp32): out = w * (x * rsqrt(mean(x^2) + eps)).
//   A: activation type; W: weight type;
//   TEAM: threads normalising one group: 32 (a warp; a block holds blockDim / 32 groups) or blockDim (one
//   group per block, for wide rows).
// Phases: sum of squares (team reduction) -> scale and store. out may be x: every element is read by the
// thread that later writes it, and all reads of phase 1 finish before the reduction returns.
template <class A, class W, int TEAM>
__global__ void rms_norm_kernel(const A* x, int64_t x_stride,  // [rows, groups_per_row * group]
                                const W* weight,               // [group]
                                int64_t group, int64_t groups_per_row, int64_t rows, float eps,
                                A* out, int64_t out_stride) {  // like x
  kernel_entry();
  __shared__ float team_partials[32];
  const int64_t team = int64_t(blockIdx.x) * (blockDim.x / TEAM) + threadIdx.x / TEAM;
  const int member = threadIdx.x % TEAM;
  if (team >= rows * groups_per_row) return;  // whole idle warps only (TEAM == 32), never inside a team
  const int64_t row = team / groups_per_row, first = (team % groups_per_row) * group;
  const A* in = x + row * x_stride + first;
  A* dst = out + row * out_stride + first;

  if (group <= int64_t(TEAM) * kNormCached) {  // uniform: the group's elements fit the team's registers
    // every load first (x and weight: nothing the thread stores can change them before it reads them), then the
    // same arithmetic in the same order as the loop below; see add_rms_norm_kernel for why
    float xs[kNormCached], ws[kNormCached];
#pragma unroll
    for (int i = 0; i < kNormCached; i++) {
      const int64_t c = member + int64_t(TEAM) * i;
      xs[i] = c < group ? to_float(in[c]) : 0.0f;
      ws[i] = c < group ? to_float(load_readonly(weight + c)) : 0.0f;
    }
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < kNormCached; i++)
      if (member + int64_t(TEAM) * i < group) squares += xs[i] * xs[i];
    norm_cached_finish<TEAM>(squares, team_partials, group, eps, member, xs, ws, dst);
    return;
  }

  // ---- phase 1: mean of squares
  float squares = 0.0f;
  for (int64_t c = member; c < group; c += TEAM) {
    const float v = to_float(in[c]);
    squares += v * v;
  }
  const float variance = team_sum<TEAM>(squares, team_partials) / float(group);
  const float inv_rms = 1.0f / sqrtf(variance + eps);  // IEEE sqrt and division, as the CPU's 1 / std::sqrt

  // ---- phase 2: scale and store
  for (int64_t c = member; c < group; c += TEAM)
    dst[c] = from_float<A>(to_float(load_readonly(weight + c)) * (to_float(in[c]) * inv_rms));
}

// residual += x; out = rms_norm(residual) over the whole row. The new residual is rounded to A when stored
// (as transformers' `hidden = residual + hidden` in the model dtype) and the norm reads what was stored.
//   A: activation type; W: weight type; TEAM: as rms_norm_kernel (one row per team).
template <class A, class W, int TEAM>
__global__ void add_rms_norm_kernel(const A* x, int64_t x_stride,  // [rows, cols]
                                    A* residual, int64_t residual_stride,  // [rows, cols], updated
                                    const W* weight,               // [cols]
                                    int64_t rows, int64_t cols, float eps, A* out, int64_t out_stride) {
  kernel_entry();
  __shared__ float team_partials[32];
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / TEAM) + threadIdx.x / TEAM;
  const int member = threadIdx.x % TEAM;
  if (row >= rows) return;
  const A* in = x + row * x_stride;
  A* res = residual + row * residual_stride;
  A* dst = out + row * out_stride;

  if (cols <= int64_t(TEAM) * kNormCached) {  // uniform: the row fits the team's registers (decode rows, always)
    // The loop below reads, stores, reads: the compiler cannot move a load above a store through pointers that may
    // alias (x is out, in place), so each of its iterations waited out a memory round trip: 15 us a call for one
    // 4096-column row under ncu with its caches flushed, 18% of a Llama-3.1-8B W4A16 decode step; 4 us this way with
    // the caches as found (H200, 2026-11-27, bench/RESULTS.md). Here every load of the
    // thread's elements is issued first (each element is read and written by one thread only, so the order per
    // element is unchanged), then the same arithmetic in the same order: the same bits.
    float xs[kNormCached], rs[kNormCached], ws[kNormCached];
#pragma unroll
    for (int i = 0; i < kNormCached; i++) {
      const int64_t c = member + int64_t(TEAM) * i;
      rs[i] = c < cols ? to_float(res[c]) : 0.0f;
      xs[i] = c < cols ? to_float(in[c]) : 0.0f;
      ws[i] = c < cols ? to_float(load_readonly(weight + c)) : 0.0f;
    }
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < kNormCached; i++) {
      const int64_t c = member + int64_t(TEAM) * i;
      if (c >= cols) continue;
      const A sum = from_float<A>(rs[i] + xs[i]);
      res[c] = sum;
      rs[i] = to_float(sum);  // what was stored, as the loop's second read of res[c]
      squares += rs[i] * rs[i];
    }
    norm_cached_finish<TEAM>(squares, team_partials, cols, eps, member, rs, ws, dst);
    return;
  }

  // ---- phase 1: residual += x, and the sum of squares of what was stored
  float squares = 0.0f;
  for (int64_t c = member; c < cols; c += TEAM) {
    const A sum = from_float<A>(to_float(res[c]) + to_float(in[c]));
    res[c] = sum;
    const float v = to_float(sum);
    squares += v * v;
  }
  const float variance = team_sum<TEAM>(squares, team_partials) / float(cols);
  const float inv_rms = 1.0f / sqrtf(variance + eps);

  // ---- phase 2: scale and store (each thread re-reads the residual elements it wrote)
  for (int64_t c = member; c < cols; c += TEAM)
    dst[c] = from_float<A>(to_float(load_readonly(weight + c)) * (to_float(res[c]) * inv_rms));
}

// One rotary pair of a head in place, rotate_half convention: h[i], h[i + half] turned by the angle of (c, s),
// each rounded once to A; the rounded values also come back. rope_kernel and rope_kv_write_kernel share it, so the
// fused kernel stores the bits the two ops store.
template <class A>
__device__ __forceinline__ void rope_pair(A* h, int64_t i, int64_t half, float c, float s, A* low, A* high) {
  const float a = to_float(h[i]), b = to_float(h[i + half]);
  *low = from_float<A>(a * c - b * s);
  *high = from_float<A>(b * c + a * s);
  h[i] = *low;
  h[i + half] = *high;
}

// An activation as the KV cache stores it: value / the layer's scale, rounded to E (kv_write_kernel's store).
template <class A, class E>
__device__ __forceinline__ E kv_element(A value, float scale) { return from_float<E>(to_float(value) / scale); }

// Rotary embedding in place, rotate_half convention: x[i], x[i + half] of every head turned by the angle
// whose cos/sin are in row t of the tables. Dimensions from 2 * half to head_dim are left alone.
//   A: activation type.
template <class A>
__global__ void rope_kernel(A* x, int64_t x_stride,  // [rows, heads * head_dim]
                            int64_t heads, int64_t head_dim,
                            const float* cos, int64_t cos_stride,  // [rows, half]
                            const float* sin, int64_t sin_stride,  // [rows, half]
                            int64_t half) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  A* v = x + row * x_stride;
  const float* c = cos + row * cos_stride;
  const float* s = sin + row * sin_stride;
  for (int64_t pair = row_column_begin(); pair < heads * half; pair += row_column_step()) {
    const int64_t head = pair / half, i = pair % half;
    A low, high;
    rope_pair(v + head * head_dim, i, half, c[i], s[i], &low, &high);
  }
}

// out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). out may be gate or up (same element, same thread).
//   A: activation type.
template <class A>
__global__ void silu_mul_kernel(const A* gate, int64_t gate_stride, const A* up, int64_t up_stride,  // [rows, cols]
                                A* out, int64_t out_stride, int64_t cols) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const A* g = gate + row * gate_stride;
  const A* u = up + row * up_stride;
  A* dst = out + row * out_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step()) {
    const float gv = to_float(g[c]);
    dst[c] = from_float<A>(gv / (1.0f + expf(-gv)) * to_float(u[c]));
  }
}

// out = gelu(gate) * up (GeGLU), the gelu rounded to A before the product as PyTorch stores act_fn(gate).
// out may be gate or up. A: activation type; TANH: gelu_pytorch_tanh, else the exact (erf) form.
template <class A, bool TANH>
__global__ void gelu_mul_kernel(const A* gate, int64_t gate_stride, const A* up, int64_t up_stride,  // [rows, cols]
                                A* out, int64_t out_stride, int64_t cols) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const A* g = gate + row * gate_stride;
  const A* u = up + row * up_stride;
  A* dst = out + row * out_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step()) {
    const float v = to_float(g[c]);
    float activated;
    if (TANH) {
      const float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2 / pi)
      activated = 0.5f * v * (1.0f + tanhf(beta * (v + kappa * v * v * v)));
    } else {
      activated = v * 0.5f * (1.0f + erff(v * 0.7071067811865476f));
    }
    dst[c] = from_float<A>(to_float(from_float<A>(activated)) * to_float(u[c]));
  }
}

// out = x * factor (Gemma's embedding normalizer), or cap * tanh(x / cap) when CAP (the final logit soft-cap,
// each step rounded to A as PyTorch stores it). out may be x. A: activation type.
template <class A, bool CAP>
__global__ void scale_kernel(const A* x, int64_t x_stride, A* out, int64_t out_stride, int64_t cols, float factor) {
  kernel_entry();
  const A* in = x + int64_t(blockIdx.x) * x_stride;
  A* dst = out + int64_t(blockIdx.x) * out_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step()) {
    const float v = to_float(in[c]);
    if (CAP) {
      const float divided = to_float(from_float<A>(v / factor));
      const float squashed = to_float(from_float<A>(tanhf(divided)));
      dst[c] = from_float<A>(squashed * factor);
    } else {
      dst[c] = from_float<A>(v * factor);
    }
  }
}

// out = a + b. out may be a or b.
//   A: activation type.
template <class A>
__global__ void add_kernel(const A* a, int64_t a_stride, const A* b, int64_t b_stride,  // [rows, cols]
                           A* out, int64_t out_stride, int64_t cols) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const A* pa = a + row * a_stride;
  const A* pb = b + row * b_stride;
  A* dst = out + row * out_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step())
    dst[c] = from_float<A>(to_float(pa[c]) + to_float(pb[c]));
}

// dst = src converted (round to nearest even).
//   S: source type; D: destination type.
template <class S, class D>
__global__ void copy_kernel(const S* src, int64_t src_stride, D* dst, int64_t dst_stride, int64_t cols) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const S* from = src + row * src_stride;
  D* to = dst + row * dst_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step()) to[c] = from_float<D>(to_float(from[c]));
}

// Every row of out = bias (or 0 when bias is null): the C that linear's GEMM then adds x @ w^T to (beta 1).
//   B: bias type; A: activation type.
template <class B, class A>
__global__ void fill_rows_kernel(const B* bias,  // [cols] or null
                                 A* out, int64_t out_stride, int64_t cols) {
  kernel_entry();
  A* dst = out + int64_t(blockIdx.x) * out_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step())
    dst[c] = from_float<A>(bias != nullptr ? to_float(load_readonly(bias + c)) : 0.0f);
}

// Stores token t's K and V rows at slot slots[t] of layer `layer` (page slot / page_tokens, position
// slot % page_tokens); a negative slot skips the token. Each value is divided by its layer's scale first (1 but
// for fp8 caches: x / 1 is x exactly, so the other element types store what they always did).
//   A: activation type; E: KV element type.
template <class A, class E>
__global__ void kv_write_kernel(const A* k, int64_t k_stride, const A* v, int64_t v_stride,  // [rows, width]
                                const int32_t* slots,  // [rows]
                                E* pages, KVPageLayout layout, int64_t layer, int64_t num_pages, int64_t width,
                                float k_scale, float v_scale, DeviceFault* fault) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const int64_t slot = slots[row];
  if (slot < 0) return;
  const int64_t page = slot / layout.page_tokens, position = slot % layout.page_tokens;
  if (page >= num_pages) {
    if (threadIdx.x == 0 && blockIdx.y == 0) report_fault(fault, fault_kv_slot, row, slot, num_pages, page);
    return;
  }
  // kv_heads consecutive heads of head_dim: one run of `width` elements for K, one for V
  E* k_dst = pages + layout.offset(page, layer, 0, position, 0);
  E* v_dst = pages + layout.offset(page, layer, 1, position, 0);
  const A* k_src = k + row * k_stride;
  const A* v_src = v + row * v_stride;
  for (int64_t c = row_column_begin(); c < width; c += row_column_step()) {
    k_dst[c] = kv_element<A, E>(k_src[c], k_scale);
    v_dst[c] = kv_element<A, E>(v_src[c], v_scale);
  }
}

// rope_kernel then kv_write_kernel for one token row (Backend::rope_kv_write), in one pass: every pair of qk's heads
// rotated in place as rope_kernel does, and a pair of a key head (qk's last `width` columns) stored into the cache
// as it is made, as kv_write_kernel would store it after the rope; then the values and the keys' dimensions the rope
// leaves alone (partial rotary: 2 half .. head_dim - 1 of each key head). Saves a launch and a read of the keys a
// decode layer (2.1 + 2.4 us apart on an H200, bench/RESULTS.md 2026-11-27).
//   row items: [0, heads x half) the pairs | width values | kv_heads x (head_dim - 2 half) unrotated key dims
//   A: activation type; E: KV element type.
template <class A, class E>
__global__ void rope_kv_write_kernel(A* qk, int64_t qk_stride,  // [rows, heads * head_dim]
                                     int64_t heads, int64_t head_dim,
                                     const float* cos, int64_t cos_stride,  // [rows, half]
                                     const float* sin, int64_t sin_stride,  // [rows, half]
                                     int64_t half, const A* v, int64_t v_stride,  // [rows, width]
                                     const int32_t* slots,  // [rows]
                                     E* pages, KVPageLayout layout, int64_t layer, int64_t num_pages, int64_t width,
                                     float k_scale, float v_scale, DeviceFault* fault) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const int64_t slot = slots[row];
  const int64_t page = slot >= 0 ? slot / layout.page_tokens : 0, position = slot >= 0 ? slot % layout.page_tokens : 0;
  if (slot >= 0 && page >= num_pages && threadIdx.x == 0 && blockIdx.y == 0)
    report_fault(fault, fault_kv_slot, row, slot, num_pages, page);
  const bool store = slot >= 0 && page < num_pages;  // a negative slot (padding) or a fault: the rope alone
  E* k_dst = store ? pages + layout.offset(page, layer, 0, position, 0) : nullptr;
  E* v_dst = store ? pages + layout.offset(page, layer, 1, position, 0) : nullptr;
  A* x = qk + row * qk_stride;
  const float* c = cos + row * cos_stride;
  const float* s = sin + row * sin_stride;
  const int64_t first_key = heads * head_dim - width;  // qk's column of the first key
  const int64_t pairs = heads * half, tail = head_dim - 2 * half;
  const int64_t items = pairs + (store ? width + (width / head_dim) * tail : 0);
  for (int64_t item = row_column_begin(); item < items; item += row_column_step()) {
    if (item < pairs) {
      const int64_t head = item / half, i = item % half;
      A low, high;
      rope_pair(x + head * head_dim, i, half, c[i], s[i], &low, &high);
      const int64_t key_column = head * head_dim + i - first_key;
      if (store && key_column >= 0) {
        k_dst[key_column] = kv_element<A, E>(low, k_scale);
        k_dst[key_column + half] = kv_element<A, E>(high, k_scale);
      }
    } else if (item < pairs + width) {
      const int64_t column = item - pairs;
      v_dst[column] = kv_element<A, E>(v[row * v_stride + column], v_scale);
    } else {
      const int64_t t = item - pairs - width;
      const int64_t key_column = (t / tail) * head_dim + 2 * half + t % tail;
      k_dst[key_column] = kv_element<A, E>(x[first_key + key_column], k_scale);
    }
  }
}

// ---- paged attention -------------------------------------------------------------------------------------
// The first cache index a query whose last is `last` sees: 0, or the start of its sliding window.
KVLITE_HD int64_t attention_first_key(int64_t window, int64_t last) {
  return window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
}

// One block per (query row, KV head, head pass, split):
//
//   grid.x = query rows       grid.y = KV heads x head passes       grid.z = splits of the context
//   block  = WARPS warps (4 or 8); warp w takes keys begin + w, begin + w + WARPS, ... of its split's chunk, kKeys at a time
//   lanes  = head dimensions: lane l holds dims l, l + 32, ... (DIMS of them) of q, K, V and the output
//
//   context of one query:  | chunk 0 (split 0) | chunk 1 (split 1) | ... | last |  (causal: keys first .. last,
//                                                                               first > 0 in a sliding window)
//
// The block serves HEADS query heads that share one KV head (GQA), so every K/V row it loads is used HEADS
// times. Each warp keeps an online softmax per head; the block merges its warps in shared memory; with one
// split it writes the output, with several it writes a partial (max, sum, unnormalised acc) and
// attention_combine_kernel merges the splits. Decode (one query, long context) gets its parallelism from
// the splits; prefill chunks from their rows.
// Warps of the segment (vision) attention block, and of the paged one, whose count is chosen per launch
// (paged_attention_warps): 8 while the grid fits the GPU in one wave of one block an SM, so that a decode split of
// 16-24 keys (kAttentionMinChunk) gives each warp 2-3 of them in one batch of loads instead of walking 4-6 in
// dependent rounds (17 -> 10.6 us a layer for a 150-key Llama-3.1-8B context at batch 1, ncu, H200); 4 past that,
// where the 8-warp blocks (172 registers: one an SM) left the SMs half as many blocks: on an H200 (bench/RESULTS.md,
// 2026-11-27 third session) 4 warps decoded batch 8 10-12% faster than 8 (Llama-3.1-8B W4A16 1,736 -> 1,909 tok/s,
// Qwen3-VL-4B FP8 1,667 -> 1,867) and batch 1 2.6-3% slower.
constexpr int kAttentionWarps = 4;
// Keys a paged-attention warp loads before using any (their page ids, then their K and V rows, all in flight at
// once): 4 while the K/V registers (2 x kKeys x DIMS floats) stay at 32, else 2.
KVLITE_HD constexpr int attention_keys_in_flight(int dims_per_lane) { return dims_per_lane <= 4 ? 4 : 2; }

struct AttentionArgs {
  const void* q;  // [rows, heads * head_dim], activation type
  int64_t q_stride;
  void* out;  // [rows, heads * head_dim], activation type
  int64_t out_stride;
  const void* pages;  // KV pages, KV element type
  KVPageLayout layout;
  int64_t layer, num_pages;
  const int32_t* query_starts;  // [seqs + 1]
  const int32_t* context_lens;  // [seqs]
  const int32_t* block_tables;  // [seqs, block_table_stride]
  int64_t block_table_stride;
  int64_t seqs, rows, max_context;
  int64_t heads, group, head_passes;  // query heads; query heads per KV head; blocks per KV head
  float scale;
  float k_scale, v_scale;  // the layer's KV cache scales: stored x scale is what was written (1 but for fp8)
  int64_t window;       // > 0: a query at cache index i sees keys i - window + 1 .. i (AttentionOptions)
  float logit_softcap;  // > 0: scores = cap * tanh(scores / cap)
  int64_t splits;  // the grid's splits (AttentionSplit); each query uses attention_splits_used of them
  float* partial_acc;  // [rows, heads, splits, head_dim] unnormalised sums of p * v (splits > 1)
  float* partial_max;  // [rows, heads, splits]
  float* partial_sum;  // [rows, heads, splits]
  DeviceFault* fault;
};

//   A: activation type (q, out); E: KV element type;
//   DIMS: head dimensions per lane (head_dim <= 32 * DIMS; attention_dims_per_lane);
//   HEADS: query heads per block (attention_heads_per_block(DIMS)); a group larger than that takes
//   several head passes (grid.y).
//   WARPS: the block's warps (paged_attention_warps).
template <class A, class E, int DIMS, int HEADS, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) paged_attention_kernel(const AttentionArgs args) {
  constexpr int kPadded = DIMS * 32;  // head_dim rounded up to whole lanes
  constexpr int kWarps = WARPS, kKeys = attention_keys_in_flight(DIMS);
  __shared__ float warp_max[kWarps][HEADS];
  __shared__ float warp_total[kWarps][HEADS];
  __shared__ float warp_acc[kWarps][HEADS][kPadded];

  const int64_t row = blockIdx.x, split = blockIdx.z;
  const int64_t kv_head = blockIdx.y / args.head_passes;
  const int64_t first_head = kv_head * args.group + (blockIdx.y % args.head_passes) * HEADS;
  const int64_t group_left = (kv_head + 1) * args.group - first_head;  // heads of this KV head from first_head on
  const int heads_here = group_left < HEADS ? int(group_left) : HEADS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t head_dim = args.layout.head_dim, page_tokens = args.layout.page_tokens;

  // ---- phase 1: locate the query: its sequence and the last cache index it sees (-1: none, malformed).
  // Before kernel_entry's wait: query_starts and context_lens reach the device by stream copies from the host
  // (copy_from_host), never from a kernel, and every copy queued before this kernel has completed when it starts,
  // even early under programmatic launch (the kernel before it waited for everything before that), so these
  // dependent lookups overlap the kernel before (rope_kv_write). A fault found here, a write, is reported after.
  const bool reporter = threadIdx.x == 0 && blockIdx.y == 0 && split == 0;
  const int64_t seq = sequence_of_row(args.query_starts, args.seqs, row);
  int64_t last = -1, context = 0, queries = 0;
  if (seq >= 0) {
    const int64_t first_row = args.query_starts[seq];
    queries = args.query_starts[seq + 1] - first_row;
    context = args.context_lens[seq];
    if (context >= queries && context <= args.max_context) last = context - queries + (row - first_row);
  }
  kernel_entry();
  if (reporter && seq < 0) report_fault(args.fault, fault_attention_row, row, 0, args.rows, 0);
  if (reporter && seq >= 0 && last < 0)
    report_fault(args.fault, fault_attention_context, seq, context, args.max_context, queries);

  // ---- phase 2: this block's query heads into registers
  const A* q_row = static_cast<const A*>(args.q) + row * args.q_stride;
  float q[HEADS][DIMS];
#pragma unroll
  for (int h = 0; h < HEADS; h++)
#pragma unroll
    for (int i = 0; i < DIMS; i++) {
      const int64_t d = lane + 32 * i;
      q[h][i] = (h < heads_here && d < head_dim) ? to_float(q_row[(first_head + h) * head_dim + d]) : 0.0f;
    }

  // ---- phase 3: the split's keys, each warp every kWarps-th, online softmax per head
  float running_max[HEADS], running_sum[HEADS], acc[HEADS][DIMS];
#pragma unroll
  for (int h = 0; h < HEADS; h++) {
    running_max[h] = -INFINITY;
    running_sum[h] = 0.0f;
#pragma unroll
    for (int i = 0; i < DIMS; i++) acc[h][i] = 0.0f;
  }
  // this query's own split of its keys (the grid's splits past the ones it uses have nothing to do)
  // (the splits cut the visible keys first .. last: a sliding window's earlier keys take no split)
  const int64_t first_key = attention_first_key(args.window, last), visible = last - first_key + 1;
  const int64_t used_splits = attention_splits_used(args.splits, visible);
  if (split >= used_splits) return;  // uniform across the block, before any barrier
  int64_t key_begin, key_end;
  split_key_range(split, attention_chunk(args.splits, visible), visible - 1, &key_begin, &key_end);
  key_begin += first_key;
  key_end += first_key;
  const int32_t* seq_pages = args.block_tables + (seq < 0 ? 0 : seq) * args.block_table_stride;
  const E* cache = static_cast<const E*>(args.pages);
  // Keys in batches (key, key + kWarps, ... : kKeys of them): the page ids of the batch, then all of its K/V rows,
  // are loaded before any is used, so a warp waits out two memory round trips a batch rather than two a key; the
  // math still takes the keys in order. Key positions and page columns in 32 bits: the context is below 2^31
  // (checked at launch), and a 64-bit division by page_tokens is a long software routine on the GPU.
  const uint32_t page_tokens32 = uint32_t(page_tokens);
  for (int64_t key0 = key_begin + warp; key0 < key_end; key0 += kKeys * kWarps) {
    float k[kKeys][DIMS], v[kKeys][DIMS];
    bool valid[kKeys];
    int64_t page[kKeys];
    uint32_t column[kKeys], position[kKeys];
#pragma unroll
    for (int u = 0; u < kKeys; u++) {  // the same for the whole warp
      const int64_t key = key0 + int64_t(u) * kWarps;
      valid[u] = key < key_end;
      column[u] = valid[u] ? uint32_t(key) / page_tokens32 : 0u;
      position[u] = uint32_t(key) - column[u] * page_tokens32;
      page[u] = valid[u] ? int64_t(seq_pages[column[u]]) : 0;
    }
#pragma unroll
    for (int u = 0; u < kKeys; u++) {
      if (!valid[u]) continue;  // the same for the whole warp
      if (page[u] < 0 || page[u] >= args.num_pages) {  // the same for the whole warp: a uniform branch
        if (lane == 0) report_fault(args.fault, fault_attention_page, seq, page[u], args.num_pages, column[u]);
#pragma unroll
        for (int h = 0; h < HEADS; h++) running_sum[h] = quiet_nan();  // poisons this query's output
        valid[u] = false;
        continue;
      }
      const E* k_row = cache + args.layout.offset(page[u], args.layer, 0, position[u], kv_head);
      const E* v_row = cache + args.layout.offset(page[u], args.layer, 1, position[u], kv_head);
#pragma unroll
      for (int i = 0; i < DIMS; i++) {
        const int64_t d = lane + 32 * i;
        k[u][i] = d < head_dim ? to_float(load_readonly(k_row + d)) * args.k_scale : 0.0f;
        v[u][i] = d < head_dim ? to_float(load_readonly(v_row + d)) * args.v_scale : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kKeys; u++) {
      if (!valid[u]) continue;  // uniform across the warp
#pragma unroll
      for (int h = 0; h < HEADS; h++) {
        if (h >= heads_here) break;  // uniform across the block
        float partial = 0.0f;
#pragma unroll
        for (int i = 0; i < DIMS; i++) partial += q[h][i] * k[u][i];
        float score = warp_sum(partial) * args.scale;  // (q @ k^T) * scaling, the same in every lane
        // gemma2: attn_weights / softcap; tanh; * softcap (as the CPU)
        if (args.logit_softcap > 0.0f) score = tanhf(score / args.logit_softcap) * args.logit_softcap;
        const SoftmaxStep step = online_softmax_step(score, running_max[h], running_sum[h]);
#pragma unroll
        for (int i = 0; i < DIMS; i++) acc[h][i] = acc[h][i] * step.rescale + step.weight * v[u][i];
      }
    }
  }

  // ---- phase 4: merge the warps' softmax partials in shared memory
#pragma unroll
  for (int h = 0; h < HEADS; h++) {
    if (lane == 0) {
      warp_max[warp][h] = running_max[h];
      warp_total[warp][h] = running_sum[h];
    }
#pragma unroll
    for (int i = 0; i < DIMS; i++) warp_acc[warp][h][lane + 32 * i] = acc[h][i];
  }
  __syncthreads();
  // each head's maximum over the warps, each warp's rescale factor and the head's total, once per head: per output
  // element (as before) they were ~60% of a decode block's instructions (ncu, H200: 1,246 a warp for 2-3 keys)
  __shared__ float warp_factor[kWarps][HEADS];
  __shared__ float head_max[HEADS], head_sum[HEADS];
  if (threadIdx.x < HEADS) {
    const int h = threadIdx.x;
    float total_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; w++) total_max = fmaxf(total_max, warp_max[w][h]);
    float total_sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) {
      const float factor = softmax_partial_factor(warp_max[w][h], total_max);
      warp_factor[w][h] = factor;
      total_sum += warp_total[w][h] * factor;
    }
    head_max[h] = total_max;
    head_sum[h] = total_sum;
  }
  __syncthreads();

  // ---- phase 5: write the output (one split) or this split's partial (several)
  A* out_row = static_cast<A*>(args.out) + row * args.out_stride;
  for (int index = threadIdx.x; index < HEADS * kPadded; index += blockDim.x) {
    const int h = index / kPadded, d = index % kPadded;
    if (h >= heads_here || d >= head_dim) continue;
    const float total_max = head_max[h], total_sum = head_sum[h];
    float total_acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) total_acc += warp_acc[w][h][d] * warp_factor[w][h];
    const int64_t head = first_head + h;
    if (args.splits == 1) {
      out_row[head * head_dim + d] = from_float<A>(total_acc / total_sum);  // 0 / 0 = NaN when nothing was seen
    } else {
      const int64_t partial = (row * args.heads + head) * args.splits + split;
      args.partial_acc[partial * head_dim + d] = total_acc;
      if (d == 0) {
        args.partial_max[partial] = total_max;
        args.partial_sum[partial] = total_sum;
      }
    }
  }
}

// Merges the splits of paged_attention_kernel: grid (rows, heads), threads over head dims.
//   A: activation type.
template <class A>
__global__ void attention_combine_kernel(const AttentionArgs args) {
  const int64_t row = blockIdx.x, head = blockIdx.y, head_dim = args.layout.head_dim;
  const int64_t first = (row * args.heads + head) * args.splits;
  // the splits this row's query used (paged_attention_kernel's rule; a malformed row used split 0 alone), from the
  // host's query_starts and context_lens before kernel_entry's wait (paged_attention_kernel's phase 1 says why)
  int64_t keys = 0;
  const int64_t seq = sequence_of_row(args.query_starts, args.seqs, row);
  if (seq >= 0) {
    const int64_t first_row = args.query_starts[seq], queries = args.query_starts[seq + 1] - first_row;
    const int64_t context = args.context_lens[seq];
    if (context >= queries && context <= args.max_context) {
      const int64_t last = context - queries + (row - first_row);
      keys = last - attention_first_key(args.window, last) + 1;
    }
  }
  kernel_entry();
  const int64_t used_splits = attention_splits_used(args.splits, keys);
  float total_max = -INFINITY;
  for (int64_t s = 0; s < used_splits; s++) total_max = fmaxf(total_max, args.partial_max[first + s]);
  A* dst = static_cast<A*>(args.out) + row * args.out_stride + head * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float total_sum = 0.0f, total_acc = 0.0f;
    for (int64_t s = 0; s < used_splits; s++) {
      const float factor = softmax_partial_factor(args.partial_max[first + s], total_max);
      total_sum += args.partial_sum[first + s] * factor;
      total_acc += args.partial_acc[(first + s) * head_dim + d] * factor;
    }
    dst[d] = from_float<A>(total_acc / total_sum);
  }
}

// ---- the vision encoder's ops (Qwen3-VL) ------------------------------------------------------------------

// out[t, c] = sum over j of table[indices[t, j], c] * weights[t, j], each product rounded to fp32 and summed in
// order j = 0, 1, ... (the CPU's order): the bilinear resampling of the learned position table.
//   T: table element type; A: activation type.
template <class T, class A>
__global__ void embedding_bag_kernel(const T* table, int64_t table_stride, int64_t table_rows,  // [V, cols]
                                     const int32_t* indices, int64_t indices_stride,            // [rows, taps]
                                     const float* weights, int64_t weights_stride,              // [rows, taps]
                                     int64_t taps, A* out, int64_t out_stride, int64_t cols,    // [rows, cols]
                                     DeviceFault* fault) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  const int32_t* index = indices + row * indices_stride;
  const float* weight = weights + row * weights_stride;
  A* dst = out + row * out_stride;
  for (int64_t j = 0; j < taps; j++)
    if (index[j] < 0 || index[j] >= table_rows) {  // the same answer in every thread: a uniform branch
      if (threadIdx.x == 0) report_fault(fault, fault_embedding_index, row, index[j], table_rows, j);
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = from_float<A>(quiet_nan());
      return;
    }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float sum = 0.0f;
    for (int64_t j = 0; j < taps; j++)
      sum += __fmul_rn(to_float(load_readonly(table + index[j] * table_stride + c)), weight[j]);  // no fma: as the CPU
    dst[c] = from_float<A>(sum);
  }
}

// nn.LayerNorm over each row in fp32: out = (x - mean) / sqrt(var + eps) * w + b, var the biased variance.
// Two passes over the row (mean, then the squared deviations from it), as the CPU; out may be x.
//   A: activation type; W: weight and bias type; TEAM: as rms_norm_kernel (one row per team).
template <class A, class W, int TEAM>
__global__ void layer_norm_kernel(const A* x, int64_t x_stride,              // [rows, cols]
                                  const W* weight, const W* bias,            // [cols]
                                  int64_t rows, int64_t cols, float eps, A* out, int64_t out_stride) {
  kernel_entry();
  __shared__ float team_partials[32];
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / TEAM) + threadIdx.x / TEAM;
  const int member = threadIdx.x % TEAM;
  if (row >= rows) return;
  const A* in = x + row * x_stride;
  A* dst = out + row * out_stride;

  // ---- phase 1: the mean
  float sum = 0.0f;
  for (int64_t c = member; c < cols; c += TEAM) sum += to_float(in[c]);
  const float mean = team_sum<TEAM>(sum, team_partials) / float(cols);
  // ---- phase 2: the biased variance around it
  float squares = 0.0f;
  for (int64_t c = member; c < cols; c += TEAM) {
    const float d = to_float(in[c]) - mean;
    squares += d * d;
  }
  const float inv_std = 1.0f / sqrtf(team_sum<TEAM>(squares, team_partials) / float(cols) + eps);
  // ---- phase 3: normalise, scale, shift
  for (int64_t c = member; c < cols; c += TEAM)
    dst[c] = from_float<A>((to_float(in[c]) - mean) * inv_std * to_float(load_readonly(weight + c)) +
                           to_float(load_readonly(bias + c)));
}

// out = gelu(x): exact (erf) or the tanh approximation, as ATen computes them in fp32. out may be x.
//   A: activation type.
template <class A, bool TANH>
__global__ void gelu_kernel(const A* x, int64_t x_stride, A* out, int64_t out_stride, int64_t cols) {
  kernel_entry();
  const A* in = x + int64_t(blockIdx.x) * x_stride;
  A* dst = out + int64_t(blockIdx.x) * out_stride;
  for (int64_t c = row_column_begin(); c < cols; c += row_column_step()) {
    const float v = to_float(in[c]);
    if (TANH) {
      const float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2 / pi)
      dst[c] = from_float<A>(0.5f * v * (1.0f + tanhf(beta * (v + kappa * v * v * v))));
    } else {
      dst[c] = from_float<A>(v * 0.5f * (1.0f + erff(v * 0.7071067811865476f)));
    }
  }
}

// Non-causal attention within segments of rows (the images of a vision encoder's batch). One block per
// (query row, query head), kAttentionWarps warps taking every kAttentionWarps-th key of the row's segment,
// lanes holding head dimensions (DIMS each, as paged attention); the warps' online softmaxes merge in
// shared memory. Vision heads see a few thousand keys at most, so no split over the keys is needed.
struct SegmentAttentionArgs {
  const void* q;  // [rows, heads * head_dim], activation type (q, k, v may be column slices of one qkv)
  const void* k;  // [rows, kv_heads * head_dim]
  const void* v;
  void* out;      // [rows, heads * head_dim]
  int64_t q_stride, k_stride, v_stride, out_stride;
  const int32_t* segment_starts;  // [segments + 1]
  int64_t segments, rows, max_segment, head_dim, group;  // group: query heads per KV head
  float scale;
  DeviceFault* fault;
};

//   A: activation type; DIMS: head dimensions per lane (head_dim <= 32 * DIMS).
template <class A, int DIMS>
__global__ void __launch_bounds__(kAttentionWarps * 32) segment_attention_kernel(const SegmentAttentionArgs args) {
  kernel_entry();
  constexpr int kPadded = DIMS * 32;
  __shared__ float warp_max[kAttentionWarps];
  __shared__ float warp_total[kAttentionWarps];
  __shared__ float warp_acc[kAttentionWarps][kPadded];
  const int64_t row = blockIdx.x, head = blockIdx.y, kv_head = head / args.group, head_dim = args.head_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // ---- phase 1: the row's segment (an empty range when the starts are malformed)
  const bool reporter = threadIdx.x == 0 && head == 0;
  const int64_t segment = sequence_of_row(args.segment_starts, args.segments, row);
  int64_t key_begin = 0, key_end = 0;
  if (segment < 0) {
    if (reporter) report_fault(args.fault, fault_segment_row, row, 0, args.rows, 0);
  } else {
    key_begin = args.segment_starts[segment];
    key_end = args.segment_starts[segment + 1];
    if (key_end - key_begin > args.max_segment || key_end > args.rows) {
      if (reporter) report_fault(args.fault, fault_segment_length, segment, key_end - key_begin, args.max_segment, 0);
      key_end = key_begin;  // the output becomes 0 / 0 = NaN
    }
  }

  // ---- phase 2: the query head into registers; the warp's keys with an online softmax
  const A* q_row = static_cast<const A*>(args.q) + row * args.q_stride + head * head_dim;
  float q[DIMS], acc[DIMS];
#pragma unroll
  for (int i = 0; i < DIMS; i++) {
    const int64_t d = lane + 32 * i;
    q[i] = d < head_dim ? to_float(q_row[d]) : 0.0f;
    acc[i] = 0.0f;
  }
  float running_max = -INFINITY, running_sum = 0.0f;
  for (int64_t key = key_begin + warp; key < key_end; key += kAttentionWarps) {
    const A* k_row = static_cast<const A*>(args.k) + key * args.k_stride + kv_head * head_dim;
    const A* v_row = static_cast<const A*>(args.v) + key * args.v_stride + kv_head * head_dim;
    float partial = 0.0f, v[DIMS];
#pragma unroll
    for (int i = 0; i < DIMS; i++) {
      const int64_t d = lane + 32 * i;
      partial += d < head_dim ? q[i] * to_float(k_row[d]) : 0.0f;
      v[i] = d < head_dim ? to_float(v_row[d]) : 0.0f;
    }
    const float score = warp_sum(partial) * args.scale;
    const SoftmaxStep step = online_softmax_step(score, running_max, running_sum);
#pragma unroll
    for (int i = 0; i < DIMS; i++) acc[i] = acc[i] * step.rescale + step.weight * v[i];
  }

  // ---- phase 3: merge the warps and store
  if (lane == 0) {
    warp_max[warp] = running_max;
    warp_total[warp] = running_sum;
  }
#pragma unroll
  for (int i = 0; i < DIMS; i++) warp_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float total_max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kAttentionWarps; w++) total_max = fmaxf(total_max, warp_max[w]);
  A* out_row = static_cast<A*>(args.out) + row * args.out_stride + head * head_dim;
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float total_sum = 0.0f, total_acc = 0.0f;
#pragma unroll
    for (int w = 0; w < kAttentionWarps; w++) {
      const float factor = softmax_partial_factor(warp_max[w], total_max);
      total_sum += warp_total[w] * factor;
      total_acc += warp_acc[w][d] * factor;
    }
    out_row[d] = from_float<A>(total_acc / total_sum);
  }
}

// ids[t] = argmax of logits row t: each thread scans a stride of the row, then warps and the block reduce
// with argmax_better (larger wins, ties to the lower column, NaN never wins).
//   A: activation type.
constexpr int kArgmaxThreads = 512;
// A thread's best (argmax_better) over row[first], row[first + step], ... below n, into *best_value / *best_index:
// kArgmaxBatch loads in flight before any is compared, so the thread waits out one memory round trip a batch
// instead of one an element. One at a time, the 125 elements a thread of a 1,024-thread block takes from a
// 128,256-entry row were a chain of 125 round trips: sample_kernel's greedy rows took 49 us of a Llama-3.1-8B
// decode step (ncu, H200, 2026-11-27). The same elements in the same order: the same winner.
constexpr int kArgmaxBatch = 8;
template <class A>
__device__ __forceinline__ void strided_argmax(const A* row, int64_t n, int64_t first, int64_t step, float* best_value,
                                               int32_t* best_index) {
  for (int64_t base = first; base < n; base += kArgmaxBatch * step) {
    float v[kArgmaxBatch];
#pragma unroll
    for (int u = 0; u < kArgmaxBatch; u++) {  // unconditional loads (indices past n read the last element), which
      const int64_t i = base + u * step;      // the compiler issues together; predicated ones it interleaved with
                                              // the compares (SASS, sm_90)
      v[u] = to_float(load_readonly(row + (i < n ? i : n - 1)));
    }
#pragma unroll
    for (int u = 0; u < kArgmaxBatch; u++) {
      const int64_t i = base + u * step;
      if (i < n && argmax_better(v[u], int32_t(i), *best_value, *best_index)) {
        *best_value = v[u];
        *best_index = int32_t(i);
      }
    }
  }
}
template <class A>
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const A* logits, int64_t stride,  // [rows, cols]
                                                                 int64_t cols, int32_t* ids) {      // [rows]
  kernel_entry();
  __shared__ float warp_value[kArgmaxThreads / 32];
  __shared__ int32_t warp_index[kArgmaxThreads / 32];
  const A* values = logits + int64_t(blockIdx.x) * stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // ---- phase 1: each thread's best over its stride
  float best_value = -INFINITY;
  int32_t best_index = INT_MAX;  // "none yet": loses every tie
  strided_argmax(values, cols, threadIdx.x, blockDim.x, &best_value, &best_index);
  // ---- phase 2: warp butterfly, then the warps' winners through shared memory
  auto reduce_warp = [&] {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_value = __shfl_xor_sync(0xffffffffu, best_value, offset);
      const int32_t other_index = __shfl_xor_sync(0xffffffffu, best_index, offset);
      if (argmax_better(other_value, other_index, best_value, best_index)) {
        best_value = other_value;
        best_index = other_index;
      }
    }
  };
  reduce_warp();
  if (lane == 0) {
    warp_value[warp] = best_value;
    warp_index[warp] = best_index;
  }
  __syncthreads();
  if (warp != 0) return;
  best_value = lane < int(blockDim.x / 32) ? warp_value[lane] : -INFINITY;
  best_index = lane < int(blockDim.x / 32) ? warp_index[lane] : INT_MAX;
  reduce_warp();
  if (lane == 0) ids[blockIdx.x] = best_index == INT_MAX ? 0 : best_index;
}

// ==== 3b. quantized GEMMs ==================================================================================
// out [M, N] = x [M, K] @ W^T (+ bias) for quantized W in the device layout of quant_gpu.hpp (repacked at load
// by cuda::upload_quant_weight). Three tensor-core kernels share one skeleton (quant_gemm_kernel), and a
// dequantize kernel feeds cuBLAS for prefill-size M, F32 activations and layouts the mma kernels cannot read:
//
//   Int4A16  W4A16: 8 warps; a warp's k16 x n64 tile = one 16-byte load per lane, dequantized in registers
//            (magic-number lop3, subtract magic + zero, multiply by the group scale, bf16/f16), mma.m16n8k16
//   Fp8A16   W8A16 (any sm_80+ GPU; the fp8 path of sm_80/86/87): 4 warps; a warp's k32 x n64 tile = four
//            16-byte loads per lane, e4m3 bits moved into bf16/f16 (prmt, shifts, masks) times the scale
//            pre-multiplied by 2^fix, two mma.m16n8k16 steps per tile
//   Fp8A8    W8A8 (sm_89+): the same tiles fed raw to mma.m16n8k32.e4m3, activations quantized per token
//            (per group for block weights) by quantize_activations_fp8_kernel; each tile's fp32 product is
//            scaled by (activation scale x weight scale) into the accumulator
// Decode rows take the GEMVs further down (quant_gemv_kernel: fp32 FMAs, 1-4 rows; quant_gemv_mma_kernel: the
// Int4A16 / Fp8A16 tile math from registers, 1-16 rows), which read the same tiles without shared memory.
//
// Partitioning: a block owns 16 x M_TILES rows x 64 output columns (one column tile) and a range of the K
// stages; its warps take the stage's tiles side by side along K and sum in shared memory at the end:
//
//   grid = (row blocks, column tiles, splits)        K: | stage 0 | stage 1 | ... | stage S-1 |
//   stage = 128 columns: warp w <- tile w               split 0: stages [0, S/splits), split 1: ...
//
// Split-K (one row block only, so that M = 1 fills the GPU): each split writes an fp32 partial [rows, 64] to
// the backend's scratch, then bumps the column tile's counter (in the weight's own device region, zero at
// rest); the block that arrives last sums the splits in split order (deterministic), adds the bias, stores
// the output in the activation dtype and resets the counter. No extra launch, no memset.
// Pipeline: kStages buffers of (activations, weight tiles, scales, zero points / activation scales), filled by
// cp.async 16-byte copies kStages - 1 stages ahead (weights with an L2 evict-first policy: read once).

// ---- PTX helpers -------------------------------------------------------------------------------------------------
// cp.async.cg: 16 bytes global -> shared without a register round trip (sm_80+), so stages load while the
// warps compute; src-size 0 fills zeros (rows past M, columns past K) without reading.
__device__ __forceinline__ void cp_async_16(void* shared, const void* global, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(valid ? 16 : 0));
}
// An L2 policy that evicts first: the quantized weights are read exactly once per GEMM and should not push
// the activations, scales and split-K partials out of L2.
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async_16_evict_first(void* shared, const void* global, uint64_t policy) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global),
               "l"(policy));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N committed groups (stages) are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// ldmatrix: four 8x8 b16 matrices from shared memory straight into an mma A fragment (rows given by lanes
// 0-7, 8-15, 16-23, 24-31).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* shared) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
// mma.m16n8k16 with bf16 or f16 operands and fp32 accumulation: c += a b.
// (Fragments: https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float)
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// mma.m16n8k32 with e4m3 operands (sm_89+): d = a b, fp32, from zero (the caller scales it into its sum).
// (Unreferenced on older targets, where the W8A8 kernel compiles to a trap.)
[[maybe_unused]] __device__ __forceinline__ void mma_16832_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%10,%10,%10,%10};\n"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
#else
  // The host runs W8A8 only on sm_89+ (kQuantW8A8MinSm); older targets compile this path but never enter it.
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  __trap();
#endif
}

// Two 16-bit values in a 32-bit register (low half first), as bf16x2 / f16x2 arithmetic sees them. Both
// operations round once to nearest even, as round_to_dtype does on the host.
template <class T>
struct Pair2;
template <>
struct Pair2<__nv_bfloat16> {
  using Vector = __nv_bfloat162;
  static constexpr bool kBf16 = true;
};
template <>
struct Pair2<__half> {
  using Vector = __half2;
  static constexpr bool kBf16 = false;
};
template <class To, class From>
__device__ __forceinline__ To bit_cast_32(From value) {
  static_assert(sizeof(To) == 4 && sizeof(From) == 4, "32-bit casts only");
  To to;
  memcpy(&to, &value, 4);
  return to;
}
template <class T>
__device__ __forceinline__ uint32_t pair_sub(uint32_t a, uint32_t b) {
  using V = typename Pair2<T>::Vector;
  return bit_cast_32<uint32_t>(__hsub2(bit_cast_32<V>(a), bit_cast_32<V>(b)));
}
template <class T>
__device__ __forceinline__ uint32_t pair_mul(uint32_t a, uint32_t b) {
  using V = typename Pair2<T>::Vector;
  return bit_cast_32<uint32_t>(__hmul2(bit_cast_32<V>(a), bit_cast_32<V>(b)));
}
// float -> T (nearest even), copied into both halves.
template <class T>
__device__ __forceinline__ uint32_t pair_broadcast(float value) {
  const T narrow = from_float<T>(value);
  uint16_t bits;
  memcpy(&bits, &narrow, 2);
  return uint32_t(bits) * 0x10001u;
}
// Two floats -> a T pair (each rounded once, nearest even; low half first).
template <class T>
__device__ __forceinline__ uint32_t pair_from_floats(float low, float high) {
  const T narrow[2] = {from_float<T>(low), from_float<T>(high)};
  uint32_t bits;
  memcpy(&bits, narrow, 4);
  return bits;
}

// Two 16-bit values (low half first) as floats (exact).
template <class T>
__device__ __forceinline__ float2 pair_to_float2(uint32_t bits);
template <>
__device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(uint32_t bits) {
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 pair_to_float2<__half>(uint32_t bits) {
  return __half22float2(bit_cast_32<__half2>(bits));
}

// A lane's scale register as the A16 kernels hold it (quant_gpu.hpp's ScaleProduct): a T pair to multiply with
// (kFp32 false: pair_multiply), or the float's own bits (kFp32: the fp32 modes).
template <class T, bool kFp32>
__device__ __forceinline__ uint32_t scale_register(float scale) {
  if constexpr (kFp32) return __float_as_uint(scale);
  else return pair_broadcast<T>(scale);  // exact under pair_multiply: the checkpoint's scale dtype is T
}
// A dequantized pair (T bits, exact: q - z, or e4m3 x 2^-fix) times its scale register, each weight rounded once
// to T as the reference's weight rounded to T: one bf16x2 / f16x2 multiply, or (kFp32) the product in fp32
// (scale_product_fp32, the function the CPU emulation runs), to the checkpoint's other 16-bit dtype first under
// fp32_then_scale_dtype, then to T.
template <class T, bool kFp32>
__device__ __forceinline__ uint32_t scaled_pair(uint32_t values, uint32_t scale, ScaleProduct mode) {
  if constexpr (!kFp32) {
    return pair_mul<T>(values, scale);
  } else {
    const DType other = Pair2<T>::kBf16 ? DType::F16 : DType::BF16;
    const float2 v = pair_to_float2<T>(values);
    const float s = __uint_as_float(scale);
    return pair_from_floats<T>(scale_product_fp32(v.x, s, mode, other), scale_product_fp32(v.y, s, mode, other));
  }
}

// ---- the formats ---------------------------------------------------------------------------------------------------
enum class QgFormat { int4_a16, fp8_a16, fp8_a8 };

// Geometry per format and M_TILES (16-row mma tiles per block). Shared memory of one pipeline stage:
//   A  activations [16 M_TILES rows][128 columns] (bf16/f16: 256 B rows; e4m3: 128 B), 16-byte chunks
//      XOR-swizzled by row % 8 so that ldmatrix and the 8-byte loads hit distinct banks
//   B  the stage's weight tiles, as in device memory (warp w's tile at w * tile bytes)
//   S  per warp: the 64 scales of its tile's group (up to 4 bytes each; table positions, see quant_gpu.hpp)
//   Z  int4: per warp, the 64 zero points of that group
//   X  W8A8: per warp, the activation scales of the block's rows for that group
template <QgFormat F, int M_TILES>
struct QgShape {
  static constexpr int kWarps = F == QgFormat::int4_a16 ? 8 : 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTileK = F == QgFormat::int4_a16 ? 16 : 32;
  static constexpr int kTileBytes = F == QgFormat::int4_a16 ? 512 : 2048;
  static constexpr int kStages = M_TILES == 1 ? 6 : M_TILES == 2 ? 4 : 3;  // deeper when the A part is small
  static constexpr int kRows = 16 * M_TILES;
  static constexpr int kABytes = F == QgFormat::fp8_a8 ? 1 : 2;
  static constexpr int kARow = int(kQuantStageK) * kABytes;
  static constexpr int kA = kRows * kARow;
  static constexpr int kB = kWarps * kTileBytes;
  static constexpr int kS = kWarps * 64 * 4;
  static constexpr int kZ = F == QgFormat::int4_a16 ? kWarps * 64 : 0;
  static constexpr int kX = F == QgFormat::fp8_a8 ? kWarps * kRows * 4 : 0;
  static constexpr int kStage = kA + kB + kS + kZ + kX;
  // after the main loop the same memory holds the cross-warp sums, then the block's [rows][kTileStride] tile
  static constexpr int kAccFloats = M_TILES * 32;  // per lane
  static constexpr int kReduce = kWarps / 2 * kAccFloats * 32 * 4;
  static constexpr int kTileStride = 68;  // floats; padded against bank conflicts
  static constexpr int kTile = kRows * kTileStride * 4;
  static constexpr int kSmem = kStages * kStage > kReduce ? (kStages * kStage > kTile ? kStages * kStage : kTile)
                                                          : (kReduce > kTile ? kReduce : kTile);
  static_assert(kWarps * kTileK == kQuantStageK, "a stage is one tile per warp");
};

// Everything a GEMM launch reads (device pointers into the weight's layout and the backend's scratch).
struct QuantGemmArgs {
  const void* x;             // [rows, x_stride]: T (A16) or e4m3 (W8A8), 16-byte aligned rows
  int64_t x_stride;          // elements
  int64_t k_valid;           // columns of x holding data; the rest of k_pad is read as 0
  const float* x_scales;     // W8A8: [groups][x_scales_stride], the activation scale of each row
  int64_t x_scales_stride;
  void* out;                 // [rows, n], activation dtype
  int64_t out_stride;
  int64_t rows, n;
  const uint8_t* tiles;      // layout tiles
  const uint8_t* scales;     // [groups][n_pad]
  const uint8_t* zeros;      // [groups][n_pad] or null (symmetric)
  const float* bias;         // [n_pad]
  unsigned* counters;        // [n_tiles]
  int scale_bytes;           // table element: 2 or 4
  DType scale_dtype;         // table dtype (int4: F32, BF16 or F16; fp8: F32)
  ScaleProduct scale_product;  // A16: how a pair meets its scale (quant_gpu.hpp), by checkpoint and activation dtype
  int64_t n_pad, stages, group_size;
  int group_shift;           // quant_group_shift(group_size): -1 when not a power of two
  uint64_t tile_row_bytes;
  int64_t splits;
  float* partials;           // [n_tiles][splits][16 M_TILES][64] when splits > 1
  DType out_dtype;           // BF16 or F16 (W8A8 is compiled once and stores either)
};

// out[index] = value rounded to T, or for W8A8 (one instantiation for both) to args.out_dtype.
template <QgFormat F, class T>
__device__ __forceinline__ void qg_store(const QuantGemmArgs& args, int64_t index, float value) {
  if (F == QgFormat::fp8_a8 && args.out_dtype == DType::F16)
    static_cast<__half*>(args.out)[index] = from_float<__half>(value);
  else if (F == QgFormat::fp8_a8)
    static_cast<__nv_bfloat16*>(args.out)[index] = from_float<__nv_bfloat16>(value);
  else
    static_cast<T*>(args.out)[index] = from_float<T>(value);
}

// The block's part of one stage: its activation rows, the stage's tiles, and each warp's group tables.
template <QgFormat F, int M_TILES>
__device__ __forceinline__ void qg_fetch_stage(const QuantGemmArgs& args, uint8_t* stage, int64_t s, int64_t m0,
                                               int64_t rows_here, int64_t n_tile, uint64_t policy) {
  using Shape = QgShape<F, M_TILES>;
  // A: 16-byte chunks; chunk c of row r lands at chunk (c ^ r % 8) of its shared row
  constexpr int kChunksPerRow = Shape::kARow / 16;
  constexpr int kElementsPerChunk = 16 / Shape::kABytes;
  for (int i = threadIdx.x; i < Shape::kRows * kChunksPerRow; i += Shape::kThreads) {
    const int r = i / kChunksPerRow, c = i % kChunksPerRow;
    const int64_t column = s * kQuantStageK + c * kElementsPerChunk;
    const bool valid = r < rows_here && column < args.k_valid;
    const uint8_t* src = static_cast<const uint8_t*>(args.x) +
                         (valid ? ((m0 + r) * args.x_stride + column) * Shape::kABytes : 0);
    cp_async_16(stage + r * Shape::kARow + ((c ^ (r % 8)) * 16), src, valid);
  }
  // B: the stage's tiles are one contiguous run
  uint8_t* b = stage + Shape::kA;
  const uint8_t* tiles = args.tiles + uint64_t(n_tile) * args.tile_row_bytes + uint64_t(s) * Shape::kB;
  for (int i = threadIdx.x; i < Shape::kB / 16; i += Shape::kThreads)
    cp_async_16_evict_first(b + 16 * i, tiles + 16 * i, policy);
  // S, Z, X: per warp tile, the rows of its group
  // (32-bit index math: a stage's first column fits, K_pad < 2^31; the group of warp w's tile is a shift)
  uint8_t* scales = b + Shape::kB;
  const uint32_t stage_k = uint32_t(s) * uint32_t(kQuantStageK);
  const uint32_t group_size = uint32_t(args.group_size);
  const uint64_t n_offset = uint64_t(n_tile) * kQuantTileN;
  const int chunk_shift = args.scale_bytes == 4 ? 4 : 3;  // 64 scales of 4 or 2 bytes: 16 or 8 chunks of 16 bytes
  for (int i = threadIdx.x; i < (Shape::kWarps << chunk_shift); i += Shape::kThreads) {
    const int w = i >> chunk_shift, c = i & ((1 << chunk_shift) - 1);
    const uint32_t group = quant_group_of(stage_k + uint32_t(w * Shape::kTileK), group_size, args.group_shift);
    cp_async_16(scales + w * 256 + 16 * c,
                args.scales + (uint64_t(group) * uint64_t(args.n_pad) + n_offset) * uint64_t(args.scale_bytes) + 16 * c,
                true);
  }
  if constexpr (Shape::kZ > 0) {
    if (args.zeros != nullptr)
      for (int i = threadIdx.x; i < Shape::kWarps * 4; i += Shape::kThreads) {
        const int w = i / 4, c = i % 4;
        const uint32_t group = quant_group_of(stage_k + uint32_t(w * Shape::kTileK), group_size, args.group_shift);
        cp_async_16(scales + Shape::kS + w * 64 + 16 * c,
                    args.zeros + uint64_t(group) * uint64_t(args.n_pad) + n_offset + 16 * c, true);
      }
  }
  if constexpr (Shape::kX > 0) {
    constexpr int kChunks = Shape::kRows / 4;  // 4 rows of scales per 16 bytes
    for (int i = threadIdx.x; i < Shape::kWarps * kChunks; i += Shape::kThreads) {
      const int w = i / kChunks, c = i % kChunks;
      const uint32_t group = quant_group_of(stage_k + uint32_t(w * Shape::kTileK), group_size, args.group_shift);
      cp_async_16(scales + Shape::kS + w * Shape::kRows * 4 + 16 * c,
                  args.x_scales + uint64_t(group) * uint64_t(args.x_scales_stride) + m0 + 4 * c, true);
    }
  }
}

// One lane's 16 bytes of a W4A16 k16 x n64 tile (quant_gpu.hpp's layout) times the A fragments: acc[m tile][n8
// block] += a[m tile] x the dequantized block ((u - z) * scale, one rounding to T: scaled_pair). The mma kernel and
// the GEMV.
template <class T, int M_TILES, bool kFp32Scales>
__device__ __forceinline__ void int4_tile_mma(const uint4& tile, const uint32_t (&a)[M_TILES][4],
                                              const uint32_t (&scale2)[8], const uint32_t (&subtrahend2)[8],
                                              ScaleProduct mode, float (&acc)[M_TILES][8][4]) {
  const uint32_t magic = int4_magic(Pair2<T>::kBf16);
  const uint32_t words[4] = {tile.x, tile.y, tile.z, tile.w};
#pragma unroll
  for (int w = 0; w < 4; w++)
#pragma unroll
    for (int half_word = 0; half_word < 2; half_word++) {
      const int j = int4_pair_block(w, 2 * half_word);  // pairs 2 hw (b0) and 2 hw + 1 (b1) feed block j
      const uint32_t b0 = scaled_pair<T, kFp32Scales>(
          pair_sub<T>(int4_pair_bits(words[w], 2 * half_word, magic), subtrahend2[j]), scale2[j], mode);
      const uint32_t b1 = scaled_pair<T, kFp32Scales>(
          pair_sub<T>(int4_pair_bits(words[w], 2 * half_word + 1, magic), subtrahend2[j]), scale2[j], mode);
#pragma unroll
      for (int mt = 0; mt < M_TILES; mt++) mma_16816<T>(acc[mt][j], a[mt], b0, b1);
    }
}

// Step `step` (k 16 step .. 16 step + 15) of one lane's 64 bytes of a W8A16 k32 x n64 tile times the A fragments
// of that step: acc[m tile][n8 block] += a x (e4m3 value x folded scale, one rounding to T: scaled_pair). The mma
// kernel and the GEMV.
template <class T, int M_TILES, bool kFp32Scales>
__device__ __forceinline__ void fp8_a16_step_mma(const uint4 (&chunks)[4], int step, const uint32_t (&a)[M_TILES][4],
                                                 const uint32_t (&scale2)[8], ScaleProduct mode,
                                                 float (&acc)[M_TILES][8][4]) {
  constexpr bool kBf16 = Pair2<T>::kBf16;
#pragma unroll
  for (int c = 0; c < 4; c++)
#pragma unroll
    for (int pair_word = 0; pair_word < 2; pair_word++) {
      const int word = 2 * pair_word + step;  // fp8_word_register(word) == step
      const int j = fp8_word_block(c, word);
      const uint32_t raw = pair_word == 0 ? (step == 0 ? chunks[c].x : chunks[c].y)
                                          : (step == 0 ? chunks[c].z : chunks[c].w);
      const uint32_t ordered = fp8_pair_order(raw);
      const uint32_t b0 = scaled_pair<T, kFp32Scales>(fp8_pair_bits(ordered, 0, kBf16), scale2[j], mode);
      const uint32_t b1 = scaled_pair<T, kFp32Scales>(fp8_pair_bits(ordered, 1, kBf16), scale2[j], mode);
#pragma unroll
      for (int mt = 0; mt < M_TILES; mt++) mma_16816<T>(acc[mt][j], a[mt], b0, b1);
    }
}

// W4A16: warp `warp`'s k16 tile of the stage into acc[m tile][n8 block][4].
template <class T, int M_TILES, bool kFp32Scales>
__device__ __forceinline__ void qg_step_int4(const QuantGemmArgs& args, const uint8_t* stage, int warp, int lane,
                                             float (&acc)[M_TILES][8][4]) {
  using Shape = QgShape<QgFormat::int4_a16, M_TILES>;
  constexpr bool kBf16 = Pair2<T>::kBf16;
  const uint32_t magic = int4_magic(kBf16);
  const int g = lane / 4;
  // the lane's 8 scales (columns 8j + g) and zero points, from table positions 8g .. 8g + 7
  const uint8_t* scales = stage + Shape::kA + Shape::kB + warp * 256;
  uint32_t scale2[8], subtrahend2[8];
#pragma unroll
  for (int j = 0; j < 8; j++) {
    float scale;
    if (args.scale_bytes == 4) {
      scale = reinterpret_cast<const float*>(scales)[8 * g + j];
    } else {
      const uint16_t bits = reinterpret_cast<const uint16_t*>(scales)[8 * g + j];
      scale = args.scale_dtype == DType::BF16 ? bf16_to_float(bits) : f16_to_float(bits);
    }
    scale2[j] = scale_register<T, kFp32Scales>(scale);
    const uint32_t zero = args.zeros != nullptr ? stage[Shape::kA + Shape::kB + Shape::kS + warp * 64 + 8 * g + j] : 8u;
    subtrahend2[j] = int4_subtrahend_bits(zero, magic) * 0x10001u;
  }
  // A: rows of each m tile, columns 16 warp .. 16 warp + 15 (chunks 2 warp, 2 warp + 1)
  uint32_t a[M_TILES][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; mt++) {
    const int row = 16 * mt + lane % 16, chunk = 2 * warp + lane / 16;
    ldmatrix_x4(a[mt], stage + row * Shape::kARow + ((chunk ^ (row % 8)) * 16));
  }
  const uint4 tile = *reinterpret_cast<const uint4*>(stage + Shape::kA + warp * Shape::kTileBytes + 16 * lane);
  int4_tile_mma<T, M_TILES, kFp32Scales>(tile, a, scale2, subtrahend2, args.scale_product, acc);
}

// W8A16: warp `warp`'s k32 tile as two m16n8k16 steps (quant_gpu.hpp: w8a16_a_column).
template <class T, int M_TILES, bool kFp32Scales>
__device__ __forceinline__ void qg_step_fp8_a16(const QuantGemmArgs& args, const uint8_t* stage, int warp, int lane,
                                                float (&acc)[M_TILES][8][4]) {
  using Shape = QgShape<QgFormat::fp8_a16, M_TILES>;
  constexpr bool kBf16 = Pair2<T>::kBf16;
  const int g = lane / 4, q = lane % 4;
  const float* scales = reinterpret_cast<const float*>(stage + Shape::kA + Shape::kB + warp * 256);
  uint32_t scale2[8];
#pragma unroll
  for (int j = 0; j < 8; j++) scale2[j] = scale_register<T, kFp32Scales>(fp8_folded_scale(scales[8 * g + j], kBf16));
  const uint8_t* tile = stage + Shape::kA + warp * Shape::kTileBytes;
  uint4 chunks[4];
#pragma unroll
  for (int c = 0; c < 4; c++) chunks[c] = *reinterpret_cast<const uint4*>(tile + 512 * c + 16 * lane);
#pragma unroll
  for (int step = 0; step < 2; step++) {
    // A: 8 bytes (4 values) at column 32 warp + 16 step + 4q of rows g and g + 8 of each m tile
    uint32_t a[M_TILES][4];
    const int byte = 2 * (32 * warp + 16 * step + 4 * q);
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int row = 16 * mt + g + 8 * h;
        const uint2 v = *reinterpret_cast<const uint2*>(stage + row * Shape::kARow +
                                                         (((byte / 16) ^ (row % 8)) * 16) + byte % 16);
        a[mt][h] = v.x;      // a0 / a1: slots 2q, 2q + 1 <- columns 4q, 4q + 1
        a[mt][2 + h] = v.y;  // a2 / a3: slots 2q + 8, 2q + 9 <- columns 4q + 2, 4q + 3
      }
    fp8_a16_step_mma<T, M_TILES, kFp32Scales>(chunks, step, a, scale2, args.scale_product, acc);
  }
}

// W8A8: warp `warp`'s k32 tile on the e4m3 tensor cores; the tile's product scaled into acc.
template <int M_TILES>
__device__ __forceinline__ void qg_step_fp8_a8(const QuantGemmArgs&, const uint8_t* stage, int warp, int lane,
                                               float (&acc)[M_TILES][8][4]) {
  using Shape = QgShape<QgFormat::fp8_a8, M_TILES>;
  const int g = lane / 4;
  const float* scales = reinterpret_cast<const float*>(stage + Shape::kA + Shape::kB + warp * 256);
  const float* x_scales = reinterpret_cast<const float*>(stage + Shape::kA + Shape::kB + Shape::kS + warp * Shape::kRows * 4);
  float weight_scale[8][2], row_scale[M_TILES][2];
#pragma unroll
  for (int j = 0; j < 8; j++)
#pragma unroll
    for (int e = 0; e < 2; e++) weight_scale[j][e] = scales[w8a8_scale_position(lane, j, e)];
#pragma unroll
  for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++) row_scale[mt][h] = x_scales[16 * mt + g + 8 * h];
  uint32_t a[M_TILES][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; mt++) {
    const int row = 16 * mt + lane % 16, chunk = 2 * warp + lane / 16;
    ldmatrix_x4(a[mt], stage + row * Shape::kARow + ((chunk ^ (row % 8)) * 16));
  }
  const uint8_t* tile = stage + Shape::kA + warp * Shape::kTileBytes;
#pragma unroll
  for (int c = 0; c < 4; c++) {
    const uint4 chunk = *reinterpret_cast<const uint4*>(tile + 512 * c + 16 * lane);
    const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int pair_word = 0; pair_word < 2; pair_word++) {
      const int j = fp8_word_block(c, 2 * pair_word);  // words 2 pw (b0) and 2 pw + 1 (b1)
#pragma unroll
      for (int mt = 0; mt < M_TILES; mt++) {
        float d[4];
        mma_16832_e4m3(d, a[mt], words[2 * pair_word], words[2 * pair_word + 1]);
#pragma unroll
        for (int e = 0; e < 4; e++) acc[mt][j][e] += d[e] * (row_scale[mt][e / 2] * weight_scale[j][e % 2]);
      }
    }
  }
}

// Whether the target being compiled has e4m3 tensor cores (sm_89+). The host pass (no __CUDA_ARCH__) says yes;
// it compiles no kernel bodies.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kFp8TensorCores = false;
#else
constexpr bool kFp8TensorCores = true;
#endif

// The skeleton: fetch -> (wait, fetch ahead, step) per stage -> sum the warps -> store or split-K fix-up.
template <QgFormat F, class T, int M_TILES, bool kFp32Scales>
__device__ __forceinline__ void quant_gemm_body(const QuantGemmArgs& args);

//   F: format; T: activation dtype (bf16/f16: the mma type for A16; W8A8 is instantiated with bf16 only and
//   stores args.out_dtype); M_TILES: 16-row mma tiles per block (1, 2, 4); kFp32Scales: A16 with one of the fp32
//   scale products (scaled_pair; an instance of its own, as the GEMVs', so the common pair_multiply path carries
//   none of it).
// W8A8 on targets without e4m3 tensor cores compiles to a trap (the host never launches it there), which keeps
// those targets' compile time down.
template <QgFormat F, class T, int M_TILES, bool kFp32Scales>
__global__ void __launch_bounds__(QgShape<F, M_TILES>::kThreads) quant_gemm_kernel(const QuantGemmArgs args) {
  kernel_entry();
  if constexpr (F == QgFormat::fp8_a8 && !kFp8TensorCores) __trap();
  else quant_gemm_body<F, T, M_TILES, kFp32Scales>(args);
}

template <QgFormat F, class T, int M_TILES, bool kFp32Scales>
__device__ __forceinline__ void quant_gemm_body(const QuantGemmArgs& args) {
  using Shape = QgShape<F, M_TILES>;
  extern __shared__ __align__(16) uint8_t qg_smem[];
  __shared__ int last_arrival;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t m0 = int64_t(blockIdx.x) * Shape::kRows, n_tile = blockIdx.y, split = blockIdx.z;
  const int64_t rows_here = args.rows - m0 < Shape::kRows ? args.rows - m0 : Shape::kRows;
  int64_t s_begin, s_end;
  quant_split_range(args.stages, args.splits, split, &s_begin, &s_end);
  const uint64_t policy = l2_evict_first();

  // ---- phase 1: the pipeline, kStages - 1 stages ahead (a commit per stage, empty ones too, keeps the
  // group count in step with the stage count)
  float acc[M_TILES][8][4];
#pragma unroll
  for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[mt][j][e] = 0.0f;
#pragma unroll
  for (int i = 0; i < Shape::kStages - 1; i++) {
    if (s_begin + i < s_end)
      qg_fetch_stage<F, M_TILES>(args, qg_smem + i * Shape::kStage, s_begin + i, m0, rows_here, n_tile, policy);
    cp_async_commit();
  }
  // ring buffer slots as 32-bit counters (no 64-bit modulo per stage): `slot` holds stage s, the slot before it
  // (mod kStages) is where stage s + kStages - 1 goes
  int slot = 0;
  for (int64_t s = s_begin; s < s_end; s++) {
    cp_async_wait<Shape::kStages - 2>();  // stage s has landed
    __syncthreads();                      // ... for every thread, and stage s - 1's buffer is free
    const int64_t ahead = s + Shape::kStages - 1;
    const int ahead_slot = slot == 0 ? Shape::kStages - 1 : slot - 1;
    if (ahead < s_end)
      qg_fetch_stage<F, M_TILES>(args, qg_smem + ahead_slot * Shape::kStage, ahead, m0, rows_here, n_tile, policy);
    cp_async_commit();
    const uint8_t* stage = qg_smem + slot * Shape::kStage;
    slot = slot + 1 == Shape::kStages ? 0 : slot + 1;
    if constexpr (F == QgFormat::int4_a16) qg_step_int4<T, M_TILES, kFp32Scales>(args, stage, warp, lane, acc);
    else if constexpr (F == QgFormat::fp8_a16) qg_step_fp8_a16<T, M_TILES, kFp32Scales>(args, stage, warp, lane, acc);
    else qg_step_fp8_a8<M_TILES>(args, stage, warp, lane, acc);
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- phase 2: sum the warps (a tree over halves, in shared memory laid out [slot][value][lane])
  float* reduce = reinterpret_cast<float*>(qg_smem);
  for (int half = Shape::kWarps / 2; half >= 1; half /= 2) {
    if (warp >= half && warp < 2 * half) {
      float* slot = reduce + (warp - half) * Shape::kAccFloats * 32;
#pragma unroll
      for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
          for (int e = 0; e < 4; e++) slot[((mt * 8 + j) * 4 + e) * 32 + lane] = acc[mt][j][e];
    }
    __syncthreads();
    if (warp < half) {
      const float* slot = reduce + warp * Shape::kAccFloats * 32;
#pragma unroll
      for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
          for (int e = 0; e < 4; e++) acc[mt][j][e] += slot[((mt * 8 + j) * 4 + e) * 32 + lane];
    }
    __syncthreads();
  }
  // warp 0 holds the block's sums: C fragment element e of (mt, j) is row 16 mt + g + 8 (e / 2), column
  // 8 j + 2 q + e % 2
  float* tile = reinterpret_cast<float*>(qg_smem);
  if (warp == 0) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
      for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          tile[(16 * mt + lane / 4 + 8 * (e / 2)) * Shape::kTileStride + 8 * j + 2 * (lane % 4) + e % 2] = acc[mt][j][e];
  }
  __syncthreads();

  // ---- phase 3: store (+ bias), or leave a partial and let the last split of the column tile store
  const int64_t n0 = n_tile * kQuantTileN;
  if (args.splits == 1) {
    for (int i = threadIdx.x; i < rows_here * kQuantTileN; i += Shape::kThreads) {
      const int r = i / int(kQuantTileN), c = i % int(kQuantTileN);
      if (n0 + c < args.n)
        qg_store<F, T>(args, (m0 + r) * args.out_stride + n0 + c, tile[r * Shape::kTileStride + c] + args.bias[n0 + c]);
    }
    return;
  }
  float* mine = args.partials + (uint64_t(n_tile * args.splits + split) * Shape::kRows) * kQuantTileN;
  for (int i = threadIdx.x; i < rows_here * kQuantTileN; i += Shape::kThreads)
    mine[i] = tile[(i / kQuantTileN) * Shape::kTileStride + i % kQuantTileN];
  __threadfence();  // this thread's partial is visible to the whole GPU before the counter moves
  __syncthreads();
  if (threadIdx.x == 0) {
    last_arrival = atomicAdd(&args.counters[n_tile], 1u) == unsigned(args.splits - 1);
    if (last_arrival) args.counters[n_tile] = 0;  // every split has arrived: ready for the next call
  }
  __syncthreads();
  if (!last_arrival) return;
  __threadfence();
  for (int i = threadIdx.x; i < rows_here * kQuantTileN; i += Shape::kThreads) {
    const int c = i % int(kQuantTileN);
    if (n0 + c >= args.n) continue;
    float sum = 0.0f;
    for (int64_t sp = 0; sp < args.splits; sp++)  // split order: the same sum whoever arrives last
      sum += __ldcg(args.partials + (uint64_t(n_tile * args.splits + sp) * Shape::kRows) * kQuantTileN + i);
    qg_store<F, T>(args, (m0 + i / kQuantTileN) * args.out_stride + n0 + c, sum + args.bias[n0 + c]);
  }
}

// ---- the decode GEMV: a few rows, the weights streamed once through registers ---------------------------------
// At decode's few rows the mma kernel spends a 16-row tensor-core step on one row and stages every byte through
// shared memory: measured at 18-30% of copy bandwidth on an H100 at M = 1; this kernel reads W4A16 at 26-73%
// (1.4-2.5x faster; bench/RESULTS.md, 2026-11-26; quant_gemv_mma_kernel below is its tensor-core form). It
// reads the same tiles straight from device memory into registers: each warp streams a contiguous run of its
// column tile's k tiles (16 bytes per lane, a warp's 512 B / 2 KiB coalesced, kGemvUnroll tiles in flight),
// dequantizes each pair exactly as the mma kernel does (scaled_pair: one rounding to T), and accumulates
// fp32 FMAs against the activations, which every warp of the GPU reads and L1 keeps. Sums: the four lanes of a
// column (shuffles), the warps (shared memory, warp order), the splits (the mma kernel's partials and counters,
// split order), so the result does not depend on timing.
//
//   grid = (1, column tiles, splits); block = kGemvWarps warps; warp w <- tiles [t0 + w L, t0 + (w + 1) L) of the
//   split's run; lane (g, q) <- columns 8j + g (j = 0..7) at the k of its fragment slots.
constexpr int kGemvWarps = 8;
constexpr int kGemvUnroll = 4;
// W4A16 tiles in flight a lane (GemvShape<int4_a16>::kUnroll): 4, 64 bytes; a build-time knob like
// KVLITE_GEMV_MIN_BLOCKS, for a device call to time 8 against 4 (tools/build-gpu-variant.sh): with the instructions
// cut (bench/RESULTS.md, 2026-11-27) the kernel's top stall became waiting on memory, and at 8 gemv_mma holds 125
// registers, no spill (ptxas, sm_90), still 2 blocks an SM. FP8 tiles are 4x larger and keep 4.
#ifndef KVLITE_GEMV_INT4_UNROLL
#define KVLITE_GEMV_INT4_UNROLL 4
#endif
// Blocks an SM both GEMVs are compiled for (__launch_bounds__'s second argument; 1 lets ptxas take the registers it
// wants). A build-time knob so that a device call can time a library built with another value against this one:
// `-DKVLITE_GEMV_MIN_BLOCKS=3` (bench/RESULTS.md, 2026-11-27).
#ifndef KVLITE_GEMV_MIN_BLOCKS
#define KVLITE_GEMV_MIN_BLOCKS 1
#endif
constexpr int kGemvMinBlocks = KVLITE_GEMV_MIN_BLOCKS;
// Tiles of each lane's shared-memory ring (gemv_stream_tiles), per format; 0 streams through registers instead
// (gemv_load_tiles: kUnroll tiles loaded, then used, then the next kUnroll loaded). Build-time knobs, timed on an
// H200 (bench/RESULTS.md, 2026-11-27 H200): FP8 (2 KB tiles) gains from a ring of 4: its FMA GEMV drops from 117
// to 72 registers (3 blocks an SM) and keeps 3 tiles in flight through the math -- M = 1 Linears 1-23% faster,
// Qwen3-VL-4B FP8 decode 199 -> 208 tok/s; W4A16 (512-byte tiles, one mma each) loses with any ring (8: 10-25%
// slower; 16: more), the ring's copy, commit, wait and shared load costing more in its issue-bound loop than the
// loads in flight give back, so int4 keeps the registers.
// fp8 tiles a batch of the tensor-core GEMV (gemv_mma_run; registers: 16 a tile for the weights, 4 for the A
// fragments at M <= 8). W4A16's batch is KVLITE_GEMV_INT4_UNROLL.
#ifndef KVLITE_GEMV_FP8_MMA_UNROLL
#define KVLITE_GEMV_FP8_MMA_UNROLL 2
#endif
#ifndef KVLITE_GEMV_INT4_RING
#define KVLITE_GEMV_INT4_RING 0
#endif
// 1: the int4 dequantization for cuBLAS (prefill's W4A16 path, dequantize_tiles_kernel) reads each thread's scales
// and zero points once a tile instead of once a weight, for a device call to time as a variant
// (tools/build-gpu-variant.sh dequant -DKVLITE_DEQUANT_TILE_GROUPS=1) before the default changes: the H200 measured
// the dequantization at ~0.6 TB/s, longer than cuBLAS's BF16 GEMM after it (bench/RESULTS.md, 2026-12-04).
#ifndef KVLITE_DEQUANT_TILE_GROUPS
#define KVLITE_DEQUANT_TILE_GROUPS 0
#endif
#ifndef KVLITE_GEMV_FP8_RING
#define KVLITE_GEMV_FP8_RING 4
#endif

// Activation pairs of one row at a tile crossing k_valid: columns k, k + 1 (k even) as floats, zero at and past
// k_valid. (A tile below k_valid, nearly every one, takes a plain load instead: the callers test that per tile.)
template <class T>
__device__ __forceinline__ float2 gemv_x_pair(const T* row, uint32_t k, uint32_t k_valid) {
  if (k + 1 < k_valid) return pair_to_float2<T>(__ldg(reinterpret_cast<const unsigned*>(row + k)));
  if (k < k_valid) return make_float2(to_float(row[k]), 0.0f);
  return make_float2(0.0f, 0.0f);
}

// The same pair as raw T bits (k even), for an mma A fragment: zero bits (+0) at and past k_valid.
template <class T>
__device__ __forceinline__ uint32_t gemv_x_bits(const T* row, uint32_t k, uint32_t k_valid) {
  if (k + 1 < k_valid) return __ldg(reinterpret_cast<const unsigned*>(row + k));
  if (k < k_valid) return uint32_t(__ldg(reinterpret_cast<const unsigned short*>(row) + k));
  return 0u;
}

// One A fragment of the tensor-core GEMV: a[0], a[2] <- row_low at k and k + step; a[1], a[3] <- row_high at the
// same k (kHigh; else zero bits: no lane has a row g + 8); zero bits for a row the lane does not have (its mask 0).
// Plain loads, for a tile below k_valid (all but a row's last batch): the caller points a lane's missing rows at
// row 0, so the loads need neither bounds nor branches -- the bounds-checked form (gemv_a_fragment_edge: three
// cases a load, each behind the lane's row test) cost ~40 instructions a W4A16 tile of the ~170 ncu counted (H100,
// 2026-11-27). `low` / `high` are the rows at the batch's first k, `at` the fragment's offset from it.
template <class T, bool kHigh>
__device__ __forceinline__ void gemv_a_fragment(const T* low, const T* high, uint32_t low_mask, uint32_t high_mask,
                                                uint32_t at, uint32_t step, uint32_t (&a)[4]) {
  a[0] = __ldg(reinterpret_cast<const unsigned*>(low + at)) & low_mask;
  a[2] = __ldg(reinterpret_cast<const unsigned*>(low + at + step)) & low_mask;
  a[1] = kHigh ? __ldg(reinterpret_cast<const unsigned*>(high + at)) & high_mask : 0u;
  a[3] = kHigh ? __ldg(reinterpret_cast<const unsigned*>(high + at + step)) & high_mask : 0u;
}
// The same at k of a row's last batch: zero bits at and past k_valid.
template <class T>
__device__ __forceinline__ void gemv_a_fragment_edge(const T* row_low, const T* row_high, uint32_t low_mask,
                                                     uint32_t high_mask, uint32_t k, uint32_t step, uint32_t k_valid,
                                                     uint32_t (&a)[4]) {
  a[0] = low_mask ? gemv_x_bits<T>(row_low, k, k_valid) : 0u;
  a[1] = high_mask ? gemv_x_bits<T>(row_high, k, k_valid) : 0u;
  a[2] = low_mask ? gemv_x_bits<T>(row_low, k + step, k_valid) : 0u;
  a[3] = high_mask ? gemv_x_bits<T>(row_high, k + step, k_valid) : 0u;
}

template <QgFormat F>
struct GemvShape {
  static constexpr int kTileK = F == QgFormat::int4_a16 ? 16 : 32;
  static constexpr int kChunks = F == QgFormat::int4_a16 ? 1 : 4;  // 16-byte chunks per lane per tile
  static constexpr int kTileBytes = 512 * kChunks;
  static constexpr int kTilesPerStage = int(kQuantStageK) / kTileK;
  static constexpr int kUnroll = F == QgFormat::int4_a16 ? KVLITE_GEMV_INT4_UNROLL : kGemvUnroll;  // tiles in flight
  // the shared-memory ring: tiles a lane keeps (0: none, registers), and the block's dynamic shared memory for it
  static constexpr int kRingTiles = F == QgFormat::int4_a16 ? KVLITE_GEMV_INT4_RING : KVLITE_GEMV_FP8_RING;
  static constexpr int kRingBytes = kGemvWarps * kRingTiles * kTileBytes;
  // a warp's run of tiles starts at a multiple of this (stage starts are multiples of kTilesPerStage)
  static constexpr int kMmaUnroll = F == QgFormat::int4_a16 ? kUnroll : KVLITE_GEMV_FP8_MMA_UNROLL;
  static constexpr int kRunAlign = kMmaUnroll;
  static_assert(kTilesPerStage % kRunAlign == 0, "a split's first tile is a multiple of the run alignment");
  static_assert(kRingTiles == 0 || kRingTiles >= 2, "a ring holds the tile in use and at least one in flight");
  static_assert(kUnroll >= 1, "registers: at least one tile at a time");
};

// The 8 scale-table entries from `base` (a multiple of 8) as floats: one or two 16-byte loads.
__device__ __forceinline__ void gemv_load_scales(const QuantGemmArgs& args, uint64_t base, float (&scales)[8]) {
  if (args.scale_bytes == 4) {
    const float4 low = __ldg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(args.scales) + base));
    const float4 high = __ldg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(args.scales) + base + 4));
    scales[0] = low.x, scales[1] = low.y, scales[2] = low.z, scales[3] = low.w;
    scales[4] = high.x, scales[5] = high.y, scales[6] = high.z, scales[7] = high.w;
  } else {
    const uint4 bits = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(args.scales) + base));
    const uint32_t words[4] = {bits.x, bits.y, bits.z, bits.w};
    // one test for the 8 (warp-uniform), not one a scale: ptxas kept the per-element form as 8 branches, and the
    // f16 conversion in hardware (exact, as f16_to_float) rather than base.hpp's portable bit code
    if (args.scale_dtype == DType::BF16) {
#pragma unroll
      for (int j = 0; j < 8; j++) scales[j] = __uint_as_float((words[j / 2] >> (16 * (j % 2))) << 16);
    } else {
#pragma unroll
      for (int j = 0; j < 8; j++)
        scales[j] = __half2float(__ushort_as_half(uint16_t(words[j / 2] >> (16 * (j % 2)))));
    }
  }
}

// The lane's 8 scale registers (scale_register: T pairs, or floats for kFp32Scales) and int4 subtrahends of
// `group`: table positions 8g .. 8g + 7.
template <QgFormat F, class T, bool kFp32Scales>
__device__ __forceinline__ void gemv_group_tables(const QuantGemmArgs& args, uint32_t group, int g,
                                                  uint32_t (&scale2)[8], uint32_t (&subtrahend2)[8]) {
  constexpr bool kBf16 = Pair2<T>::kBf16;
  const uint64_t base = uint64_t(group) * uint64_t(args.n_pad) + uint64_t(blockIdx.y) * kQuantTileN + 8 * g;
  // The lane's 8 scales and zero points are contiguous (positions 8g .. 8g + 7; base is a multiple of 8 since n_pad
  // is of 64) and aligned (upload_quant_weight takes only 256-byte aligned memory, and the layout's tables start at
  // 256-byte offsets), so they come as one or two 16-byte loads and one 8-byte load, not 16 loads each behind a
  // dtype branch (which, with the A fragments' bounds tests, made a W4A16 tile ~170 instructions; see gemv_a_fragment).
  float scales[8];
  gemv_load_scales(args, base, scales);
  uint32_t zero_bytes[2] = {0x08080808u, 0x08080808u};  // symmetric: zero point 8
  if (F == QgFormat::int4_a16 && args.zeros != nullptr) {
    const uint2 z = __ldg(reinterpret_cast<const uint2*>(args.zeros + base));
    zero_bytes[0] = z.x, zero_bytes[1] = z.y;
  }
#pragma unroll
  for (int j = 0; j < 8; j++) {
    const float scale = scales[j];
    if constexpr (F == QgFormat::int4_a16) {
      scale2[j] = scale_register<T, kFp32Scales>(scale);
      const uint32_t zero = (zero_bytes[j / 4] >> (8 * (j % 4))) & 0xffu;
      subtrahend2[j] = int4_subtrahend_bits(zero, int4_magic(kBf16)) * 0x10001u;
    } else {
      scale2[j] = scale_register<T, kFp32Scales>(fp8_folded_scale(scale, kBf16));
      subtrahend2[j] = 0;
    }
  }
}

// One tile of one lane into acc[row][j]: int4 -- word w, pair p feeds block j = 2w + p/2 at k = 2q + 8 (p % 2)
// + {0, 1}; fp8 -- chunk c, word i, pair p feeds block j = 2c + i/2 at k = 16 (i % 2) + 4q + 2p + {0, 1}.
// x[row][s]: the activation pairs of the lane's slots s (int4: s = register r; fp8: s = 2 r + p).
template <QgFormat F, class T, int R, bool kFp32Scales>
__device__ __forceinline__ void gemv_tile(const uint4 (&chunks)[GemvShape<F>::kChunks], const float2 (&x)[R][4],
                                          const uint32_t (&scale2)[8], const uint32_t (&subtrahend2)[8],
                                          ScaleProduct mode, float (&acc)[R][8]) {
  constexpr bool kBf16 = Pair2<T>::kBf16;
#pragma unroll
  for (int c = 0; c < GemvShape<F>::kChunks; c++) {
    const uint32_t words[4] = {chunks[c].x, chunks[c].y, chunks[c].z, chunks[c].w};
#pragma unroll
    for (int w = 0; w < 4; w++) {
      if constexpr (F == QgFormat::int4_a16) {
#pragma unroll
        for (int p = 0; p < 4; p++) {
          const int j = int4_pair_block(w, p), r = int4_pair_register(p);
          const float2 v = pair_to_float2<T>(scaled_pair<T, kFp32Scales>(
              pair_sub<T>(int4_pair_bits(words[w], p, int4_magic(kBf16)), subtrahend2[j]), scale2[j], mode));
#pragma unroll
          for (int m = 0; m < R; m++) acc[m][j] = fmaf(v.y, x[m][r].y, fmaf(v.x, x[m][r].x, acc[m][j]));
        }
      } else {
        const int j = fp8_word_block(c, w), r = fp8_word_register(w);
        const uint32_t ordered = fp8_pair_order(words[w]);
#pragma unroll
        for (int p = 0; p < 2; p++) {
          const float2 v = pair_to_float2<T>(scaled_pair<T, kFp32Scales>(fp8_pair_bits(ordered, p, kBf16), scale2[j], mode));
#pragma unroll
          for (int m = 0; m < R; m++) acc[m][j] = fmaf(v.y, x[m][2 * r + p].y, fmaf(v.x, x[m][2 * r + p].x, acc[m][j]));
        }
      }
    }
  }
}

// The end of both GEMVs: warp_sums[w][m][c] holds warp w's sums for rows m < args.rows and the block's column tile;
// they are added in warp order, then stored with the bias (one split) or, split-K, written as this split's partial
// into the mma kernel's [n_tile][splits][16 rows][64] layout, and the block that arrives last at the column tile's
// counter adds the splits in split order and stores (so the result does not depend on timing).
template <QgFormat F, class T, int R>
__device__ __forceinline__ void gemv_finish(const QuantGemmArgs& args, float (&warp_sums)[kGemvWarps][R][kQuantTileN],
                                            int* last_arrival) {
  const int64_t n_tile = blockIdx.y, split = blockIdx.z;
  const int rows = int(args.rows);
  __syncthreads();

  const int64_t n0 = n_tile * kQuantTileN;
  const int outputs = rows * int(kQuantTileN);
  if (args.splits == 1) {
    for (int i = threadIdx.x; i < outputs; i += kGemvWarps * 32) {
      const int m = i / int(kQuantTileN), c = i % int(kQuantTileN);
      if (n0 + c >= args.n) continue;
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; w++) sum += warp_sums[w][m][c];
      qg_store<F, T>(args, m * args.out_stride + n0 + c, sum + args.bias[n0 + c]);
    }
    return;
  }
  // split-K: the mma kernel's partials ([n_tile][splits][16 rows][64]) and counters
  float* mine = args.partials + (uint64_t(n_tile * args.splits + split) * 16) * kQuantTileN;
  for (int i = threadIdx.x; i < outputs; i += kGemvWarps * 32) {
    const int m = i / int(kQuantTileN), c = i % int(kQuantTileN);
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kGemvWarps; w++) sum += warp_sums[w][m][c];
    mine[i] = sum;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    *last_arrival = atomicAdd(&args.counters[n_tile], 1u) == unsigned(args.splits - 1);
    if (*last_arrival) args.counters[n_tile] = 0;
  }
  __syncthreads();
  if (!*last_arrival) return;
  __threadfence();
  for (int i = threadIdx.x; i < outputs; i += kGemvWarps * 32) {
    const int c = i % int(kQuantTileN);
    if (n0 + c >= args.n) continue;
    float sum = 0.0f;
    for (int64_t sp = 0; sp < args.splits; sp++)
      sum += __ldcg(args.partials + (uint64_t(n_tile * args.splits + sp) * 16) * kQuantTileN + i);
    qg_store<F, T>(args, (i / kQuantTileN) * args.out_stride + n0 + c, sum + args.bias[n0 + c]);
  }
}


// The run of k tiles warp `warp` of a GEMV block streams: its share of the block's split (tile t covers device
// columns [kTileK t, kTileK (t + 1))), [*t_begin, *t_end).
template <QgFormat F>
__device__ __forceinline__ void gemv_warp_tiles(const QuantGemmArgs& args, int warp, int64_t* t_begin,
                                                int64_t* t_end) {
  using Shape = GemvShape<F>;
  int64_t s_begin, s_end;
  quant_split_range(args.stages, args.splits, blockIdx.z, &s_begin, &s_end);
  const int64_t split_tiles = (s_end - s_begin) * Shape::kTilesPerStage;
  // whole batches a warp (gemv_mma_run: a batch then never straddles a group whose size is a multiple of its k)
  const int64_t per_warp = (split_tiles + kGemvWarps * Shape::kRunAlign - 1) / (kGemvWarps * Shape::kRunAlign) * Shape::kRunAlign;
  *t_begin = s_begin * Shape::kTilesPerStage + warp * per_warp;
  const int64_t split_end = s_end * Shape::kTilesPerStage;
  *t_end = *t_begin + per_warp < split_end ? *t_begin + per_warp : split_end;
}

// Shape::kUnroll tiles from t0 on, the lane's 16-byte chunks of each, all in flight before any is used (streamed:
// read once, kept out of L1); zeros past t_end.
template <QgFormat F>
__device__ __forceinline__ void gemv_load_tiles(const uint8_t* tiles, int64_t t0, int64_t t_end,
                                                uint4 (&chunks)[GemvShape<F>::kUnroll][GemvShape<F>::kChunks]) {
  using Shape = GemvShape<F>;
#pragma unroll
  for (int u = 0; u < Shape::kUnroll; u++)
#pragma unroll
    for (int c = 0; c < Shape::kChunks; c++)
      chunks[u][c] = t0 + u < t_end ? __ldcs(reinterpret_cast<const uint4*>(tiles + uint64_t(t0 + u) * Shape::kTileBytes + 512 * c))
                                    : make_uint4(0, 0, 0, 0);
}

// One 16-byte shared-memory load, as an asm statement so that the compiler keeps it in order with the ring's
// cp.async statements (the slot it reads is refilled one tile later by the same lane).
__device__ __forceinline__ uint4 gemv_ring_load(const uint4* shared) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}

// The warp's tiles [t_begin, t_end), in order, each as the lane's Shape::kChunks 16-byte chunks, through
// tile_fn(t, chunks). tiles: the column tile's first tile, plus the lane's 16 bytes.
// Registers (kRingTiles 0): kUnroll tiles loaded, then used. Ring (kRingTiles D): each lane streams its own chunks
// into a private ring of D slots in shared memory with cp.async, D - 1 tiles ahead of the one in use, so that loads
// stay in flight during the math without registers to hold them; a lane reads only what it copied itself, so the
// ring needs no barrier, only cp.async.wait_group. Slot of tile t: (t - t_begin) % D; the copy into a slot is issued
// one tile after the slot was read (program order keeps the read first; the copy lands a memory latency later).
template <QgFormat F, class TileFn>
__device__ __forceinline__ void gemv_stream_tiles(const uint8_t* tiles, int64_t t_begin, int64_t t_end, TileFn&& tile_fn) {
  using Shape = GemvShape<F>;
  constexpr int C = Shape::kChunks;
  if constexpr (Shape::kRingTiles == 0) {
    for (int64_t t0 = t_begin; t0 < t_end; t0 += Shape::kUnroll) {
      uint4 chunks[Shape::kUnroll][C];
      gemv_load_tiles<F>(tiles, t0, t_end, chunks);
#pragma unroll
      for (int u = 0; u < Shape::kUnroll; u++) {
        if (t0 + u >= t_end) break;
        tile_fn(t0 + u, chunks[u]);
      }
    }
  } else {
    constexpr int D = Shape::kRingTiles;
    extern __shared__ uint4 gemv_ring[];  // [warps][D slots][C chunks][32 lanes]
    uint4* ring = gemv_ring + (threadIdx.x / 32) * (D * C * 32) + threadIdx.x % 32;
    const uint64_t policy = l2_evict_first();  // read once
    // tile t into `slot` (nothing past t_end), then one commit either way: group i is always tile t_begin + i
    auto fetch = [&](int slot, int64_t t) {
      if (t < t_end)
#pragma unroll
        for (int c = 0; c < C; c++)
          cp_async_16_evict_first(ring + (slot * C + c) * 32, tiles + uint64_t(t) * Shape::kTileBytes + 512 * c, policy);
      cp_async_commit();
    };
#pragma unroll
    for (int slot = 0; slot < D - 1; slot++) fetch(slot, t_begin + slot);
    for (int64_t t0 = t_begin; t0 < t_end; t0 += D) {
#pragma unroll
      for (int u = 0; u < D; u++) {
        const int64_t t = t0 + u;
        if (t >= t_end) break;
        fetch((u + D - 1) % D, t + D - 1);  // the slot tile t - 1 was read from
        cp_async_wait<D - 1>();             // tile t's group has landed
        uint4 chunks[C];
#pragma unroll
        for (int c = 0; c < C; c++) chunks[c] = gemv_ring_load(ring + (u * C + c) * 32);
        tile_fn(t, chunks);
      }
    }
    cp_async_wait<0>();
  }
}

// One batch of the tensor-core GEMV (gemv_mma_run): the lane's 16-byte chunks of U tiles and each k16 step's A
// fragment (a0 / a1 rows g / g + 8 at its first k pair, a2 / a3 at the second), all loaded before any is used.
template <QgFormat F>
struct GemvBatch {
  static constexpr bool kInt4 = F == QgFormat::int4_a16;
  static constexpr int U = GemvShape<F>::kMmaUnroll, C = GemvShape<F>::kChunks, S = kInt4 ? 1 : 2;  // S: k16 steps a tile
  uint4 w[U][C];
  uint32_t a[U][S][1][4];
};
// Tiles [t0, t0 + U) of the warp's run (zeros past t_end) and their A fragments from the lane's rows (zero bits at
// and past k_valid).
template <QgFormat F, class T, bool kHigh>
__device__ __forceinline__ void gemv_load_batch(const uint8_t* tiles, uint32_t t0, uint32_t t_end, uint32_t k_valid,
                                                const T* row_low, const T* row_high, uint32_t low_mask,
                                                uint32_t high_mask, int q, GemvBatch<F>& b) {
  using Shape = GemvShape<F>;
  using Batch = GemvBatch<F>;
  constexpr int U = Batch::U, C = Batch::C, S = Batch::S;
  constexpr uint32_t kTileK = Shape::kTileK;
  // within a step: the A fragment's second pair of k (a2, a3) sits `kPairStep` columns after the first
  constexpr uint32_t kPairStep = Batch::kInt4 ? 8 : 2;
  const uint8_t* w = tiles + uint64_t(t0) * uint64_t(Shape::kTileBytes);
#pragma unroll
  for (int u = 0; u < U; u++)
#pragma unroll
    for (int c = 0; c < C; c++)
      b.w[u][c] = t0 + u < t_end ? __ldcs(reinterpret_cast<const uint4*>(w + Shape::kTileBytes * u + 512 * c))
                                 : make_uint4(0, 0, 0, 0);
  const uint32_t k0 = kTileK * t0 + (Batch::kInt4 ? 2 * q : 4 * q);  // the first step's first pair in tile t0
  if (kTileK * (t0 + U) <= k_valid) {  // warp-uniform, all but a row's last batch: plain loads, no bounds
    const T* low = row_low + k0;
    const T* high = row_high + k0;
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int s = 0; s < S; s++)
        gemv_a_fragment<T, kHigh>(low, high, low_mask, high_mask, kTileK * u + 16 * s, kPairStep, b.a[u][s][0]);
  } else {
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int s = 0; s < S; s++)
        gemv_a_fragment_edge<T>(row_low, row_high, low_mask, high_mask, k0 + kTileK * u + 16 * s, kPairStep,
                                k_valid, b.a[u][s][0]);
  }
}

// The tensor-core GEMV's loop: the warp's tiles [t_begin, t_end) in batches of U (GemvShape::kMmaUnroll), each
// batch's weight chunks and A fragments all loaded before any is used, then its U tiles' math with no branch
// between them. The SASS of the per-tile form (gemv_stream_tiles' tile_fn) showed why it is needed: each tile's A
// fragment was loaded behind the tile's group test and `whole` branch, after the previous tile's math, so every tile
// waited out an L1 round trip of its own (and ~70 branches a W4A16 batch of 4). Here the group test is one a batch
// where a group spans whole batches (kAlignedGroups: group_size a multiple of U tiles' k; gemv_warp_tiles starts
// every run at a multiple of U), one a tile otherwise; kHigh: rows past 8, whose A rows g + 8 are loaded (else zero
// registers). int4: one k16 step a tile (A: rows g, g + 8 at k 2q, 2q + 1 and 2q + 8, 2q + 9); fp8: two k16 steps
// a k32 tile (A: slots 2q, 2q + 1 <- k 4q, 4q + 1 and 2q + 8, 2q + 9 <- k 4q + 2, 4q + 3, as qg_step_fp8_a16).
// KVLITE_GEMV_INT4_PREFETCH=1 (W4A16 only, a build knob): the next batch's loads issued before this batch's math
// (two batches of registers; measured slower, bench/RESULTS.md 2026-11-27 third session). The same operations on the same values as int4_tile_mma / fp8_a16_step_mma per tile: the
// bits of the per-tile form.
#ifndef KVLITE_GEMV_INT4_PREFETCH
#define KVLITE_GEMV_INT4_PREFETCH 0
#endif
template <QgFormat F, class T, bool kFp32Scales, bool kHigh, bool kAlignedGroups>
__device__ __forceinline__ void gemv_mma_run(const QuantGemmArgs& args, const uint8_t* tiles, uint32_t t_begin,
                                             uint32_t t_end, const T* row_low, const T* row_high, uint32_t low_mask,
                                             uint32_t high_mask, int g, int q, float (&acc)[1][8][4]) {
  using Shape = GemvShape<F>;
  using Batch = GemvBatch<F>;
  constexpr bool kInt4 = F == QgFormat::int4_a16;
  constexpr int U = Batch::U, S = Batch::S;
  constexpr uint32_t kTileK = Shape::kTileK;
  const uint32_t k_valid = uint32_t(args.k_valid), group_size = uint32_t(args.group_size);
  uint32_t scale2[8], subtrahend2[8];
  uint32_t group = 0xffffffffu;  // the group whose tables the registers hold
  auto load = [&](uint32_t t0, Batch& b) {
    gemv_load_batch<F, T, kHigh>(tiles, t0, t_end, k_valid, row_low, row_high, low_mask, high_mask, q, b);
  };
  auto tables_for = [&](uint32_t t) {
    const uint32_t tile_group = quant_group_of(kTileK * t, group_size, args.group_shift);
    if (tile_group != group) {  // warp-uniform
      group = tile_group;
      gemv_group_tables<F, T, kFp32Scales>(args, group, g, scale2, subtrahend2);
    }
  };
  auto math = [&](uint32_t t0, const Batch& b) {
    if (kAlignedGroups) tables_for(t0);
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (t0 + u >= t_end) break;  // warp-uniform: the run's last batch
      if (!kAlignedGroups) tables_for(t0 + u);
      if constexpr (kInt4) {
        int4_tile_mma<T, 1, kFp32Scales>(b.w[u][0], b.a[u][0], scale2, subtrahend2, args.scale_product, acc);
      } else {
#pragma unroll
        for (int s = 0; s < S; s++) fp8_a16_step_mma<T, 1, kFp32Scales>(b.w[u], s, b.a[u][s], scale2, args.scale_product, acc);
      }
    }
  };
  if (kInt4 && KVLITE_GEMV_INT4_PREFETCH) {
    Batch even, odd;
    if (t_begin < t_end) load(t_begin, even);
    for (uint32_t t0 = t_begin; t0 < t_end; t0 += 2 * U) {
      if (t0 + U < t_end) load(t0 + U, odd);
      math(t0, even);
      if (t0 + U >= t_end) break;
      if (t0 + 2 * U < t_end) load(t0 + 2 * U, even);
      math(t0 + U, odd);
    }
  } else {
    for (uint32_t t0 = t_begin; t0 < t_end; t0 += U) {
      Batch b;
      load(t0, b);
      math(t0, b);
    }
  }
}

//   F: int4_a16 or fp8_a16; T: activation dtype; R: rows computed (args.rows <= R); kFp32Scales: args.scale_product
//   is one of the fp32 ones (scaled_pair; the host picks the instance).
template <QgFormat F, class T, int R, bool kFp32Scales>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvMinBlocks) quant_gemv_kernel(const QuantGemmArgs args) {
  kernel_entry();
  using Shape = GemvShape<F>;
  __shared__ float warp_sums[kGemvWarps][R][kQuantTileN];
  __shared__ int last_arrival;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int rows = int(args.rows);
  int64_t t_begin, t_end;
  gemv_warp_tiles<F>(args, warp, &t_begin, &t_end);
  const uint8_t* tiles = args.tiles + uint64_t(blockIdx.y) * args.tile_row_bytes + 16 * lane;
  const T* x = static_cast<const T*>(args.x);
  const uint32_t k_valid = uint32_t(args.k_valid), group_size = uint32_t(args.group_size);

  float acc[R][8];
#pragma unroll
  for (int m = 0; m < R; m++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[m][j] = 0.0f;
  uint32_t scale2[8], subtrahend2[8];
  uint32_t group = 0xffffffffu;  // the group whose tables the registers hold
  gemv_stream_tiles<F>(tiles, t_begin, t_end, [&](int64_t t, const uint4 (&chunks)[Shape::kChunks]) {
    const uint32_t k0 = uint32_t(t) * uint32_t(Shape::kTileK);  // K_pad < 2^31 (checked at upload)
    const uint32_t tile_group = quant_group_of(k0, group_size, args.group_shift);
    if (tile_group != group) {  // warp-uniform: a run crosses a group every group_size / kTileK tiles
      group = tile_group;
      gemv_group_tables<F, T, kFp32Scales>(args, group, g, scale2, subtrahend2);
    }
    const bool whole = k0 + Shape::kTileK <= k_valid;
    float2 xs[R][4];
#pragma unroll
    for (int m = 0; m < R; m++) {
      const T* row = x + int64_t(m < rows ? m : 0) * args.x_stride;
#pragma unroll
      for (int s = 0; s < 4; s++) {
        // int4: slots 0, 1 <- k 2q, 2q + 8 (2, 3 unused); fp8: slot 2r + p <- k 16r + 4q + 2p
        const uint32_t k = F == QgFormat::int4_a16 ? k0 + 2 * q + 8 * s : k0 + 16 * (s / 2) + 4 * q + 2 * (s % 2);
        if (F == QgFormat::int4_a16 && s >= 2) {
          xs[m][s] = make_float2(0.0f, 0.0f);
        } else if (whole) {  // warp-uniform, nearly always: a plain load from the row (row 0 past args.rows)
          const float2 v = pair_to_float2<T>(__ldg(reinterpret_cast<const unsigned*>(row + k)));
          xs[m][s] = m < rows ? v : make_float2(0.0f, 0.0f);
        } else {
          xs[m][s] = m < rows ? gemv_x_pair<T>(row, k, k_valid) : make_float2(0.0f, 0.0f);
        }
      }
    }
    gemv_tile<F, T, R, kFp32Scales>(chunks, xs, scale2, subtrahend2, args.scale_product, acc);
  });

  // the four lanes of a column group (q = 0..3) hold parts of the same 8 columns
#pragma unroll
  for (int m = 0; m < R; m++)
#pragma unroll
    for (int j = 0; j < 8; j++) {
      acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], 1);
      acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], 2);
    }
  if (q == 0)
#pragma unroll
    for (int m = 0; m < R; m++)
#pragma unroll
      for (int j = 0; j < 8; j++) warp_sums[warp][m][8 * j + g] = acc[m][j];
  gemv_finish<F, T, R>(args, warp_sums, &last_arrival);
}

// Tensor-core GEMV (QuantKernel::gemv_mma): quant_gemv_kernel's streamed loads and group tables, with the mma
// kernel's tile math (int4_tile_mma, fp8_a16_step_mma) fed from registers: each tile's dequantized pairs are the B
// fragments of mma.m16n8k16 as they come, and the A fragment holds rows g and g + 8 of the activations, read from
// L1 (zeros for rows past args.rows). One mma per 8 columns x 16 k serves every row up to 16, where the FMA GEMV
// spends a conversion and 2 FMAs per pair and row; the fp32 sums are the tensor core's, as in the mma kernel.
// The tiles stream in batches (gemv_mma_run): measured on an H200 (bench/RESULTS.md, 2026-11-27, third session)
// W4A16 13-26% less time than the per-tile loop at M = 1 (Llama-3.1-8B gate_up 37.8 -> 28.7 us, 76% of copy), flat to
// M = 8; fp8 21-46% less time than gemv_a16 and mma_a16 at M = 1-16, so both formats' decode rows run here.
// Occupancy is not one launch bound away: __launch_bounds__(kGemvWarps * 32, 3) (3 blocks an SM, 80 registers)
// spills on sm_90 (ptxas, 2026-11-26: int4 88 B stored / 96 B loaded, fp8 388 / 416 B), and timed on an H100
// (KVLITE_GEMV_MIN_BLOCKS=3, 2026-11-27) it lost on the large shapes (gate_up 46 -> 50 us; Llama-3.1-8B W4A16
// decode 193 -> 179 tok/s), so 3 blocks an SM wants a kernel that holds fewer values live, not a tighter bound.
// Where its time goes (ncu, bench/RESULTS.md 2026-11-27): 106 instructions a 512-byte W4A16 tile (169, then 123,
// before gemv_a_fragment, the vector table loads and the batches), 123 registers (2 blocks an SM); the same grid and
// loads without the math stream at 87% of the read ceiling (bench/gemv_stream.cu). Neither the next batch's loads
// issued before this batch's math nor 8 W4A16 tiles a batch paid (152 / 168 registers; bounded to 2 blocks an SM,
// gate_up 33.7 / 29.8 us against 28.7). Nor did taking W4A16's subtract and scale out of the loop (the mma on the
// stored magic + u, s (P - (magic + z) X) applied once a group): timed on an H200 on 2026-12-04 it ran in the same
// time (Llama-3.1-8B gate_up 28.7 us against 28.8, lm_head 106.8 against 107.6) and its output was wrong: removed.
//   F: int4_a16 or fp8_a16; T: activation dtype; kFp32Scales as quant_gemv_kernel's; args.rows <=
//   kQuantGemvMmaMaxRows.
template <QgFormat F, class T, bool kFp32Scales>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvMinBlocks) quant_gemv_mma_kernel(const QuantGemmArgs args) {
  kernel_entry();
  using Shape = GemvShape<F>;
  constexpr int kRows = int(kQuantGemvMmaMaxRows);
  __shared__ float warp_sums[kGemvWarps][kRows][kQuantTileN];
  __shared__ int last_arrival;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int rows = int(args.rows);
  int64_t t_begin, t_end;
  gemv_warp_tiles<F>(args, warp, &t_begin, &t_end);
  const uint8_t* tiles = args.tiles + uint64_t(blockIdx.y) * args.tile_row_bytes + 16 * lane;
  const uint32_t group_size = uint32_t(args.group_size);
  // the lane's two activation rows (A fragment rows g and g + 8)
  const bool has_low = g < rows, has_high = g + 8 < rows;
  const T* x = static_cast<const T*>(args.x);
  const T* row_low = x + int64_t(has_low ? g : 0) * args.x_stride;
  const T* row_high = x + int64_t(has_high ? g + 8 : 0) * args.x_stride;
  const uint32_t low_mask = has_low ? ~0u : 0u, high_mask = has_high ? ~0u : 0u;
  const bool any_high = rows > 8;  // warp-uniform: no lane has a high row at M <= 8, whose loads are skipped

  float acc[1][8][4];
#pragma unroll
  for (int j = 0; j < 8; j++)
#pragma unroll
    for (int i = 0; i < 4; i++) acc[0][j][i] = 0.0f;
  // t < 2^27: K_pad < 2^31 (checked at upload), 16 or 32 columns a tile
  const uint32_t begin = uint32_t(t_begin), end = uint32_t(t_end);
  const bool aligned = group_size % (uint32_t(Shape::kTileK) * uint32_t(Shape::kMmaUnroll)) == 0;  // uniform
  if (any_high) {
    if (aligned) gemv_mma_run<F, T, kFp32Scales, true, true>(args, tiles, begin, end, row_low, row_high, low_mask, high_mask, g, q, acc);
    else gemv_mma_run<F, T, kFp32Scales, true, false>(args, tiles, begin, end, row_low, row_high, low_mask, high_mask, g, q, acc);
  } else {
    if (aligned) gemv_mma_run<F, T, kFp32Scales, false, true>(args, tiles, begin, end, row_low, row_high, low_mask, high_mask, g, q, acc);
    else gemv_mma_run<F, T, kFp32Scales, false, false>(args, tiles, begin, end, row_low, row_high, low_mask, high_mask, g, q, acc);
  }

  // C fragments: c0, c1 <- row g, columns 8j + 2q, 8j + 2q + 1; c2, c3 <- row g + 8, the same columns
#pragma unroll
  for (int j = 0; j < 8; j++) {
    warp_sums[warp][g][8 * j + 2 * q] = acc[0][j][0];
    warp_sums[warp][g][8 * j + 2 * q + 1] = acc[0][j][1];
    warp_sums[warp][g + 8][8 * j + 2 * q] = acc[0][j][2];
    warp_sums[warp][g + 8][8 * j + 2 * q + 1] = acc[0][j][3];
  }
  gemv_finish<F, T, kRows>(args, warp_sums, &last_arrival);
}

// ---- the kernels around the GEMMs ------------------------------------------------------------------------------

// Activations for the A16 kernels when they cannot be read in place (act-order, or rows not 16-byte
// aligned): dst [rows, k_pad] = x[:, perm] (or x), zeros past K. Bits are copied: T-agnostic.
__global__ void stage_activations_kernel(const uint16_t* x, int64_t x_stride, int64_t k,
                                         const int32_t* perm,  // [k_pad] or null
                                         uint16_t* dst, int64_t k_pad) {
  kernel_entry();
  const int64_t row = blockIdx.x;
  for (int64_t c = threadIdx.x; c < k_pad; c += blockDim.x) {
    const int64_t source = c < k ? (perm != nullptr ? perm[c] : c) : -1;
    dst[row * k_pad + c] = source >= 0 ? x[row * x_stride + source] : uint16_t(0);
  }
}

// Dynamic fp8 quantization of activations, as quantize_fp8_activations on the CPU (the same float32 steps and
// base.hpp's conversion): per row and group of group_size columns, scale = max|x| / 448 (FLT_EPSILON when 0),
// q = e4m3(x / scale + 0). One block per (row, group). xq [rows, k_pad] (zeros past K); scales
// [groups][scales_stride].
template <class T>
__global__ void quantize_activations_fp8_kernel(const T* x, int64_t x_stride, int64_t k, int64_t k_pad,
                                                int64_t group_size, uint8_t* xq, float* scales,
                                                int64_t scales_stride) {
  kernel_entry();
  __shared__ float team_partials[32];
  const int64_t row = blockIdx.x, group = blockIdx.y;
  const int64_t k0 = group * group_size, k_end = k0 + group_size < k ? k0 + group_size : k;
  const T* in = x + row * x_stride;
  float amax = 0.0f;
  for (int64_t c = k0 + threadIdx.x; c < k_end; c += blockDim.x) amax = fmaxf(amax, fabsf(to_float(in[c])));
  // block maximum: warps, then the warps' maxima (fmaxf ignores NaN, as std::max(amax, NaN) keeps amax)
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) team_partials[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int w = 0; w < int(blockDim.x / 32); w++) amax = fmaxf(amax, team_partials[w]);
  float scale = __fdiv_rn(amax, 448.0f);
  if (scale == 0.0f) scale = FLT_EPSILON;
  const int64_t pad_end = k0 + group_size < k_pad ? k0 + group_size : k_pad;
  for (int64_t c = k0 + threadIdx.x; c < pad_end; c += blockDim.x)
    xq[row * k_pad + c] = c < k ? float_to_fp8_e4m3(__fdiv_rn(to_float(in[c]), scale) + 0.0f) : uint8_t(0);
  if (threadIdx.x == 0) scales[group * scales_stride + row] = scale;
}

// Dequantization into the activation dtype for cuBLAS: column tiles [first_tile, first_tile + gridDim.x),
// stage blockIdx.y, into w [gridDim.x * 64, ldw] (row = output column, column = input column: act-order is
// undone here, so cuBLAS multiplies the activations as they are). Every value exactly as dequantize_rows
// computes it (dequantize_value), then rounded once to A.
struct DequantArgs {
  WeightFormat format;
  const uint8_t* tiles;
  const uint8_t* scales;
  DType table_dtype;     // the scale table's
  DType scale_dtype;     // the checkpoint's (rounding)
  DequantRounding rounding;
  const uint8_t* zeros;  // int4 / int8 asymmetric, or null
  const int32_t* perm;   // act-order, or null
  int64_t first_tile, n_pad, k, group_size;
  uint64_t tile_row_bytes, stage_bytes;
  void* w;
  int64_t ldw;
};
constexpr int kDequantThreads = 256;
template <class A>
__global__ void __launch_bounds__(kDequantThreads) dequantize_tiles_kernel(const DequantArgs args) {
  kernel_entry();
  __shared__ float values[kQuantTileN][kQuantStageK + 1];  // [tile column][stage column]
  const int64_t t = args.first_tile + blockIdx.x, s = blockIdx.y;
  const uint8_t* stage = args.tiles + uint64_t(t) * args.tile_row_bytes + uint64_t(s) * args.stage_bytes;
  auto scale_of = [&](int64_t group, int column) {
    return scale_at(args.scales, args.table_dtype, group * args.n_pad + t * kQuantTileN + quant_table_position(column));
  };
  if (args.format == WeightFormat::int4) {
    // thread = (tile within the stage, lane): one 16-byte lane chunk, 32 nibbles
    const int tile = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint4 chunk = *reinterpret_cast<const uint4*>(stage + tile * kInt4TileBytes + 16 * lane);
    const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#if KVLITE_DEQUANT_TILE_GROUPS
    // A group of whole tiles (group_size % 16: every checkpoint's 32 / 64 / 128): the thread's 32 nibbles are 8
    // columns (8 block + g, int4_tile_slot) x 4 k of one tile, so of one group: its 8 scales and zero points read
    // once instead of 32 times, and one 64-bit division instead of 32. The same dequantize_value on the same
    // inputs: the same bits.
    if (args.group_size % int64_t(kInt4TileK) == 0) {
      const int64_t group = (s * kQuantStageK + int64_t(tile) * kInt4TileK) / args.group_size;
      float scale[8];
      int zero[8];
#pragma unroll
      for (int block = 0; block < 8; block++) {
        const int column = 8 * block + lane / 4;
        scale[block] = scale_of(group, column);
        zero[block] = args.zeros != nullptr
                          ? args.zeros[group * args.n_pad + t * kQuantTileN + quant_table_position(column)]
                          : 8;
      }
#pragma unroll
      for (int w = 0; w < 4; w++)
#pragma unroll
        for (int nibble = 0; nibble < 8; nibble++) {
          int column, k;
          int4_tile_slot(lane, w, nibble, &column, &k);
          const int block = column / 8;
          const int u = int((words[w] >> (4 * nibble)) & 0xfu);
          values[column][tile * int(kInt4TileK) + k] =
              dequantize_value(float(u - zero[block]), scale[block], args.scale_dtype, args.rounding);
        }
    } else
#endif
    for (int w = 0; w < 4; w++)
      for (int nibble = 0; nibble < 8; nibble++) {
        int column, k;
        int4_tile_slot(lane, w, nibble, &column, &k);
        const int local = tile * int(kInt4TileK) + k;
        const int64_t group = (s * kQuantStageK + local) / args.group_size;
        const int u = int((words[w] >> (4 * nibble)) & 0xfu);
        const int zero = args.zeros != nullptr
                             ? args.zeros[group * args.n_pad + t * kQuantTileN + quant_table_position(column)]
                             : 8;
        values[column][local] = dequantize_value(float(u - zero), scale_of(group, column), args.scale_dtype, args.rounding);
      }
  } else {
    // fp8 and int8 share the byte tiles. thread = two (tile, chunk, lane) units of 16 bytes: 4 tiles x 4 chunks x
    // 32 lanes
    const bool int8 = args.format == WeightFormat::int8;
    for (int unit = threadIdx.x; unit < 512; unit += kDequantThreads) {
      const int tile = unit / 128, chunk = (unit / 32) % 4, lane = unit % 32;
      const uint4 bytes = *reinterpret_cast<const uint4*>(stage + tile * kFp8TileBytes + 512 * chunk + 16 * lane);
      const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
      for (int w = 0; w < 4; w++)
        for (int b = 0; b < 4; b++) {
          int column, k;
          fp8_tile_slot(lane, chunk, w, b, &column, &k);
          const int local = tile * int(kFp8TileK) + k;
          const int64_t group = (s * kQuantStageK + local) / args.group_size;
          const uint8_t code = uint8_t(words[w] >> (8 * b));
          float value;
          if (int8) {
            const int zero = args.zeros != nullptr
                                 ? int(int8_t(args.zeros[group * args.n_pad + t * kQuantTileN + quant_table_position(column)]))
                                 : 0;
            value = float(int(int8_t(code)) - zero);
          } else {
            value = fp8_e4m3_to_float(code);
          }
          values[column][local] = dequantize_value(value, scale_of(group, column), args.scale_dtype, args.rounding);
        }
    }
  }
  __syncthreads();
  A* w = static_cast<A*>(args.w);
  for (int i = threadIdx.x; i < int(kQuantTileN * kQuantStageK); i += kDequantThreads) {
    const int column = i / int(kQuantStageK), local = i % int(kQuantStageK);
    const int64_t k_device = s * kQuantStageK + local;
    const int64_t target = args.perm != nullptr ? (k_device < args.k ? args.perm[k_device] : -1) : k_device;
    if (target >= 0) w[(int64_t(blockIdx.x) * kQuantTileN + column) * args.ldw + target] = from_float<A>(values[column][local]);
  }
}

// ---- sampling ---------------------------------------------------------------------------------------------
// sample_kernel: one block per sampled row; sample_row_reference (backend_cuda.inl) is its host twin, phase for
// phase. No sort: every selection (the top_k-th token, the end of the top_p prefix, the drawn token) is a radix
// select over the 64-bit keys (sampling_key: scaled logit descending, id ascending), 8 bits a pass from the most
// significant: a 256-bin histogram of the candidates that match the digits decided so far, then thread 0 walks
// the bins from the top to the one where the running weight reaches the target. Weights are counts (top-k) or
// probability masses in 2^-60 units (sampling_mass), integers, so the shared-memory atomics give the same totals
// in any order and the result does not depend on scheduling.
//
//   pass 0: digit 63..56 of every candidate  ->  bin b0      pass 1: digit 55..48 of keys b0:*  ->  b1  ...
constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;

// Block-wide argmax over the row (argmax_better), every thread gets the winner.
struct BlockBest {
  float value;
  int32_t index;
};
__device__ BlockBest block_argmax(BlockBest mine, float* shared_value, int32_t* shared_index) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto reduce_warp = [&] {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_value = __shfl_xor_sync(0xffffffffu, mine.value, offset);
      const int32_t other_index = __shfl_xor_sync(0xffffffffu, mine.index, offset);
      if (argmax_better(other_value, other_index, mine.value, mine.index)) mine = BlockBest{other_value, other_index};
    }
  };
  reduce_warp();
  if (lane == 0) {
    shared_value[warp] = mine.value;
    shared_index[warp] = mine.index;
  }
  __syncthreads();
  mine = lane < kSampleWarps ? BlockBest{shared_value[lane], shared_index[lane]} : BlockBest{-INFINITY, INT_MAX};
  reduce_warp();  // every warp reduces the same 32 partials: all threads agree
  __syncthreads();  // the shared partials may be reused after this
  return mine;
}

// Block-wide double sum in a fixed tree (thread order, then warp order): the same bits on every run.
__device__ double block_sum(double mine, double* shared) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, offset);
  if (lane == 0) shared[warp] = mine;
  __syncthreads();
  mine = lane < kSampleWarps ? shared[lane] : 0.0;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, offset);
  __syncthreads();
  return mine;
}

// Shared state of one block's radix select.
struct SelectState {
  unsigned long long bins[kSamplingBins];
  unsigned long long prefix, before;
  int found;  // 1 while every pass found its bin
};

// The key of the first candidate (in key order) at which the running weight reaches `target`; false if the
// candidates' total stays below it. key_of(i), weight(i) and candidate(i, key) are the caller's.
template <class KeyOf, class Weight, class Candidate>
__device__ bool block_select(int64_t vocab, KeyOf key_of, Weight weight, Candidate candidate, uint64_t target,
                             SelectState* state, uint64_t* key) {
  __syncthreads();  // every thread has read the previous selection's result before it is reset
  if (threadIdx.x == 0) {
    state->prefix = 0;
    state->before = 0;
    state->found = 1;
  }
  const int lane = threadIdx.x % 32;
  constexpr int kNoBin = kSamplingBins;
  for (int pass = 0; pass < kSamplingPasses; pass++) {
    // ---- phase a: clear the histogram
    for (int b = threadIdx.x; b < kSamplingBins; b += blockDim.x) state->bins[b] = 0;
    __syncthreads();
    // ---- phase b: histogram of this pass's digit over the candidates under the decided prefix. Most tokens
    // share a few digits (logits span a few binades), so a warp first adds up the weights of its lanes that
    // share a bin (match.any, then a 32-step shuffle sum) and one lane per bin does the atomic: far fewer
    // collisions on the hot bins. The trip count is the same in every lane (the shuffles need the whole warp).
    const uint64_t decided = sampling_decided_mask(pass), prefix = state->prefix;
    for (int64_t base = 0; base < vocab; base += blockDim.x) {
      const int64_t i = base + threadIdx.x;
      int bin = kNoBin;
      unsigned long long w = 0;
      if (i < vocab) {
        const uint64_t k = key_of(i);
        if ((k & decided) == prefix && candidate(i, k)) {
          bin = sampling_digit(k, pass);
          w = weight(i);
        }
      }
      const unsigned peers = __match_any_sync(0xffffffffu, bin);
      unsigned long long total = 0;
#pragma unroll
      for (int j = 0; j < 32; j++) {
        const unsigned long long other = __shfl_sync(0xffffffffu, w, j);
        if ((peers >> j) & 1u) total += other;
      }
      if (bin != kNoBin && lane == __ffs(peers) - 1 && total != 0) atomicAdd(&state->bins[bin], total);
    }
    __syncthreads();
    // ---- phase c: one thread walks the 256 bins
    if (threadIdx.x == 0) {
      uint64_t before = state->before;
      const int bin = sampling_select_bin(state->bins, target, &before);
      state->before = before;
      if (bin < 0) state->found = 0;
      else state->prefix |= uint64_t(bin) << (56 - kSamplingDigitBits * pass);
    }
    __syncthreads();
    if (!state->found) return false;
  }
  *key = state->prefix;
  return true;
}

//   A: the logits' type (the activation dtype).
template <class A>
__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const A* logits, int64_t logits_stride,  // [R, V]
                                                                 int64_t vocab,
                                                                 const DeviceSamplingParams* params,  // [n]
                                                                 float* scratch, int64_t scratch_stride,  // [n, V]
                                                                 int32_t* ids) {                          // [n]
  kernel_entry();
  __shared__ float shared_value[kSampleWarps];
  __shared__ int32_t shared_index[kSampleWarps];
  __shared__ double shared_sum[kSampleWarps];
  __shared__ SelectState state;
  __shared__ unsigned long long shared_total;
  const DeviceSamplingParams p = params[blockIdx.x];
  const A* row = logits + int64_t(p.row) * logits_stride;
  float* probs = scratch + int64_t(blockIdx.x) * scratch_stride;

  // ---- phase 1: the argmax: greedy's answer, and the largest logit the others scale from
  BlockBest best{-INFINITY, INT_MAX};
  strided_argmax(row, vocab, threadIdx.x, blockDim.x, &best.value, &best.index);
  best = block_argmax(best, shared_value, shared_index);
  if (best.index == INT_MAX || p.temperature == 0.0f) {
    if (threadIdx.x == 0) ids[blockIdx.x] = best.index == INT_MAX ? 0 : best.index;
    return;
  }
  const float max_logit = best.value, temperature = p.temperature;
  // (logits[i] - max_logit) / temperature in float, as sample_token: IEEE subtraction and division
  auto scaled = [&](int64_t i) { return __fdiv_rn(__fsub_rn(to_float(row[i]), max_logit), temperature); };
  auto key_of = [&](int64_t i) { return sampling_key(scaled(i), int32_t(i)); };
  auto one = [](int64_t) { return 1ull; };
  auto mass = [&](int64_t i) { return (unsigned long long)sampling_mass(probs[i]); };

  // ---- phase 2: top-k: the candidates are the keys from the top_k-th on up
  uint64_t cutoff = 0;
  if (p.top_k > 0 && p.top_k < vocab)
    block_select(vocab, key_of, one, [](int64_t, uint64_t) { return true; }, uint64_t(p.top_k), &state, &cutoff);

  // ---- phase 3: softmax over the candidates, in double as sample_token (the others get 0)
  double partial = 0.0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    if (key_of(i) >= cutoff) partial += exp(double(scaled(i)));
  const double sum = block_sum(partial, shared_sum);
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    probs[i] = key_of(i) >= cutoff ? __double2float_rn(exp(double(scaled(i))) / sum) : 0.0f;
  __syncthreads();  // probs are read by every thread from here on

  // ---- phase 4: top-p: the shortest prefix whose mass reaches top_p (all candidates when none does)
  if (p.top_p < 1.0f) {
    uint64_t key;
    const uint64_t candidates_from = cutoff;
    if (block_select(vocab, key_of, mass, [&](int64_t, uint64_t k) { return k >= candidates_from; },
                     top_p_target(p.top_p), &state, &key))
      cutoff = key;
  }

  // ---- phase 5: min-p: of those, the tokens at least min_p x the first one's probability
  const float threshold = p.min_p > 0.0f ? __fmul_rn(p.min_p, probs[best.index]) : 0.0f;
  auto kept = [&](int64_t i, uint64_t k) { return k >= cutoff && probs[i] >= threshold; };

  // ---- phase 6: the draw: total kept mass, then the token where the running mass passes u x total
  if (threadIdx.x == 0) shared_total = 0;
  __syncthreads();
  unsigned long long mine = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    if (kept(i, key_of(i))) mine += sampling_mass(probs[i]);
  atomicAdd(&shared_total, mine);
  __syncthreads();
  const uint64_t total = shared_total;
  uint64_t key;
  const bool drawn = total != 0 && block_select(vocab, key_of, mass, kept, draw_target(p.draw, total), &state, &key);
  if (threadIdx.x == 0) ids[blockIdx.x] = drawn ? sampling_key_id(key) : best.index;
}

// ==== 4. the backend =======================================================================================

bool is_float_dtype(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16; }
bool is_kv_dtype(DType dtype) { return is_float_dtype(dtype) || dtype == DType::F8_E4M3; }

// Calls f(T{}) with T the device storage type of `dtype` (F32, BF16 or F16; the ops' validation and
// supports() guarantee one of them).
template <class F>
void with_float_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(__nv_bfloat16{}); return;
    case DType::F16: f(__half{}); return;
    default:
      detail::fail(ErrorCode::internal, detail::format("CUDA backend: no kernel for dtype %s", dtype_name(dtype)));
  }
}

// with_float_type's, plus the fp8 KV element.
template <class F>
void with_kv_type(DType dtype, F&& f) {
  if (dtype == DType::F8_E4M3) return f(KvFp8{});
  with_float_type(dtype, std::forward<F>(f));
}

// A layer's KV cache scale (host memory, read when the op is enqueued: a captured graph keeps the value).
float kv_layer_scale(const float* scales, int64_t layer) { return scales != nullptr ? scales[layer] : 1.0f; }

cudaDataType cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default:
      detail::fail(ErrorCode::internal, detail::format("CUDA backend: no cuBLAS type for dtype %s", dtype_name(dtype)));
  }
}

// Threads for a row kernel: whole warps covering the row, at most 256 (the rest stride).
unsigned row_threads(int64_t cols) {
  const int64_t warps = std::min<int64_t>(8, std::max<int64_t>(1, (cols + 31) / 32));
  return unsigned(warps * 32);
}
// The grid of a row kernel: one row per grid.x, and along grid.y as many blocks of row_threads(work) threads as
// give each thread about one of the row's `work` elements (at most 65535).
dim3 row_grid(int64_t rows, int64_t work) {
  const int64_t threads = row_threads(work);
  const int64_t blocks = std::min<int64_t>(65535, std::max<int64_t>(1, (work + threads - 1) / threads));
  return dim3(unsigned(rows), unsigned(blocks));
}
// A grid dimension x must be < 2^31 (y and z < 2^16).
void check_grid_rows(const char* op, int64_t rows) {
  if (rows > INT_MAX)
    detail::fail(ErrorCode::unsupported,
                 detail::format("%s: %lld rows are more than one launch covers (%d); split the call", op,
                                (long long)rows, INT_MAX));
}

template <class T>
T* typed(const Tensor& t) { return static_cast<T*>(t.data); }
template <class T>
const T* typed_const(const Tensor& t) { return static_cast<const T*>(t.data); }

// One instantiation of quant_gemm_kernel with its launch shape.
using QuantGemmKernel = void (*)(const QuantGemmArgs);
struct QuantGemmInstance {
  QuantGemmKernel kernel;
  int shared_bytes, threads;
  const char* name;
};
template <QgFormat F, class T, int M_TILES, bool kFp32Scales>
QuantGemmInstance quant_gemm_instance() {
  using Shape = QgShape<F, M_TILES>;
  return {&quant_gemm_kernel<F, T, M_TILES, kFp32Scales>, Shape::kSmem, Shape::kThreads,
          F == QgFormat::int4_a16 ? "quant_gemm_kernel (W4A16)"
                                  : F == QgFormat::fp8_a16 ? "quant_gemm_kernel (W8A16)" : "quant_gemm_kernel (W8A8)"};
}
template <QgFormat F, class T, bool kFp32Scales = false>
QuantGemmInstance quant_gemm_instance(int m_tiles) {
  return m_tiles == 1   ? quant_gemm_instance<F, T, 1, kFp32Scales>()
         : m_tiles == 2 ? quant_gemm_instance<F, T, 2, kFp32Scales>()
                        : quant_gemm_instance<F, T, 4, kFp32Scales>();
}
template <QgFormat F, class T>
QuantGemmInstance quant_gemm_instance(int m_tiles, ScaleProduct product) {
  return product == ScaleProduct::pair_multiply ? quant_gemm_instance<F, T, false>(m_tiles)
                                                : quant_gemm_instance<F, T, true>(m_tiles);
}
template <QgFormat F, class T, bool kFp32Scales>
QuantGemmInstance quant_gemv_instance(int rows) {
  constexpr const char* name = F == QgFormat::int4_a16 ? "quant_gemv_kernel (W4A16)" : "quant_gemv_kernel (W8A16)";
  constexpr int threads = kGemvWarps * 32;
  constexpr int ring = GemvShape<F>::kRingBytes;  // dynamic shared memory: the lanes' rings (0 without)
  return rows == 1 ? QuantGemmInstance{&quant_gemv_kernel<F, T, 1, kFp32Scales>, ring, threads, name}
                   : rows == 2 ? QuantGemmInstance{&quant_gemv_kernel<F, T, 2, kFp32Scales>, ring, threads, name}
                               : QuantGemmInstance{&quant_gemv_kernel<F, T, 4, kFp32Scales>, ring, threads, name};
}
template <QgFormat F, bool kFp32Scales>
QuantGemmInstance quant_gemv_instance(DType activation, int rows) {
  return activation == DType::BF16 ? quant_gemv_instance<F, __nv_bfloat16, kFp32Scales>(rows)
                                   : quant_gemv_instance<F, __half, kFp32Scales>(rows);
}
// The GEMV for `format` (int4_a16 or fp8_a16) with activations of `activation` (BF16 or F16), compiled for
// `rows` (1, 2, 4: quant_gemv_rows), and the scale product `product` (pair_multiply, or one of the fp32 two).
QuantGemmInstance quant_gemv_instance(QgFormat format, DType activation, int rows, ScaleProduct product) {
  const bool fp32 = product != ScaleProduct::pair_multiply;
  if (format == QgFormat::int4_a16)
    return fp32 ? quant_gemv_instance<QgFormat::int4_a16, true>(activation, rows)
                : quant_gemv_instance<QgFormat::int4_a16, false>(activation, rows);
  return fp32 ? quant_gemv_instance<QgFormat::fp8_a16, true>(activation, rows)
              : quant_gemv_instance<QgFormat::fp8_a16, false>(activation, rows);
}

template <QgFormat F, bool kFp32Scales>
QuantGemmInstance quant_gemv_mma_instance(DType activation) {
  constexpr int threads = kGemvWarps * 32;
  constexpr const char* name = F == QgFormat::int4_a16 ? "quant_gemv_mma_kernel (W4A16)" : "quant_gemv_mma_kernel (W8A16)";
  constexpr int ring = 0;  // gemv_mma_run streams through registers
  return activation == DType::BF16 ? QuantGemmInstance{&quant_gemv_mma_kernel<F, __nv_bfloat16, kFp32Scales>, ring, threads, name}
                                   : QuantGemmInstance{&quant_gemv_mma_kernel<F, __half, kFp32Scales>, ring, threads, name};
}
// The tensor-core GEMV for `format` (int4_a16, fp8_a16) with activations of `activation` (BF16 or F16) and the
// scale product `product`.
QuantGemmInstance quant_gemv_mma_instance(QgFormat format, DType activation, ScaleProduct product) {
  const bool fp32 = product != ScaleProduct::pair_multiply;
  if (format == QgFormat::int4_a16)
    return fp32 ? quant_gemv_mma_instance<QgFormat::int4_a16, true>(activation)
                : quant_gemv_mma_instance<QgFormat::int4_a16, false>(activation);
  return fp32 ? quant_gemv_mma_instance<QgFormat::fp8_a16, true>(activation)
              : quant_gemv_mma_instance<QgFormat::fp8_a16, false>(activation);
}

// The kernel for `format` with activations of `activation` (BF16 or F16), `m_tiles` (1, 2, 4) and, for the A16
// formats, the scale product `product`.
QuantGemmInstance quant_gemm_instance(QgFormat format, DType activation, int m_tiles, ScaleProduct product) {
  if (activation == DType::BF16) {
    if (format == QgFormat::int4_a16) return quant_gemm_instance<QgFormat::int4_a16, __nv_bfloat16>(m_tiles, product);
    if (format == QgFormat::fp8_a16) return quant_gemm_instance<QgFormat::fp8_a16, __nv_bfloat16>(m_tiles, product);
  } else {
    if (format == QgFormat::int4_a16) return quant_gemm_instance<QgFormat::int4_a16, __half>(m_tiles, product);
    if (format == QgFormat::fp8_a16) return quant_gemm_instance<QgFormat::fp8_a16, __half>(m_tiles, product);
  }
  return quant_gemm_instance<QgFormat::fp8_a8, __nv_bfloat16>(m_tiles);  // stores args.out_dtype
}

class CudaBackend final : public Backend {
 public:
  // Throws Error; see make_cuda_backend.
  explicit CudaBackend(const CudaBackendOptions& options)
      : device_(options.device), act_(options.activation_dtype), fp32_scale_products_(options.fp32_scale_products) {
    if (!is_float_dtype(act_))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cuda_backend: activation_dtype %s; use BF16, F16 or F32", dtype_name(act_)));
    if (options.workspace == nullptr || reinterpret_cast<uintptr_t>(options.workspace) % 256 != 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cuda_backend: the workspace pointer %p is null or not 256-byte aligned; pass "
                                  "device memory from the arena's workspace region", options.workspace));
    CudaWorkspaceLayout layout;
    if (!cuda_workspace_layout(options.workspace_bytes, options.cublas_workspace_bytes, &layout))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cuda_backend: the workspace of %s holds neither the cuBLAS workspace of %s "
                                  "plus %s of scratch; give at least %s (kCudaWorkspaceBytes: %s)",
                                  format_bytes(options.workspace_bytes).c_str(),
                                  format_bytes(options.cublas_workspace_bytes).c_str(),
                                  format_bytes(kCudaMinScratchBytes + 256).c_str(),
                                  format_bytes(options.cublas_workspace_bytes + kCudaMinScratchBytes + 256).c_str(),
                                  format_bytes(kCudaWorkspaceBytes).c_str()));
    int devices = 0;
    const cudaError_t counted = cudaGetDeviceCount(&devices);
    if (counted != cudaSuccess || devices == 0) {
      cudaGetLastError();  // clear the status: no GPU is an answer, not a broken context
      detail::fail(ErrorCode::device_error,
                   detail::format("make_cuda_backend: no CUDA device is available (cudaGetDeviceCount: %s)",
                                  counted != cudaSuccess ? cudaGetErrorString(counted) : "0 devices"));
    }
    if (options.device < 0 || options.device >= devices)
      detail::fail(ErrorCode::invalid_argument, detail::format("make_cuda_backend: device %d does not exist; there %s "
                                                               "%d CUDA device%s", options.device,
                                                               devices == 1 ? "is" : "are", devices,
                                                               devices == 1 ? "" : "s"));
    KVLITE_CUDA_CHECK(cudaSetDevice(device_));
    cudaDeviceProp prop;
    KVLITE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    device_name_ = prop.name;
    sm_ = prop.major * 10 + prop.minor;
    sm_count_ = prop.multiProcessorCount;
    programmatic_launch_ = options.programmatic_launch && sm_ >= 90 && KVLITE_PROGRAMMATIC_LAUNCH_BUILT;
    if (sm_ < 80)
      detail::fail(ErrorCode::unsupported,
                   detail::format("make_cuda_backend: %s has compute capability %d.%d; kvlite's kernels need 8.0 or "
                                  "newer (Ampere, Ada, Hopper, Blackwell)", prop.name, prop.major, prop.minor));
    cudaPointerAttributes attributes;
    KVLITE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, options.workspace));
    if (attributes.type != cudaMemoryTypeDevice || attributes.device != device_)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cuda_backend: the workspace %p is not device memory of device %d; pass the "
                                  "arena's workspace region", options.workspace, device_));
    uint8_t* base = static_cast<uint8_t*>(options.workspace);
    fault_ = reinterpret_cast<DeviceFault*>(base + layout.fault_offset);
    scratch_ = base + layout.scratch_offset;
    scratch_bytes_ = layout.scratch_bytes;

    try {
      KVLITE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      if (!cublas().error.empty()) detail::fail(ErrorCode::device_error, cublas().error);
      KVLITE_CUBLAS_CHECK(cublas().create(&cublas_));
      // cublasSetStream resets the workspace to cuBLAS's own pool, so the stream comes first.
      KVLITE_CUBLAS_CHECK(cublas().set_stream(cublas_, stream_));
      KVLITE_CUBLAS_CHECK(cublas().set_workspace(cublas_, base + layout.cublas_offset, layout.cublas_bytes));
      // fp32 accumulation everywhere, split-K reductions included (no 16-bit partial sums), and no TF32.
      KVLITE_CUBLAS_CHECK(cublas().set_math_mode(cublas_, CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
      KVLITE_CUDA_CHECK(cudaMemsetAsync(fault_, 0, sizeof(DeviceFault), stream_));
      KVLITE_CUDA_CHECK(cudaStreamSynchronize(stream_));
      if (options.host_staging_bytes > 0) {
        const cudaError_t pinned = cudaHostAlloc(&host_staging_, size_t(options.host_staging_bytes), cudaHostAllocDefault);
        if (pinned != cudaSuccess) {
          host_staging_ = nullptr;
          cudaGetLastError();
          detail::fail(ErrorCode::out_of_memory,
                       detail::format("make_cuda_backend: cudaHostAlloc of %s of pinned host memory for the host "
                                      "embeddings' staging (--host-embeddings: max_batched_tokens x hidden "
                                      "activations) failed: %s; lower --max-batched-tokens or drop --host-embeddings",
                                      format_bytes(options.host_staging_bytes).c_str(), cudaGetErrorString(pinned)));
        }
        host_staging_bytes_ = options.host_staging_bytes;
      }
    } catch (...) {
      release();  // the destructor does not run for a constructor that throws
      throw;
    }
  }

  ~CudaBackend() override { release(); }

  BackendKind kind() const override { return BackendKind::cuda; }
  std::string name() const override {
    return detail::format("cuda (%s, sm_%d, %s activations%s)", device_name_.c_str(), sm_, dtype_name(act_),
                          programmatic_launch_ ? ", programmatic launch" : "");
  }
  DType activation_dtype() const override { return act_; }
  bool supports(Op op, DType dtype) const override {
    switch (op) {
      case Op::rope: case Op::silu_mul: case Op::add: case Op::linear: return dtype == act_;
      case Op::gather_rows: case Op::rms_norm: case Op::add_rms_norm: case Op::copy: return is_float_dtype(dtype);
      case Op::kv_write: case Op::attention: case Op::rope_kv_write: return is_kv_dtype(dtype);
      case Op::embedding_bag: case Op::layer_norm: return is_float_dtype(dtype);
      case Op::gelu: case Op::segment_attention: case Op::gelu_mul: case Op::scale: case Op::soft_cap:
        return dtype == act_;
      // int4 (pack-quantized), int8 and fp8 weights, repacked by cuda::upload_quant_weight (section 3b's GEMMs;
      // int8 through dequantize + cuBLAS)
      case Op::quant_linear: return dtype == DType::I32 || dtype == DType::I8 || dtype == DType::F8_E4M3;
    }
    return false;
  }

  // See cuda::set_quant_kernel and upload_quant_weight.
  void set_quant_kernel(QuantKernel kernel) { forced_quant_kernel_ = kernel; }
  int sm() const { return sm_; }
  // See cuda::backend_stream.
  cudaStream_t stream() const { return stream_; }

  // See cuda::argmax.
  void argmax(const Tensor& logits, const Tensor& ids) {
    activate();
    const int64_t rows = logits.rows;
    if (rows == 0) return;
    check_grid_rows("argmax", rows);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      launch("argmax_kernel", argmax_kernel<A>, unsigned(rows), kArgmaxThreads, 0, typed_const<A>(logits), logits.row_stride,
                                                                        logits.cols, typed<int32_t>(ids));
    });
  }

  // See cuda::sample.
  void sample(const Tensor& logits, const Tensor& params, const Tensor& scratch, const Tensor& ids) {
    activate();
    const int64_t rows = ids.elements();
    if (rows == 0) return;
    check_grid_rows("sample", rows);
    with_float_type(logits.dtype, [&](auto tag) {
      using A = decltype(tag);
      launch("sample_kernel", sample_kernel<A>, unsigned(rows), kSampleThreads, 0,
          typed_const<A>(logits), leading_dimension(logits), logits.cols,
          static_cast<const DeviceSamplingParams*>(params.data), typed<float>(scratch), leading_dimension(scratch),
          typed<int32_t>(ids));
    });
  }

  // See cuda::copy_bandwidth.
  double copy_bandwidth(void* dst, const void* src, uint64_t bytes, int repeats) {
    activate();
    cudaEvent_t start = nullptr, stop = nullptr;
    KVLITE_CUDA_CHECK(cudaEventCreate(&start));
    float milliseconds = 0.0f;
    try {
      KVLITE_CUDA_CHECK(cudaEventCreate(&stop));
      // one untimed copy first: the first touch of a range can cost more (TLB, clocks ramping up)
      KVLITE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
      KVLITE_CUDA_CHECK(cudaEventRecord(start, stream_));
      for (int i = 0; i < repeats; i++)
        KVLITE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
      KVLITE_CUDA_CHECK(cudaEventRecord(stop, stream_));
      KVLITE_CUDA_CHECK(cudaEventSynchronize(stop));
      KVLITE_CUDA_CHECK(cudaEventElapsedTime(&milliseconds, start, stop));
    } catch (...) {
      cudaEventDestroy(start);
      if (stop != nullptr) cudaEventDestroy(stop);
      throw;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (!(milliseconds > 0.0f))
      detail::fail(ErrorCode::device_error, "copy_bandwidth: the CUDA events measured no time; copy more bytes");
    return 2.0 * double(bytes) * double(repeats) / (double(milliseconds) * 1e-3);  // read + written
  }

  // See cuda::capture_graph. The stream is in capture mode only inside this call.
  CudaGraph capture(const std::function<void()>& record) {
    activate();
    synchronize_and_report();  // nothing queued may leak into the graph, and no earlier fault into its blame
    KVLITE_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t graph = nullptr;
    try {
      record();
    } catch (...) {
      if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph != nullptr) cudaGraphDestroy(graph);
      cudaGetLastError();  // the abandoned capture's status is not the error being reported
      throw;
    }
    KVLITE_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);  // the executable graph keeps what it needs
    check_cuda(instantiated, "cudaGraphInstantiate");
    return CudaGraph(exec);
  }

  void launch(const CudaGraph& graph) {
    activate();
    KVLITE_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph.handle()), stream_));
  }

 protected:
  void impl_copy_from_host(const void* src, const Tensor& dst) override {
    activate();
    if (dst.elements() == 0) return;
    const size_t row_bytes = size_t(dst.cols * dst.element_bytes());
    KVLITE_CUDA_CHECK(cudaMemcpy2DAsync(dst.data, size_t(leading_dimension(dst) * dst.element_bytes()), src, row_bytes,
                                        row_bytes, size_t(dst.rows), cudaMemcpyHostToDevice, stream_));
    // `src` may be reused as soon as this returns, also when it is pinned memory.
    synchronize_and_report();
  }
  void impl_copy_to_host(const Tensor& src, void* dst) override {
    activate();
    if (src.elements() > 0) {
      const size_t row_bytes = size_t(src.cols * src.element_bytes());
      KVLITE_CUDA_CHECK(cudaMemcpy2DAsync(dst, row_bytes, src.data, size_t(leading_dimension(src) * src.element_bytes()),
                                          row_bytes, size_t(src.rows), cudaMemcpyDeviceToHost, stream_));
    }
    synchronize_and_report();
  }
  void impl_synchronize() override {
    activate();
    synchronize_and_report();
  }

  void impl_gather_rows(const Tensor& table, const Tensor& ids, const Tensor& out) override {
    activate();
    if (out.rows == 0) return;
    check_grid_rows("gather_rows", out.rows);
    with_float_type(table.dtype, [&](auto table_tag) {
      with_float_type(act_, [&](auto act_tag) {
        using T = decltype(table_tag);
        using A = decltype(act_tag);
        launch("gather_rows_kernel", gather_rows_kernel<T, A>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
            typed_const<T>(table), table.row_stride, table.rows, typed_const<int32_t>(ids), typed<A>(out),
            out.row_stride, out.cols, fault_);
      });
    });
  }

  // The rows on the host into the pinned staging buffer (converted to the activation dtype there), then one copy
  // into `out` on the stream; returns once it is done, so the buffer is free for the next step.
  void impl_gather_host_rows(const Tensor& table, const int32_t* ids, const Tensor& out) override {
    activate();
    if (out.rows == 0) return;
    const uint64_t element = dtype_bytes(act_, 1), bytes = element * uint64_t(out.rows) * uint64_t(out.cols);
    if (host_staging_ == nullptr || bytes > host_staging_bytes_)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("gather_host_rows: %lld rows x %lld columns of %s take %s, but the pinned staging "
                                  "buffer holds %s (CudaBackendOptions::host_staging_bytes: the plan's "
                                  "--host-embeddings buffer, max_batched_tokens x hidden activations)",
                                  (long long)out.rows, (long long)out.cols, dtype_name(act_),
                                  format_bytes(bytes).c_str(), format_bytes(host_staging_bytes_).c_str()));
    detail::gather_host_rows_into(table, ids, out.rows, act_, host_staging_);
    const size_t row_bytes = size_t(uint64_t(out.cols) * element);
    KVLITE_CUDA_CHECK(cudaMemcpy2DAsync(out.data, size_t(uint64_t(leading_dimension(out)) * element), host_staging_,
                                        row_bytes, row_bytes, size_t(out.rows), cudaMemcpyHostToDevice, stream_));
    synchronize_and_report();
  }

  void impl_rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) override {
    activate();
    const int64_t group = weight.elements(), groups_per_row = x.cols / group;
    launch_norm("rms_norm", x.rows * groups_per_row, group, [&](auto team, unsigned blocks, unsigned threads) {
      constexpr int kTeam = decltype(team)::value;
      with_float_type(weight.dtype, [&](auto weight_tag) {
        with_float_type(act_, [&](auto act_tag) {
          using W = decltype(weight_tag);
          using A = decltype(act_tag);
          launch("rms_norm_kernel", rms_norm_kernel<A, W, kTeam>, blocks, threads, 0,
              typed_const<A>(x), x.row_stride, typed_const<W>(weight), group, groups_per_row, x.rows, eps,
              typed<A>(out), out.row_stride);
        });
      });
    });
  }

  void impl_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, float eps,
                         const Tensor& out) override {
    activate();
    launch_norm("add_rms_norm", x.rows, x.cols, [&](auto team, unsigned blocks, unsigned threads) {
      constexpr int kTeam = decltype(team)::value;
      with_float_type(weight.dtype, [&](auto weight_tag) {
        with_float_type(act_, [&](auto act_tag) {
          using W = decltype(weight_tag);
          using A = decltype(act_tag);
          launch("add_rms_norm_kernel", add_rms_norm_kernel<A, W, kTeam>, blocks, threads, 0,
              typed_const<A>(x), x.row_stride, typed<A>(residual), residual.row_stride, typed_const<W>(weight),
              x.rows, x.cols, eps, typed<A>(out), out.row_stride);
        });
      });
    });
  }

  void impl_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim) override {
    activate();
    if (x.rows == 0) return;
    check_grid_rows("rope", x.rows);
    const int64_t heads = x.cols / head_dim, half = cos.cols;
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      launch("rope_kernel", rope_kernel<A>, row_grid(x.rows, heads * half), row_threads(heads * half), 0,
          typed<A>(x), x.row_stride, heads, head_dim, typed_const<float>(cos), leading_dimension(cos),
          typed_const<float>(sin), leading_dimension(sin), half);
    });
  }

  void impl_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out) override {
    activate();
    GemmShape shape;
    if (!linear_gemm_shape(x, weight, out, &shape))
      detail::fail(ErrorCode::unsupported,
                   detail::format("linear: x [%lld, %lld] @ weight [%lld, %lld]^T has a size or stride past cuBLAS's "
                                  "32-bit int; split the call", (long long)x.rows, (long long)x.cols,
                                  (long long)weight.rows, (long long)weight.cols));
    if (out.elements() == 0) return;
    check_grid_rows("linear", out.rows);
    // C starts as the bias (beta = 1) or, when K = 0, as the whole answer (bias or zeros).
    const bool has_bias = bias.data != nullptr;
    if (has_bias || shape.k == 0) {
      with_float_type(has_bias ? bias.dtype : act_, [&](auto bias_tag) {
        with_float_type(act_, [&](auto act_tag) {
          using B = decltype(bias_tag);
          using A = decltype(act_tag);
          launch("fill_rows_kernel", fill_rows_kernel<B, A>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
              has_bias ? typed_const<B>(bias) : nullptr, typed<A>(out), out.row_stride, out.cols);
        });
      });
    }
    if (shape.k == 0) return;
    const float alpha = 1.0f, beta = has_bias ? 1.0f : 0.0f;
    const cudaDataType type = cuda_data_type(act_);  // weight, x and out share it (supports(linear))
    KVLITE_CUBLAS_CHECK(cublas().gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, shape.m, shape.n, shape.k, &alpha,
                                     weight.data, type, shape.lda, x.data, type, shape.ldb, &beta, out.data, type,
                                     shape.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  // Quantized Linears (section 3b): the kernel by choose_quant_kernel (or set_quant_kernel), planned against
  // this backend's scratch (plan_quant_gemm), run in passes of rows when the staged activations need it.
  void impl_quant_linear(const Tensor& x, const QuantWeight& weight, const Tensor& out) override {
    activate();
    if (out.elements() == 0) return;
    const QuantGpuLayout layout = quant_gpu_layout(weight);
    const QuantKernel kernel = choose_quant_kernel(layout, act_, sm_, x.rows, forced_quant_kernel_);
    const std::string refusal = quant_kernel_refusal(layout, kernel, act_, sm_);
    if (!refusal.empty())
      detail::fail(ErrorCode::unsupported, detail::format("quant_linear(%s): %s", weight.name.c_str(), refusal.c_str()));
    if (layout.n_tiles > 65535)
      detail::fail(ErrorCode::unsupported,
                   detail::format("quant_linear(%s): %lld output columns are more than the GEMM grid covers (%d)",
                                  weight.name.c_str(), (long long)layout.n, 65535 * int(kQuantTileN)));
    check_grid_rows("quant_linear", x.rows);
    if (kernel == QuantKernel::dequant_cublas) quant_linear_dequantize(x, weight, layout, out);
    else quant_linear_mma(x, weight, layout, kernel, out);
  }

  void impl_silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) override {
    activate();
    if (out.elements() == 0) return;
    check_grid_rows("silu_mul", out.rows);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      launch("silu_mul_kernel", silu_mul_kernel<A>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
          typed_const<A>(gate), gate.row_stride, typed_const<A>(up), up.row_stride, typed<A>(out), out.row_stride,
          out.cols);
    });
  }

  void impl_gelu_mul(const Tensor& gate, const Tensor& up, GeluApprox approx, const Tensor& out) override {
    activate();
    if (out.elements() == 0) return;
    check_grid_rows("gelu_mul", out.rows);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      if (approx == GeluApprox::tanh)
        launch("gelu_mul_kernel", gelu_mul_kernel<A, true>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
            typed_const<A>(gate), gate.row_stride, typed_const<A>(up), up.row_stride, typed<A>(out), out.row_stride,
            out.cols);
      else
        launch("gelu_mul_kernel", gelu_mul_kernel<A, false>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
            typed_const<A>(gate), gate.row_stride, typed_const<A>(up), up.row_stride, typed<A>(out), out.row_stride,
            out.cols);
    });
  }

  void impl_scale(const Tensor& x, float factor, const Tensor& out) override {
    activate();
    if (out.elements() == 0) return;
    check_grid_rows("scale", out.rows);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      launch("scale_kernel", scale_kernel<A, false>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
          typed_const<A>(x), x.row_stride, typed<A>(out), out.row_stride, out.cols, factor);
    });
  }

  void impl_soft_cap(const Tensor& x, float cap, const Tensor& out) override {
    activate();
    if (out.elements() == 0) return;
    check_grid_rows("soft_cap", out.rows);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      launch("scale_kernel", scale_kernel<A, true>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
          typed_const<A>(x), x.row_stride, typed<A>(out), out.row_stride, out.cols, cap);
    });
  }

  void impl_add(const Tensor& a, const Tensor& b, const Tensor& out) override {
    activate();
    if (out.elements() == 0) return;
    check_grid_rows("add", out.rows);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      launch("add_kernel", add_kernel<A>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
          typed_const<A>(a), a.row_stride, typed_const<A>(b), b.row_stride, typed<A>(out), out.row_stride, out.cols);
    });
  }

  void impl_copy(const Tensor& src, const Tensor& dst) override {
    activate();
    if (dst.elements() == 0) return;
    check_grid_rows("copy", dst.rows);
    with_float_type(src.dtype, [&](auto src_tag) {
      with_float_type(dst.dtype, [&](auto dst_tag) {
        using S = decltype(src_tag);
        using D = decltype(dst_tag);
        launch("copy_kernel", copy_kernel<S, D>, row_grid(dst.rows, dst.cols), row_threads(dst.cols), 0,
            typed_const<S>(src), src.row_stride, typed<D>(dst), dst.row_stride, dst.cols);
      });
    });
  }

  void impl_embedding_bag(const Tensor& table, const Tensor& indices, const Tensor& weights,
                          const Tensor& out) override {
    activate();
    if (out.rows == 0) return;
    check_grid_rows("embedding_bag", out.rows);
    with_float_type(table.dtype, [&](auto table_tag) {
      with_float_type(act_, [&](auto act_tag) {
        using T = decltype(table_tag);
        using A = decltype(act_tag);
        launch("embedding_bag_kernel", embedding_bag_kernel<T, A>, unsigned(out.rows), row_threads(out.cols), 0,
            typed_const<T>(table), table.row_stride, table.rows, typed_const<int32_t>(indices),
            leading_dimension(indices), typed_const<float>(weights), leading_dimension(weights), indices.cols,
            typed<A>(out), out.row_stride, out.cols, fault_);
      });
    });
  }

  void impl_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       const Tensor& out) override {
    activate();
    launch_norm("layer_norm", x.rows, x.cols, [&](auto team, unsigned blocks, unsigned threads) {
      constexpr int kTeam = decltype(team)::value;
      with_float_type(weight.dtype, [&](auto weight_tag) {
        with_float_type(act_, [&](auto act_tag) {
          using W = decltype(weight_tag);
          using A = decltype(act_tag);
          launch("layer_norm_kernel", layer_norm_kernel<A, W, kTeam>, blocks, threads, 0,
              typed_const<A>(x), x.row_stride, typed_const<W>(weight), typed_const<W>(bias), x.rows, x.cols, eps,
              typed<A>(out), out.row_stride);
        });
      });
    });
  }

  void impl_gelu(const Tensor& x, GeluApprox approx, const Tensor& out) override {
    activate();
    if (out.elements() == 0) return;
    check_grid_rows("gelu", out.rows);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      if (approx == GeluApprox::tanh)
        launch("gelu_kernel", gelu_kernel<A, true>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
            typed_const<A>(x), x.row_stride, typed<A>(out), out.row_stride, out.cols);
      else
        launch("gelu_kernel", gelu_kernel<A, false>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
            typed_const<A>(x), x.row_stride, typed<A>(out), out.row_stride, out.cols);
    });
  }

  void impl_segment_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_starts,
                              int64_t max_segment, int64_t head_dim, float scale, const Tensor& out) override {
    activate();
    // Lanes hold 1, 2, 4 or 8 dimensions: four kernels cover every head_dim up to 256.
    const int dims = head_dim <= 32 ? 1 : head_dim <= 64 ? 2 : head_dim <= 128 ? 4 : head_dim <= 256 ? 8 : 0;
    if (dims == 0)
      detail::fail(ErrorCode::unsupported,
                   detail::format("segment_attention: head_dim %lld is larger than the CUDA kernels' %lld",
                                  (long long)head_dim, (long long)kCudaMaxHeadDim));
    if (q.rows == 0) return;
    check_grid_rows("segment_attention", q.rows);
    SegmentAttentionArgs args{};
    args.q = q.data;
    args.k = k.data;
    args.v = v.data;
    args.out = out.data;
    args.q_stride = q.row_stride;
    args.k_stride = k.row_stride;
    args.v_stride = v.row_stride;
    args.out_stride = out.row_stride;
    args.segment_starts = typed_const<int32_t>(segment_starts);
    args.segments = segment_starts.elements() - 1;
    args.rows = q.rows;
    args.max_segment = max_segment;
    args.head_dim = head_dim;
    const int64_t heads = q.cols / head_dim;
    args.group = heads / (k.cols / head_dim);
    args.scale = scale;
    args.fault = fault_;
    if (heads > 65535)
      detail::fail(ErrorCode::unsupported,
                   detail::format("segment_attention: %lld heads exceed a launch's 65535 blocks in y", (long long)heads));
    const dim3 grid(unsigned(q.rows), unsigned(heads));
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      switch (dims) {
        case 1: launch("segment_attention_kernel", segment_attention_kernel<A, 1>, grid, kAttentionWarps * 32, 0, args); break;
        case 2: launch("segment_attention_kernel", segment_attention_kernel<A, 2>, grid, kAttentionWarps * 32, 0, args); break;
        case 4: launch("segment_attention_kernel", segment_attention_kernel<A, 4>, grid, kAttentionWarps * 32, 0, args); break;
        default: launch("segment_attention_kernel", segment_attention_kernel<A, 8>, grid, kAttentionWarps * 32, 0, args); break;
      }
    });
  }

  void impl_kv_write(const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v,
                     const Tensor& slots) override {
    activate();
    if (k.rows == 0) return;
    check_grid_rows("kv_write", k.rows);
    const float k_scale = kv_layer_scale(cache.k_scales, layer), v_scale = kv_layer_scale(cache.v_scales, layer);
    with_float_type(act_, [&](auto act_tag) {
      with_kv_type(cache.dtype, [&](auto kv_tag) {
        using A = decltype(act_tag);
        using E = decltype(kv_tag);
        launch("kv_write_kernel", kv_write_kernel<A, E>, row_grid(k.rows, k.cols), row_threads(k.cols), 0,
            typed_const<A>(k), k.row_stride, typed_const<A>(v), v.row_stride, typed_const<int32_t>(slots),
            static_cast<E*>(cache.pages), cache.layout, layer, cache.num_pages, k.cols, k_scale, v_scale, fault_);
      });
    });
  }

  void impl_rope_kv_write(const Tensor& qk, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                          const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v,
                          const Tensor& slots) override {
    activate();
    if (qk.rows == 0) return;
    check_grid_rows("rope_kv_write", qk.rows);
    const int64_t heads = qk.cols / head_dim, half = cos.cols, width = k.cols;
    const int64_t items = heads * half + width + (width / head_dim) * (head_dim - 2 * half);
    const float k_scale = kv_layer_scale(cache.k_scales, layer), v_scale = kv_layer_scale(cache.v_scales, layer);
    with_float_type(act_, [&](auto act_tag) {
      with_kv_type(cache.dtype, [&](auto kv_tag) {
        using A = decltype(act_tag);
        using E = decltype(kv_tag);
        launch("rope_kv_write_kernel", rope_kv_write_kernel<A, E>, row_grid(qk.rows, items), row_threads(items), 0,
            typed<A>(qk), qk.row_stride, heads, head_dim, typed_const<float>(cos), leading_dimension(cos),
            typed_const<float>(sin), leading_dimension(sin), half, typed_const<A>(v), v.row_stride,
            typed_const<int32_t>(slots), static_cast<E*>(cache.pages), cache.layout, layer, cache.num_pages, width,
            k_scale, v_scale, fault_);
      });
    });
  }

  void impl_attention(const Tensor& q, const KVCacheView& cache, int64_t layer, const AttentionBatch& batch,
                      float scale, const Tensor& out, const AttentionOptions& options) override {
    activate();
    const int64_t head_dim = cache.layout.head_dim, kv_heads = cache.layout.kv_heads;
    const int dims = attention_dims_per_lane(head_dim);
    if (dims == 0)
      detail::fail(ErrorCode::unsupported,
                   detail::format("attention: head_dim %lld is larger than the CUDA kernels' %lld", (long long)head_dim,
                                  (long long)kCudaMaxHeadDim));
    if (q.rows == 0) return;
    check_grid_rows("attention", q.rows);
    AttentionArgs args{};
    args.q = q.data;
    args.q_stride = q.row_stride;
    args.out = out.data;
    args.out_stride = out.row_stride;
    args.pages = cache.pages;
    args.layout = cache.layout;
    args.layer = layer;
    args.num_pages = cache.num_pages;
    args.query_starts = typed_const<int32_t>(batch.query_starts);
    args.context_lens = typed_const<int32_t>(batch.context_lens);
    args.block_tables = typed_const<int32_t>(batch.block_tables);
    args.block_table_stride = leading_dimension(batch.block_tables);
    args.seqs = batch.context_lens.elements();
    args.rows = q.rows;
    args.max_context = batch.max_context;
    if (batch.max_context > INT32_MAX)  // the kernel's key positions are 32-bit
      detail::fail(ErrorCode::unsupported, detail::format("attention: max_context %lld is past the CUDA kernel's 2^31 - 1",
                                                          (long long)batch.max_context));
    args.heads = q.cols / head_dim;
    args.group = args.heads / kv_heads;
    // the pairs outside the tuned ones run the generic shape (attention_kernel_dims says why)
    const bool pair_tuned = attention_pair_tuned(cache.dtype == act_, cache.dtype == DType::F8_E4M3);
    const int kernel_dims = attention_kernel_dims(dims, pair_tuned);
    const int heads_per_block = attention_heads_per_block(kernel_dims);
    args.head_passes = (args.group + heads_per_block - 1) / heads_per_block;
    if (kv_heads * args.head_passes > 65535)
      detail::fail(ErrorCode::unsupported,
                   detail::format("attention: %lld KV heads x %lld head passes exceed a launch's 65535 blocks in y",
                                  (long long)kv_heads, (long long)args.head_passes));
    args.scale = scale;
    args.window = options.window;
    args.logit_softcap = options.logit_softcap;
    args.k_scale = kv_layer_scale(cache.k_scales, layer);
    args.v_scale = kv_layer_scale(cache.v_scales, layer);
    const AttentionSplit split = plan_attention_split(
        q.rows * kv_heads * args.head_passes, batch.max_context, int64_t(kAttentionBlocksPerSm) * sm_count_,
        uint64_t(q.rows) * uint64_t(args.heads) * uint64_t(head_dim + 2) * sizeof(float), scratch_bytes_);
    args.splits = split.splits;
    if (split.splits > 1) {
      const uint64_t partials = uint64_t(q.rows) * uint64_t(args.heads) * uint64_t(split.splits);
      args.partial_acc = reinterpret_cast<float*>(scratch_);   // [rows, heads, splits, head_dim]
      args.partial_max = args.partial_acc + partials * uint64_t(head_dim);  // [rows, heads, splits]
      args.partial_sum = args.partial_max + partials;                        // [rows, heads, splits]
    }
    args.fault = fault_;
    const dim3 grid(unsigned(q.rows), unsigned(kv_heads * args.head_passes), unsigned(split.splits));
    with_float_type(act_, [&](auto act_tag) {
      with_kv_type(cache.dtype, [&](auto kv_tag) {
        using A = decltype(act_tag);
        using E = decltype(kv_tag);
        if constexpr (std::is_same<E, A>::value || std::is_same<E, KvFp8>::value) {
          switch (kernel_dims) {
            case 2: launch_attention<A, E, 2>(grid, args); break;
            case 3: launch_attention<A, E, 3>(grid, args); break;
            case 4: launch_attention<A, E, 4>(grid, args); break;
            case 8: launch_attention<A, E, 8>(grid, args); break;
            default:
              detail::fail(ErrorCode::internal, detail::format("attention: no kernel for %d dims per lane", kernel_dims));
          }
        } else {
          if (kernel_dims != kAttentionGenericDims)
            detail::fail(ErrorCode::internal, detail::format("attention: the generic kernel has %d dims per lane, not %d",
                                                             kAttentionGenericDims, kernel_dims));
          constexpr int kHeads = attention_heads_per_block(kAttentionGenericDims);
          launch("paged_attention_kernel", paged_attention_kernel<A, E, kAttentionGenericDims, kHeads, kPagedAttentionWarpsFew>,
                 grid, kPagedAttentionWarpsFew * 32, 0, args);
        }
        if (split.splits > 1) {
          launch("attention_combine_kernel", attention_combine_kernel<A>, dim3(unsigned(q.rows), unsigned(args.heads)), row_threads(head_dim), 0, args);
        }
      });
    });
  }

 private:
  // Blocks per SM the attention grid aims for before it splits contexts (4 warps each, so 16 warps an SM).
  static constexpr int kAttentionBlocksPerSm = 4;
  // Groups this wide or narrower get a warp each; wider ones a block of kNormBlockThreads.
  static constexpr int64_t kNormWarpGroupMax = 256;
  static constexpr int kNormBlockThreads = 256;

  // Teardown has no one to report to: a failure here means the context is already broken or going away.
  void release() noexcept {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (cublas_ != nullptr) cublas().destroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (host_staging_ != nullptr) cudaFreeHost(host_staging_);
    cublas_ = nullptr;
    stream_ = nullptr;
    host_staging_ = nullptr;
    host_staging_bytes_ = 0;
  }

  // CUDA's current device is per host thread: each op makes it ours (cheap when it already is).
  void activate() { KVLITE_CUDA_CHECK(cudaSetDevice(device_)); }

  // Calls launch(std::integral_constant<int, TEAM>, blocks, threads) for `teams` groups of `width` columns.
  template <class Launch>
  void launch_norm(const char* op, int64_t teams, int64_t width, Launch&& launch) {
    if (teams == 0) return;
    if (width <= kNormWarpGroupMax) {
      const int64_t teams_per_block = kNormBlockThreads / 32;
      const int64_t blocks = (teams + teams_per_block - 1) / teams_per_block;
      check_grid_rows(op, blocks);
      launch(std::integral_constant<int, 32>(), unsigned(blocks), unsigned(kNormBlockThreads));
    } else {
      check_grid_rows(op, teams);
      launch(std::integral_constant<int, kNormBlockThreads>(), unsigned(teams), unsigned(kNormBlockThreads));
    }
  }

  // ---- quantized GEMMs (section 3b) ---------------------------------------------------------------------------
  // Blocks of `instance` an SM holds; the first call per kernel raises its dynamic shared memory limit.
  int quant_gemm_blocks_per_sm(const QuantGemmInstance& instance) {
    const auto found = quant_gemm_occupancy_.find(reinterpret_cast<const void*>(instance.kernel));
    if (found != quant_gemm_occupancy_.end()) return found->second;
    KVLITE_CUDA_CHECK(cudaFuncSetAttribute(instance.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           instance.shared_bytes));
    int blocks = 0;
    KVLITE_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, instance.kernel, instance.threads, instance.shared_bytes));
    if (blocks < 1)
      detail::fail(ErrorCode::unsupported, detail::format("%s needs %d bytes of shared memory per block, more than %s "
                                                          "gives one block", instance.name, instance.shared_bytes,
                                                          device_name_.c_str()));
    quant_gemm_occupancy_[reinterpret_cast<const void*>(instance.kernel)] = blocks;
    return blocks;
  }

  // The tensor-core paths and the GEMV: per pass, the activations staged when they must be (W8A8: quantized;
  // A16 and the GEMV: permuted or unaligned), then one quant_gemm_kernel / quant_gemv_kernel launch (split-K
  // fix-up inside it).
  void quant_linear_mma(const Tensor& x, const QuantWeight& weight, const QuantGpuLayout& layout, QuantKernel kernel,
                        const Tensor& out) {
    const QgFormat format = kernel == QuantKernel::mma_w8a8        ? QgFormat::fp8_a8
                            : layout.format == WeightFormat::int4 ? QgFormat::int4_a16
                                                                  : QgFormat::fp8_a16;
    const bool aligned = reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.cols % 8 == 0 &&
                         (x.rows <= 1 || x.row_stride % 8 == 0);
    const bool gemv_mma = kernel == QuantKernel::gemv_mma;
    const bool gemv = kernel == QuantKernel::gemv_a16 || gemv_mma;
    const bool stage_x = (kernel == QuantKernel::mma_a16 || gemv) && (layout.permuted || !aligned);
    const ScaleProduct product = fp32_scale_products_ ? scale_product(weight.scale_dtype, weight.rounding, act_)
                                                      : ScaleProduct::pair_multiply;
    const QuantGemmInstance widest =
        gemv_mma ? quant_gemv_mma_instance(format, act_, product)
        : gemv   ? quant_gemv_instance(format, act_, quant_gemv_rows(std::min(x.rows, kQuantGemvMaxRows)), product)
                 : quant_gemm_instance(format, act_, quant_m_tiles(std::min<int64_t>(x.rows, 64)), product);
    const int64_t target_blocks = int64_t(sm_count_) * quant_gemm_blocks_per_sm(widest);
    QuantGemmPlan plan;
    std::string why;
    if (!plan_quant_gemm(layout, kernel, x.rows, stage_x, 2, scratch_bytes_, target_blocks, &plan, &why))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quant_linear(%s): %s; give the CUDA backend a larger workspace", weight.name.c_str(),
                                  why.c_str()));
    const uint8_t* base = quant_device_base(weight);
    QuantGemmArgs args{};
    args.n = layout.n;
    args.tiles = base + layout.tiles_offset;
    args.scales = base + layout.scales_offset;
    args.zeros = layout.zeros ? base + layout.zeros_offset : nullptr;
    args.bias = reinterpret_cast<const float*>(base + layout.bias_offset);
    args.counters = reinterpret_cast<unsigned*>(const_cast<uint8_t*>(base + layout.counters_offset));
    args.scale_bytes = int(dtype_bytes(layout.table_scale_dtype, 1));
    args.scale_dtype = layout.table_scale_dtype;
    args.scale_product = product;
    args.n_pad = layout.n_pad;
    args.stages = layout.stages;
    args.group_size = layout.group_size;
    args.group_shift = quant_group_shift(layout.group_size);
    if (layout.k_pad > INT32_MAX || layout.group_size > INT32_MAX)
      detail::fail(ErrorCode::unsupported,
                   detail::format("quant_linear: K %lld is past the GEMM kernels' 32-bit column index",
                                  (long long)layout.k_pad));
    args.tile_row_bytes = layout.tile_row_bytes();
    args.out_stride = leading_dimension(out);
    args.out_dtype = act_;
    uint8_t* staged = scratch_;
    args.partials = reinterpret_cast<float*>(scratch_ + plan.x_bytes);
    for (int64_t r0 = 0; r0 < x.rows; r0 += plan.row_chunk) {
      const int64_t rows = std::min(plan.row_chunk, x.rows - r0);
      const Tensor xs = x.slice_rows(r0, rows);
      if (kernel == QuantKernel::mma_w8a8) {
        const int64_t scales_stride = (rows + 63) / 64 * 64;
        float* x_scales = reinterpret_cast<float*>(staged + align_up(uint64_t(rows * layout.k_pad), 256));
        const dim3 grid(unsigned(rows), unsigned(layout.groups));
        if (act_ == DType::BF16)  // the mma kernels run BF16 or F16 activations only (quant_kernel_refusal)
          launch("quantize_activations_fp8_kernel", quantize_activations_fp8_kernel<__nv_bfloat16>, grid, 256, 0,
              typed_const<__nv_bfloat16>(xs), leading_dimension(xs), layout.k, layout.k_pad, layout.group_size, staged,
              x_scales, scales_stride);
        else
          launch("quantize_activations_fp8_kernel", quantize_activations_fp8_kernel<__half>, grid, 256, 0,
              typed_const<__half>(xs), leading_dimension(xs), layout.k, layout.k_pad, layout.group_size, staged,
              x_scales, scales_stride);
        args.x = staged;
        args.x_stride = layout.k_pad;
        args.k_valid = layout.k_pad;
        args.x_scales = x_scales;
        args.x_scales_stride = scales_stride;
      } else if (stage_x) {
        launch("stage_activations_kernel", stage_activations_kernel, unsigned(rows), 256, 0,
            typed_const<uint16_t>(xs), leading_dimension(xs), layout.k,
            layout.permuted ? reinterpret_cast<const int32_t*>(base + layout.perm_offset) : nullptr,
            reinterpret_cast<uint16_t*>(staged), layout.k_pad);
        args.x = staged;
        args.x_stride = layout.k_pad;
        args.k_valid = layout.k_pad;
      } else {
        args.x = xs.data;
        args.x_stride = leading_dimension(xs);
        args.k_valid = layout.k;
      }
      args.out = out.slice_rows(r0, rows).data;
      args.rows = rows;
      args.splits = rows <= 64 ? plan.splits : 1;
      const int m_tiles = quant_m_tiles(std::min<int64_t>(rows, 64));
      const QuantGemmInstance instance = gemv_mma ? quant_gemv_mma_instance(format, act_, product)
                                         : gemv   ? quant_gemv_instance(format, act_, quant_gemv_rows(rows), product)
                                                  : quant_gemm_instance(format, act_, m_tiles, product);
      quant_gemm_blocks_per_sm(instance);  // its shared memory limit raised
      // the GEMVs: one block row (rows <= kQuantGemvMaxRows / kQuantGemvMmaMaxRows, plan_quant_gemm's passes)
      const dim3 grid(gemv ? 1u : unsigned((rows + 16 * m_tiles - 1) / (16 * m_tiles)), unsigned(layout.n_tiles),
                      unsigned(args.splits));
      launch(instance.name, instance.kernel, grid, unsigned(instance.threads), size_t(instance.shared_bytes), args);
    }
  }

  // Dequantize + cuBLAS: out = bias, then per chunk of column tiles the weights dequantized into scratch in
  // the activation dtype (act-order undone) and one GEMM adding x @ chunk^T into its columns.
  void quant_linear_dequantize(const Tensor& x, const QuantWeight& weight, const QuantGpuLayout& layout,
                               const Tensor& out) {
    const int act_bytes = int(dtype_bytes(act_, 1));
    QuantGemmPlan plan;
    std::string why;
    if (!plan_quant_gemm(layout, QuantKernel::dequant_cublas, x.rows, false, act_bytes, scratch_bytes_, 1, &plan, &why))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quant_linear(%s): %s; give the CUDA backend a larger workspace", weight.name.c_str(),
                                  why.c_str()));
    if (x.rows > INT_MAX || layout.k_pad > INT_MAX || leading_dimension(x) > INT_MAX || leading_dimension(out) > INT_MAX)
      detail::fail(ErrorCode::unsupported, detail::format("quant_linear(%s): x [%lld, %lld] has a size or stride past "
                                                          "cuBLAS's 32-bit int; split the call", weight.name.c_str(),
                                                          (long long)x.rows, (long long)x.cols));
    const uint8_t* base = quant_device_base(weight);
    DequantArgs d{};
    d.format = layout.format;
    d.tiles = base + layout.tiles_offset;
    d.scales = base + layout.scales_offset;
    d.table_dtype = layout.table_scale_dtype;
    d.scale_dtype = weight.scale_dtype;
    d.rounding = weight.rounding;
    d.zeros = layout.zeros ? base + layout.zeros_offset : nullptr;
    d.perm = layout.permuted ? reinterpret_cast<const int32_t*>(base + layout.perm_offset) : nullptr;
    d.n_pad = layout.n_pad;
    d.k = layout.k;
    d.group_size = layout.group_size;
    d.tile_row_bytes = layout.tile_row_bytes();
    d.stage_bytes = uint64_t(layout.tiles_per_stage * layout.tile_bytes);
    d.w = scratch_;
    d.ldw = layout.k_pad;
    const float alpha = 1.0f, beta = 1.0f;
    const cudaDataType type = cuda_data_type(act_);
    with_float_type(act_, [&](auto tag) {
      using A = decltype(tag);
      launch("fill_rows_kernel", fill_rows_kernel<float, A>, row_grid(out.rows, out.cols), row_threads(out.cols), 0,
          reinterpret_cast<const float*>(base + layout.bias_offset), typed<A>(out), out.row_stride, out.cols);
      const int64_t chunk_tiles = plan.n_chunk / kQuantTileN;
      for (int64_t t0 = 0; t0 < layout.n_tiles; t0 += chunk_tiles) {
        const int64_t tiles = std::min(chunk_tiles, layout.n_tiles - t0);
        d.first_tile = t0;
        launch("dequantize_tiles_kernel", dequantize_tiles_kernel<A>, dim3(unsigned(tiles), unsigned(layout.stages)), kDequantThreads, 0, d);
        const int64_t n0 = t0 * kQuantTileN, columns = std::min(tiles * kQuantTileN, layout.n - n0);
        KVLITE_CUBLAS_CHECK(cublas().gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(columns), int(x.rows), int(layout.k),
                                         &alpha, scratch_, type, int(layout.k_pad), x.data, type,
                                         int(leading_dimension(x)), &beta, typed<A>(out) + n0, type,
                                         int(leading_dimension(out)), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
    });
  }

  // Every kernel launch: an ordinary one, or under programmatic_launch_ one with programmatic stream
  // serialization (the kernel may start while the one before it finishes; kernel_entry makes that safe). The
  // arguments convert to the kernel's parameter types as in a <<<>>> launch (cudaLaunchKernelEx coerces them).
  // A bad configuration (grid too large, too much shared memory) is reported at once; faults while the kernel
  // runs surface at the next synchronizing call.
  template <class... Params, class... Args>
  void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
              Args&&... args) {
#if KVLITE_PROGRAMMATIC_LAUNCH_BUILT
    if (programmatic_launch_) {
      cudaLaunchAttribute attribute{};
      attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute.val.programmaticStreamSerializationAllowed = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = grid;
      config.blockDim = block;
      config.dynamicSmemBytes = shared_bytes;
      config.stream = stream_;
      config.attrs = &attribute;
      config.numAttrs = 1;
      const cudaError_t status = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
      cudaGetLastError();  // a launch error is not sticky: cleared, as check_launch's own read clears it
      check_launch(name, status);
      return;
    }
#endif
    kernel<<<grid, block, shared_bytes, stream_>>>(std::forward<Args>(args)...);
    check_launch(name);
  }

  template <class A, class E, int DIMS>
  void launch_attention(dim3 grid, const AttentionArgs& args) {
    constexpr int kHeads = attention_heads_per_block(DIMS);
    const int64_t blocks = int64_t(grid.x) * grid.y * grid.z;
    if (paged_attention_warps(blocks, sm_count_) == kPagedAttentionWarpsMany)
      launch("paged_attention_kernel", paged_attention_kernel<A, E, DIMS, kHeads, kPagedAttentionWarpsMany>, grid, kPagedAttentionWarpsMany * 32, 0, args);
    else
      launch("paged_attention_kernel", paged_attention_kernel<A, E, DIMS, kHeads, kPagedAttentionWarpsFew>, grid, kPagedAttentionWarpsFew * 32, 0, args);
  }

  // Waits for the stream and reports, in this order: a CUDA error the queued work met, then the first
  // invalid index a kernel recorded (clearing the record, so the next call starts clean).
  void synchronize_and_report() {
    KVLITE_CUDA_CHECK(cudaMemcpyAsync(&host_fault_, fault_, sizeof(DeviceFault), cudaMemcpyDeviceToHost, stream_));
    KVLITE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (host_fault_.kind == fault_none) return;
    const DeviceFault f = host_fault_;
    KVLITE_CUDA_CHECK(cudaMemsetAsync(fault_, 0, sizeof(DeviceFault), stream_));
    KVLITE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::string message;
    switch (f.kind) {
      case fault_gather_id:
        message = detail::format("gather_rows: ids[%lld] = %lld is outside the table's %lld rows (found on the "
                                 "device; that output row is NaN)", f.index, f.value, f.limit);
        break;
      case fault_kv_slot:
        message = detail::format("kv_write: slots[%lld] = %lld is page %lld, past the cache's %lld pages (found on "
                                 "the device; that token was not stored)", f.index, f.value, f.extra, f.limit);
        break;
      case fault_attention_row:
        message = detail::format("attention: query row %lld belongs to no sequence; query_starts must rise from 0 "
                                 "to the %lld query rows", f.index, f.limit);
        break;
      case fault_attention_context:
        message = detail::format("attention: sequence %lld has context_lens %lld; it must be at least its %lld "
                                 "queries (they are the last tokens of its context) and at most max_context %lld",
                                 f.index, f.value, f.extra, f.limit);
        break;
      case fault_attention_page:
        message = detail::format("attention: block_tables[%lld][%lld] = %lld is not a page of the cache (%lld pages) "
                                 "but sequence %lld's context needs it", f.index, f.extra, f.value, f.limit, f.index);
        break;
      case fault_embedding_index:
        message = detail::format("embedding_bag: indices[%lld][%lld] = %lld is outside the table's %lld rows (found "
                                 "on the device; that output row is NaN)", f.index, f.extra, f.value, f.limit);
        break;
      case fault_segment_row:
        message = detail::format("segment_attention: row %lld belongs to no segment; segment_starts must rise from 0 "
                                 "to the %lld rows (found on the device; that row's output is NaN)", f.index, f.limit);
        break;
      case fault_segment_length:
        message = detail::format("segment_attention: segment %lld holds %lld rows, more than max_segment %lld or past "
                                 "the last row (found on the device; its rows' outputs are NaN)", f.index, f.value,
                                 f.limit);
        break;
      default:
        message = detail::format("a kernel left an unknown fault record (kind %d)", f.kind);
        detail::fail(ErrorCode::internal, message);
    }
    if (f.kind >= fault_attention_row && f.kind <= fault_attention_page)
      message += " (found on the device; the query rows it affects are NaN)";
    detail::fail(ErrorCode::invalid_argument, message);
  }

  int device_;
  DType act_;
  bool fp32_scale_products_;  // CudaBackendOptions::fp32_scale_products
  bool programmatic_launch_ = false;  // CudaBackendOptions::programmatic_launch, in effect (sm_90+)
  std::string device_name_;
  int sm_ = 0, sm_count_ = 1;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  DeviceFault* fault_ = nullptr;  // in the workspace
  DeviceFault host_fault_{};      // its copy, read at synchronizing calls
  uint8_t* scratch_ = nullptr;    // in the workspace: split attention's partials, quantized GEMMs' staging
  void* host_staging_ = nullptr;  // pinned host memory: gather_host_rows' rows (CudaBackendOptions::host_staging_bytes)
  uint64_t host_staging_bytes_ = 0;
  uint64_t scratch_bytes_ = 0;
  QuantKernel forced_quant_kernel_ = QuantKernel::automatic;           // set_quant_kernel
  std::unordered_map<const void*, int> quant_gemm_occupancy_;          // kernel -> blocks per SM, limit raised
};

}  // namespace

// ---- entry points (device.hpp) ------------------------------------------------------------------------------

bool built_with_cuda() { return true; }

int device_count(std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky status, report none
    if (why) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
    return 0;
  }
  if (why && count == 0) *why = "cudaGetDeviceCount: 0 devices";
  return count;
}

Result<DeviceSpec> query_device(int index) {
  cudaDeviceProp prop;
  KVLITE_CUDA_TRY(cudaGetDeviceProperties(&prop, index));
  KVLITE_CUDA_TRY(cudaSetDevice(index));
  size_t free_bytes = 0, total_bytes = 0;
  KVLITE_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  DeviceSpec spec;
  spec.backend = BackendKind::cuda;
  spec.name = prop.name;
  spec.total_bytes = total_bytes;
  spec.free_bytes = free_bytes;
  spec.sm = prop.major * 10 + prop.minor;
  spec.multiprocessors = prop.multiProcessorCount;
  spec.threads_per_multiprocessor = prop.maxThreadsPerMultiProcessor;
  spec.queried = true;
  spec.integrated = prop.integrated != 0;  // Jetson: the GPU shares the system's memory (plan_gpu_device)
  return spec;
}

Result<void*> allocate_arena(uint64_t bytes) {
  void* pointer = nullptr;
  cudaError_t status = counted_cuda_malloc(&pointer, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    return Error(ErrorCode::out_of_memory,
                 detail::format("cudaMalloc of the %s arena failed (%s): the device has %s free of %s; lower "
                                "--utilization or free the GPU",
                                format_bytes(bytes).c_str(), cudaGetErrorString(status),
                                format_bytes(free_bytes).c_str(), format_bytes(total_bytes).c_str()));
  }
  return pointer;
}

Status free_arena(void* pointer) {
  KVLITE_CUDA_TRY(cudaFree(pointer));
  return Status();
}

Result<std::pair<uint64_t, uint64_t>> memory_info() {
  size_t free_bytes = 0, total_bytes = 0;
  KVLITE_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  return std::pair<uint64_t, uint64_t>(free_bytes, total_bytes);
}

// ---- entry points (backend_cuda.hpp) -----------------------------------------------------------------------

Status argmax(Backend& backend, const Tensor& logits, const Tensor& ids) {
  return detail::guard([&] {
    auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
    if (cuda_backend == nullptr)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cuda::argmax: the backend is %s, not a CUDA backend", backend.name().c_str()));
    const DType act = backend.activation_dtype();
    if (logits.dtype != act || logits.rows < 0 || logits.cols <= 0 || logits.cols > INT_MAX ||
        (logits.rows > 1 && logits.row_stride < logits.cols) || logits.data == nullptr)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cuda::argmax: logits are [%lld, %lld] %s (row stride %lld); they must be %s with 1 "
                                  "to %d columns and a stride of at least the columns", (long long)logits.rows,
                                  (long long)logits.cols, dtype_name(logits.dtype), (long long)logits.row_stride,
                                  dtype_name(act), INT_MAX));
    if (ids.dtype != DType::I32 || ids.elements() != logits.rows || (ids.rows != 1 && ids.cols != 1) ||
        !ids.contiguous() || (ids.elements() > 0 && ids.data == nullptr))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cuda::argmax: ids are [%lld, %lld] %s; they must be a contiguous I32 vector of the "
                                  "%lld logits rows", (long long)ids.rows, (long long)ids.cols, dtype_name(ids.dtype),
                                  (long long)logits.rows));
    cuda_backend->argmax(logits, ids);
  });
}

Result<void*> backend_stream(Backend& backend) {
  return detail::guard([&]() -> void* {
    auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
    if (cuda_backend == nullptr)
      detail::fail(ErrorCode::invalid_argument, detail::format("cuda::backend_stream: the backend is %s, not a CUDA "
                                                               "backend", backend.name().c_str()));
    return cuda_backend->stream();
  });
}

uint64_t device_allocations() { return g_device_allocations.load(); }

Status set_quant_kernel(Backend& backend, QuantKernel kernel) {
  return detail::guard([&] {
    auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
    if (cuda_backend == nullptr)
      detail::fail(ErrorCode::invalid_argument, detail::format("cuda::set_quant_kernel: the backend is %s, not a CUDA "
                                                               "backend", backend.name().c_str()));
    if (kernel == QuantKernel::mma_w8a8 && cuda_backend->sm() < kQuantW8A8MinSm)
      detail::fail(ErrorCode::unsupported,
                   detail::format("cuda::set_quant_kernel: W8A8 needs compute capability 8.9 or newer; this GPU is sm_%d",
                                  cuda_backend->sm()));
    cuda_backend->set_quant_kernel(kernel);
  });
}

Result<QuantWeight> upload_quant_weight(Backend& backend, const QuantWeight& host, void* device_dst, uint64_t capacity) {
  return upload_quant_weight(backend, std::vector<const QuantWeight*>{&host}, device_dst, capacity);
}

Result<QuantWeight> upload_quant_weight(Backend& backend, const std::vector<const QuantWeight*>& parts, void* device_dst,
                                        uint64_t capacity) {
  return detail::guard([&] {
    if (parts.empty() || std::find(parts.begin(), parts.end(), nullptr) != parts.end())
      detail::fail(ErrorCode::invalid_argument, "cuda::upload_quant_weight: no Linear given");
    std::string joined = parts[0]->name;  // the fused view's name: "...q_proj+...k_proj+...v_proj"
    for (size_t i = 1; i < parts.size(); i++) joined += "+" + parts[i]->name;
    const char* name = joined.c_str();
    const QuantWeight& host = *parts[0];
    auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
    if (cuda_backend == nullptr)
      detail::fail(ErrorCode::invalid_argument, detail::format("cuda::upload_quant_weight(%s): the backend is %s, not a "
                                                               "CUDA backend", name, backend.name().c_str()));
    for (const QuantWeight* part : parts)
      if (part->layout != QuantLayout::checkpoint ||
          (part->format != WeightFormat::int4 && part->format != WeightFormat::fp8 && part->format != WeightFormat::int8))
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("cuda::upload_quant_weight(%s): pass the checkpoint view of an int4, int8 or fp8 Linear "
                                    "(quant_weight), not %s", part->name.c_str(),
                                    part->layout != QuantLayout::checkpoint ? "an uploaded one"
                                                                            : weight_format_name(part->format)));
    const std::string refusal = parts.size() > 1 ? quant_fusion_refusal(parts) : std::string();
    if (!refusal.empty())
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cuda::upload_quant_weight(%s): these Linears do not fuse: %s", name, refusal.c_str()));
    const QuantGpuLayout layout = quant_gpu_layout(parts);
    if (capacity < layout.total_bytes || device_dst == nullptr || reinterpret_cast<uintptr_t>(device_dst) % 256 != 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cuda::upload_quant_weight(%s): needs %s of device memory, 256-byte aligned "
                                  "(quant_device_bytes); got %s at %p", name, format_bytes(layout.total_bytes).c_str(),
                                  format_bytes(capacity).c_str(), device_dst));
    // W8A16 multiplies decoded e4m3 values by scale * 2^fix in bf16/f16 (quant_gpu.hpp): that must stay finite.
    const DType activation = backend.activation_dtype();
    if (host.format == WeightFormat::fp8 && !quant_w8a8_preferred(cuda_backend->sm()) && activation != DType::F32) {
      const bool bf16 = activation == DType::BF16;
      const float limit = bf16 ? 3.0e38f : 65504.0f;
      for (const QuantWeight* part : parts)
        for (int64_t i = 0; i < part->scale_rows * part->scale_cols; i++) {
          const float folded = fp8_folded_scale(std::fabs(scale_at(part->scales, part->scale_dtype, i)), bf16);
          if (!(folded <= limit))
            detail::fail(ErrorCode::unsupported,
                         detail::format("cuda::upload_quant_weight(%s): scale %g is too large for W8A16 in %s (the "
                                        "kernels multiply by it times 2^%d)", part->name.c_str(),
                                        scale_at(part->scales, part->scale_dtype, i), dtype_name(activation),
                                        fp8_exponent_fix(bf16)));
        }
    }
    uint8_t* dst = static_cast<uint8_t*>(device_dst);
    auto copy = [&](const std::vector<uint8_t>& bytes, uint64_t size, uint64_t offset) {
      const Status copied = backend.copy_from_host(bytes.data(), Tensor::matrix(dst + offset, DType::U8, 1, int64_t(size)));
      if (!copied.ok()) throw copied.error();
    };
    // The tiles, a few MiB of column tiles at a time, repacked by worker threads.
    const uint64_t row_bytes = layout.tile_row_bytes();
    const int64_t chunk_tiles = std::max<int64_t>(1, int64_t((16 * MiB) / row_bytes));
    const int workers = int(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
    std::vector<uint8_t> buffer(size_t(std::min<int64_t>(chunk_tiles, layout.n_tiles)) * row_bytes);
    for (int64_t t0 = 0; t0 < layout.n_tiles; t0 += chunk_tiles) {
      const int64_t count = std::min(chunk_tiles, layout.n_tiles - t0);
      const int64_t per_worker = (count + workers - 1) / workers;
      std::vector<Status> results(static_cast<size_t>(workers));
      std::vector<std::thread> threads;
      for (int i = 0; i < workers && i * per_worker < count; i++) {
        const int64_t first = i * per_worker, tiles = std::min(per_worker, count - first);
        threads.emplace_back([&, i, first, tiles] {
          results[size_t(i)] = repack_quant_tiles(parts, layout, t0 + first, tiles, buffer.data() + first * row_bytes);
        });
      }
      for (std::thread& thread : threads) thread.join();
      for (const Status& result : results)
        if (!result.ok()) throw result.error();
      copy(buffer, uint64_t(count) * row_bytes, layout.tiles_offset + uint64_t(t0) * row_bytes);
    }
    std::vector<uint8_t> tables(size_t(layout.total_bytes - layout.scales_offset));
    const Status repacked = repack_quant_tables(parts, layout, tables.data());
    if (!repacked.ok()) throw repacked.error();
    copy(tables, tables.size(), layout.scales_offset);

    QuantWeight device = host;
    if (parts.size() > 1) {
      device.name = joined;
      for (size_t i = 1; i < parts.size(); i++) device.out_features += parts[i]->out_features;
      // the device table holds a scale per column: parts' tensor scales are column scales there
      if (host.format == WeightFormat::fp8 && host.granularity == ScaleGranularity::tensor)
        device.granularity = ScaleGranularity::channel;
      device.scale_rows = device.scale_cols = 0;  // the checkpoint's scale tensors are the parts', not this view's
    }
    device.layout = QuantLayout::cuda_tiles;
    device.packed = host.format == WeightFormat::int4 ? dst : nullptr;
    device.fp8 = host.format == WeightFormat::fp8 ? dst : nullptr;
    device.int8 = host.format == WeightFormat::int8 ? dst : nullptr;
    device.scales = dst + layout.scales_offset;
    device.zero_points = layout.zeros ? dst + layout.zeros_offset : nullptr;
    device.g_idx = layout.permuted ? dst + layout.perm_offset : nullptr;
    device.bias = dst + layout.bias_offset;
    device.bias_dtype = DType::F32;
    return device;
  });
}

namespace {
CudaBackend& cuda_backend_of(Backend& backend, const char* call) {
  auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
  if (cuda_backend == nullptr)
    detail::fail(ErrorCode::invalid_argument,
                 detail::format("%s: the backend is %s, not a CUDA backend", call, backend.name().c_str()));
  return *cuda_backend;
}
}  // namespace

Status sample(Backend& backend, const Tensor& logits, const Tensor& params, const Tensor& scratch, const Tensor& ids) {
  return detail::guard([&] {
    CudaBackend& cuda_backend = cuda_backend_of(backend, "cuda::sample");
    const int64_t n = ids.elements();
    auto bad = [&](const char* what) {
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cuda::sample: %s (logits [%lld, %lld] %s, params [%lld, %lld] %s, scratch [%lld, "
                                  "%lld] %s, ids %lld %s)", what, (long long)logits.rows, (long long)logits.cols,
                                  dtype_name(logits.dtype), (long long)params.rows, (long long)params.cols,
                                  dtype_name(params.dtype), (long long)scratch.rows, (long long)scratch.cols,
                                  dtype_name(scratch.dtype), (long long)n, dtype_name(ids.dtype)));
    };
    if (!is_float_dtype(logits.dtype) || logits.cols <= 0 || logits.cols > INT_MAX || logits.data == nullptr ||
        (logits.rows > 1 && logits.row_stride < logits.cols))
      bad("logits must be F32, BF16 or F16 with 1 to 2^31 - 1 columns");
    if (ids.dtype != DType::I32 || !ids.contiguous() || (ids.rows != 1 && ids.cols != 1) || (n > 0 && ids.data == nullptr))
      bad("ids must be a contiguous I32 vector");
    if (params.dtype != DType::I32 || params.rows != n || params.cols != kSamplingParamWords || !params.contiguous() ||
        (n > 0 && params.data == nullptr))
      bad("params must be I32 [ids, 6], contiguous");
    if (scratch.dtype != DType::F32 || scratch.rows < n || scratch.cols != logits.cols ||
        (scratch.rows > 1 && scratch.row_stride < scratch.cols) || (n > 0 && scratch.data == nullptr))
      bad("scratch must be F32 with a row of V per id");
    cuda_backend.sample(logits, params, scratch, ids);
  });
}

Result<double> copy_bandwidth(Backend& backend, void* dst, const void* src, uint64_t bytes, int repeats) {
  return detail::guard([&] {
    CudaBackend& cuda_backend = cuda_backend_of(backend, "cuda::copy_bandwidth");
    const uint8_t* s = static_cast<const uint8_t*>(src);
    const uint8_t* d = static_cast<const uint8_t*>(dst);
    if (bytes == 0 || repeats < 1 || src == nullptr || dst == nullptr || (s < d + bytes && d < s + bytes))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cuda::copy_bandwidth: %llu bytes x %d repeats between %p and %p: copy at least one "
                                  "byte at least once between ranges that do not overlap",
                                  (unsigned long long)bytes, repeats, src, dst));
    return cuda_backend.copy_bandwidth(dst, src, bytes, repeats);
  });
}

Result<CudaGraph> capture_graph(Backend& backend, const std::function<void()>& record) {
  return detail::guard([&] { return cuda_backend_of(backend, "cuda::capture_graph").capture(record); });
}

Status launch_graph(Backend& backend, const CudaGraph& graph) {
  return detail::guard([&] {
    CudaBackend& cuda_backend = cuda_backend_of(backend, "cuda::launch_graph");
    if (graph.empty()) detail::fail(ErrorCode::invalid_argument, "cuda::launch_graph: the graph is empty (never captured)");
    cuda_backend.launch(graph);
  });
}

}  // namespace cuda

CudaGraph::~CudaGraph() {
  // Teardown reports to no one: a failure here means the context is already gone.
  if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}

CudaGraph& CudaGraph::operator=(CudaGraph&& other) noexcept {
  if (this != &other) {
    if (exec_ != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    exec_ = other.exec_;
    other.exec_ = nullptr;
  }
  return *this;
}

Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options) {
  return detail::guard([&]() -> std::unique_ptr<Backend> { return std::make_unique<cuda::CudaBackend>(options); });
}

}  // namespace kvlite
