// bench/gemv_stream.cu -> build/bench-gemv_stream: how fast can a decode GEMV *stream* its weights, before any
// math? The W4A16 GEMVs (kernels.cu quant_gemv_kernel / quant_gemv_mma_kernel) read the GPU layout's 512-byte
// tiles (one warp, 16 bytes a lane) at 22-62% of copy bandwidth on an H100 and take as long on an H200, whose memory
// is 1.4x faster (bench/RESULTS.md, 2026-11-26): something other than DRAM holds them. This bench takes the
// question apart on the real shapes, reading exactly the bytes the GEMV reads, in the same tile order:
//
//   flat        a persistent grid streaming the whole matrix, 16 B a lane, 8 loads in flight: the read ceiling
//   pattern     the GEMVs' grid (1 block a 64-column tile, split-K to fill the GPU once, each warp a
//               contiguous run of k tiles), with W warps a block and U tiles in flight a lane
//   +math       the same with ~48 dependent-free FP ops a 16-byte chunk, about what dequantizing 32 int4 and
//               feeding the mma costs, to see whether the math hides under the loads or adds to them
//   graph node  the time a CUDA-graph node costs between kernels, plain and with programmatic dependent launch
//               (PDL: the next kernel's blocks start while the last one drains), for a decode step's ~300 nodes
//
// Every variant must read every byte once: each folds the 16-byte words it loads into an XOR, and the XOR of the
// whole matrix (computed here on the CPU from the same random bytes) must come back. Times: CUDA events around a
// CUDA graph of repeated launches, median of 5 replays. Bandwidth counts bytes read (a GEMV's weights: read once).
//
//   build/bench-gemv_stream [--quick]
// Exit status 1 when a checksum is wrong.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace {

#define STREAM_CUDA(call)                                                                          \
  do {                                                                                             \
    cudaError_t stream_status_ = (call);                                                           \
    if (stream_status_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s failed: %s\n", __FILE__, __LINE__, #call,                     \
                   cudaGetErrorString(stream_status_));                                            \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

constexpr int kTileBytes = 512;  // one int4 tile: 64 columns x 16 k, 16 bytes a lane
constexpr int kTileK = 16;

__device__ __forceinline__ uint4 load_streamed(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ uint32_t fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// ~kMath FP ops over the chunk's four words, four independent chains, folded back so nothing is dead.
template <int kMath>
__device__ __forceinline__ uint32_t fold_with_math(uint4 v) {
  if constexpr (kMath == 0) {
    return fold(v);
  } else {
    float f[4] = {__uint_as_float((v.x & 0x007fffffu) | 0x3f800000u), __uint_as_float((v.y & 0x007fffffu) | 0x3f800000u),
                  __uint_as_float((v.z & 0x007fffffu) | 0x3f800000u), __uint_as_float((v.w & 0x007fffffu) | 0x3f800000u)};
#pragma unroll
    for (int i = 0; i < kMath / 4; i++)
#pragma unroll
      for (int c = 0; c < 4; c++) f[c] = fmaf(f[c], 0.999f, 0.001f);
    // the chains' results are always in [1, 2): fold them in as 0 so the checksum stays the data's
    const uint32_t zero = (__float_as_uint(f[0] + f[1] + f[2] + f[3]) >> 31);
    return fold(v) ^ zero;
  }
}

__device__ __forceinline__ void warp_xor_out(uint32_t acc, uint32_t* sink) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
  if (threadIdx.x % 32 == 0) atomicXor(sink, acc);
}

// flat: a persistent grid, each thread 8 16-byte loads in flight per step.
__global__ void __launch_bounds__(256) flat_kernel(const uint4* data, int64_t count, uint32_t* sink) {
  constexpr int kUnroll = 8;
  uint32_t acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < count; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) v[u] = load_streamed(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; u++) acc ^= fold(v[u]);
  }
  for (; i < count; i += stride) acc ^= fold(load_streamed(data + i));
  warp_xor_out(acc, sink);
}

// pattern: grid (1, n_tiles, splits), block = warps x 32; tile (n, t) at (n * k_tiles + t) * 512 bytes. The block's
// split is [k_tiles s / splits, k_tiles (s + 1) / splits); warp w takes a contiguous run of it (as the GEMVs do).
template <int kUnroll, int kMath>
__global__ void pattern_kernel(const uint8_t* tiles, int64_t k_tiles, uint32_t* sink) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t splits = gridDim.z, split = blockIdx.z;
  const int64_t s_begin = k_tiles * split / splits, s_end = k_tiles * (split + 1) / splits;
  const int64_t per_warp = (s_end - s_begin + warps - 1) / warps;
  const int64_t t_begin = s_begin + warp * per_warp, t_end = t_begin + per_warp < s_end ? t_begin + per_warp : s_end;
  const uint8_t* base = tiles + uint64_t(blockIdx.y) * uint64_t(k_tiles) * kTileBytes + 16 * lane;
  uint32_t acc = 0;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++)
      v[u] = t0 + u < t_end ? load_streamed(reinterpret_cast<const uint4*>(base + uint64_t(t0 + u) * kTileBytes))
                            : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; u++) acc ^= fold_with_math<kMath>(v[u]);
  }
  warp_xor_out(acc, sink);
}

using PatternKernel = void (*)(const uint8_t*, int64_t, uint32_t*);
template <int kMath>
PatternKernel pattern_instance(int unroll) {
  switch (unroll) {
    case 2: return &pattern_kernel<2, kMath>;
    case 4: return &pattern_kernel<4, kMath>;
    case 8: return &pattern_kernel<8, kMath>;
    default: return &pattern_kernel<16, kMath>;
  }
}

// graph nodes: a small kernel (one block) or one that touches a little memory on every SM; with PDL it waits for
// the previous kernel's memory (griddepcontrol.wait) after its launch is already resident.
template <bool kPdl>
__global__ void node_kernel(uint32_t* data, int64_t count) {
#if __CUDA_ARCH__ >= 900
  if constexpr (kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    data[i] = data[i] * 1664525u + 1013904223u;
#if __CUDA_ARCH__ >= 900
  if constexpr (kPdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Microseconds per call: a graph of `reps` calls, median of 5 replays.
double graph_us(cudaStream_t stream, int reps, const std::function<void()>& call) {
  call();
  STREAM_CUDA(cudaStreamSynchronize(stream));
  STREAM_CUDA(cudaGetLastError());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  STREAM_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int r = 0; r < reps; r++) call();
  STREAM_CUDA(cudaStreamEndCapture(stream, &graph));
  STREAM_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  STREAM_CUDA(cudaEventCreate(&start));
  STREAM_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms(5);
  STREAM_CUDA(cudaGraphLaunch(exec, stream));  // warm
  for (float& m : ms) {
    STREAM_CUDA(cudaEventRecord(start, stream));
    STREAM_CUDA(cudaGraphLaunch(exec, stream));
    STREAM_CUDA(cudaEventRecord(stop, stream));
    STREAM_CUDA(cudaEventSynchronize(stop));
    STREAM_CUDA(cudaEventElapsedTime(&m, start, stop));
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return 1000.0 * ms[2] / reps;
}

struct Shape {
  const char* name;
  int64_t n, k;
};
const Shape kShapes[] = {
    {"llama qkv", 6144, 4096},  {"llama o", 4096, 4096},   {"llama gate_up", 28672, 4096},
    {"llama down", 4096, 14336}, {"qwen qkv", 6144, 2560}, {"qwen gate_up", 19456, 2560},
    {"qwen down", 2560, 9728},   {"llama lm_head", 128256, 4096},
};

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench-gemv_stream: no CUDA GPU; nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop;
  STREAM_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("bench-gemv_stream on %s (%d SMs, L2 %d MB)\n", prop.name, sms, prop.l2CacheSize >> 20);
  cudaStream_t stream;
  STREAM_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // One buffer for the largest shape (lm_head, 263 MB), random bytes made here so the CPU knows every XOR.
  int64_t max_bytes = 0;
  for (const Shape& s : kShapes) max_bytes = std::max(max_bytes, s.n * s.k / 2);
  std::vector<uint32_t> host(size_t(max_bytes / 4));
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (uint32_t& word : host) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    word = uint32_t(state >> 16);
  }
  // A few copies of the smaller shapes rotate so that repeated calls do not read a warm L2 (50-60 MB).
  constexpr int kCopies = 4;
  uint8_t* device = nullptr;
  STREAM_CUDA(cudaMalloc(&device, uint64_t(max_bytes) * kCopies));
  for (int c = 0; c < kCopies; c++)
    STREAM_CUDA(cudaMemcpy(device + uint64_t(max_bytes) * c, host.data(), uint64_t(max_bytes), cudaMemcpyHostToDevice));
  uint32_t* sink = nullptr;
  STREAM_CUDA(cudaMalloc(&sink, 4));

  bool all_ok = true;
  // The CPU's XOR of the data's first `bytes`, computed once per size (every configuration of a shape checks it).
  std::map<int64_t, uint32_t> xor_of_prefix;
  auto xor_of = [&](int64_t bytes) {
    const auto [entry, fresh] = xor_of_prefix.try_emplace(bytes, 0u);
    if (fresh)
      for (int64_t i = 0; i < bytes / 4; i++) entry->second ^= host[size_t(i)];
    return entry->second;
  };
  // Runs `launch` once on copy 0 and compares the XOR it leaves in `sink` with `want`.
  auto check = [&](const char* what, uint32_t want, const std::function<void(const uint8_t*)>& launch) {
    // all on `stream` (non-blocking: it does not wait for the legacy default stream, nor that one for it)
    STREAM_CUDA(cudaMemsetAsync(sink, 0, 4, stream));
    launch(device);
    STREAM_CUDA(cudaGetLastError());
    uint32_t got = 0;
    STREAM_CUDA(cudaMemcpyAsync(&got, sink, 4, cudaMemcpyDeviceToHost, stream));
    STREAM_CUDA(cudaStreamSynchronize(stream));
    if (got != want) {
      std::printf("CHECKSUM WRONG: %s: got %08x want %08x\n", what, got, want);
      all_ok = false;
    }
  };
  // check, then microseconds a launch, rotating over the copies.
  auto measure = [&](const char* what, int64_t bytes, const std::function<void(const uint8_t*)>& launch) -> double {
    check(what, xor_of(bytes), launch);
    int copy = 0;
    return graph_us(stream, 40, [&] { launch(device + uint64_t(max_bytes) * (copy++ % kCopies)); });
  };

  // ---- the read ceiling: flat streaming of ~800 MB (three of the copies: an odd count, whose XOR is one copy's) ---
  int flat_blocks_per_sm = 0;
  STREAM_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&flat_blocks_per_sm, flat_kernel, 256, 0));
  {
    const int64_t bytes = max_bytes * 3;  // max_bytes is a multiple of 16 (n k / 2, k a multiple of 32)
    auto flat_read = [&](const uint8_t* p) {
      flat_kernel<<<sms * flat_blocks_per_sm, 256, 0, stream>>>(reinterpret_cast<const uint4*>(p), bytes / 16, sink);
    };
    check("flat read", xor_of(max_bytes), flat_read);
    const double us = graph_us(stream, 5, [&] { flat_read(device); });
    std::printf("read ceiling: flat read of %.0f MB: %.1f us, %.0f GB/s read\n\n", bytes / 1e6, us, bytes / us / 1e3);
  }

  // ---- the GEMV pattern, per shape ---------------------------------------------------------------------------------
  std::printf("%-14s %-8s %7s | %-34s | %9s %7s %7s\n", "shape", "MB", "flat us", "pattern (warps, unroll, math, splits)",
              "us", "GB/s", "x flat");
  const int warps_list[] = {4, 8};
  const int unroll_list[] = {4, 8, 16};
  for (const Shape& s : kShapes) {
    if (quick && std::strcmp(s.name, "llama gate_up") != 0 && std::strcmp(s.name, "llama qkv") != 0) continue;
    const int64_t bytes = s.n * s.k / 2, n_tiles = s.n / 64, k_tiles = s.k / kTileK;
    const double flat_us = measure("flat", bytes, [&](const uint8_t* p) {
      flat_kernel<<<sms * flat_blocks_per_sm, 256, 0, stream>>>(reinterpret_cast<const uint4*>(p), bytes / 16, sink);
    });
    struct Row {
      std::string what;
      double us;
    };
    std::vector<Row> rows;
    for (int math : {0, 48}) {
      for (int warps : warps_list) {
        for (int unroll : unroll_list) {
          if (math && !(unroll == 4 || unroll == 8)) continue;
          const PatternKernel kernel = math ? pattern_instance<48>(unroll) : pattern_instance<0>(unroll);
          int per_sm = 0;
          STREAM_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, warps * 32, 0));
          // the library's rule (quant_gpu.inl plan_quant_gemm): fill the GPU once, each split >= 2 stages of 128 k;
          // the GEMVs hold 2-3 blocks an SM, so target 2 x SMs as they do, and the occupancy's own count as well
          for (int target_per_sm : {2, per_sm}) {
            const int64_t target = int64_t(sms) * target_per_sm;
            int64_t splits = n_tiles < target ? std::min<int64_t>(target / n_tiles, s.k / 128 / 2) : 1;
            splits = std::max<int64_t>(splits, 1);
            char what[96];
            std::snprintf(what, sizeof what, "w%d u%-2d m%-2d s%-3lld (%d/SM)", warps, unroll, math, (long long)splits,
                          target_per_sm);
            const double us = measure(what, bytes, [&](const uint8_t* p) {
              kernel<<<dim3(1, unsigned(n_tiles), unsigned(splits)), warps * 32, 0, stream>>>(p, k_tiles, sink);
            });
            rows.push_back({what, us});
            if (target_per_sm == per_sm) break;
          }
        }
      }
    }
    for (const Row& r : rows)
      std::printf("%-14s %8.1f %7.1f | %-34s | %9.1f %7.0f %7.2f\n", s.name, bytes / 1e6, flat_us, r.what.c_str(), r.us,
                  bytes / r.us / 1e3, flat_us / r.us);
    std::printf("\n");
  }

  // ---- CUDA-graph node cost ----------------------------------------------------------------------------------------
  {
    uint32_t* data = nullptr;
    STREAM_CUDA(cudaMalloc(&data, uint64_t(2 * sms) * 256 * 4));
    STREAM_CUDA(cudaMemset(data, 1, uint64_t(2 * sms) * 256 * 4));
    auto launch = [&](bool pdl, int blocks) {
      const int64_t count = int64_t(blocks) * 256;  // one word a thread: the node is all launch
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(unsigned(blocks));
      config.blockDim = dim3(256);
      config.stream = stream;
      cudaLaunchAttribute attribute[1];
      attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute[0].val.programmaticStreamSerializationAllowed = 1;
      config.attrs = attribute;
      config.numAttrs = pdl ? 1 : 0;
      if (pdl) STREAM_CUDA(cudaLaunchKernelEx(&config, node_kernel<true>, data, count));
      else STREAM_CUDA(cudaLaunchKernelEx(&config, node_kernel<false>, data, count));
    };
    for (int blocks : {1, sms, 2 * sms}) {
      const double plain = graph_us(stream, 300, [&] { launch(false, blocks); });
      const double pdl = graph_us(stream, 300, [&] { launch(true, blocks); });
      std::printf("graph node, %4d blocks of 256: %.2f us a node plain, %.2f us with PDL\n", blocks, plain, pdl);
    }
    cudaFree(data);
  }

  cudaFree(sink);
  cudaFree(device);
  std::printf("\nbench-gemv_stream: %s\n", all_ok ? "all checksums right" : "CHECKSUM FAILURES");
  return all_ok ? 0 : 1;
}
