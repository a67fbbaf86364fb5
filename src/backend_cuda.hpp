// ---------------------------------------------------------------------------------------------------------
// backend_cuda: the CUDA implementation of Backend (its code is in kernels.cu), its options, two CUDA-only
// extras, and the index math its kernels share with the host (__host__ __device__, unit-tested on the CPU in
// tests/unit-cuda-host.cpp).
//
// Activations: BF16 by default (CudaBackendOptions::activation_dtype; F16 for F16 checkpoints, F32 to match
// the CPU reference closely). Every op computes in fp32 and rounds once when it stores.
// Linear: cuBLAS (cublasGemmEx) with the weight in the activation dtype and fp32 accumulation (split-K
// reductions in fp32 too); the loader converts other weight dtypes when it uploads them (copy).
// Memory: the backend allocates no device memory of its own. Its workspace comes from the caller (the arena's
// "workspace" region) and is carved once:
//
//   workspace ──► | cuBLAS workspace (cublas_workspace_bytes) | fault record (256 B) | scratch ... |
//
// cuBLAS is handed the first part with cublasSetWorkspace, so it never allocates while running; the scratch
// holds split attention's partial results and, within one quant_linear call, the quantized GEMMs' staged
// activations, split-K partials and dequantized weight chunks (quant_gpu.hpp: plan_quant_gemm). Index vectors (ids, slots, query_starts, context_lens,
// block_tables) live on the device, so their values are checked by the kernels: the first bad value is kept
// in the fault record and reported as invalid_argument by the next synchronize(), copy_to_host() or
// copy_from_host(); the output rows it affects are NaN (kv_write: the token is not stored).
// ---------------------------------------------------------------------------------------------------------
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>

namespace kvlite {

// kCudaCublasWorkspaceBytes, kCudaScratchBytes and kCudaWorkspaceBytes are in plan.hpp: the planner reserves the
// workspace the backend carves, from the same numbers.
// The least scratch the backend starts with (the fault record and a few partials).
constexpr uint64_t kCudaMinScratchBytes = 64 * KiB;
// kernels.cu's attention holds head_dim / 32 (rounded up) dimensions per lane, at most 8.
constexpr int64_t kCudaMaxHeadDim = 256;

struct CudaBackendOptions {
  int device = 0;                         // CUDA device index
  void* workspace = nullptr;              // device memory on `device`, 256-byte aligned (the arena's region)
  uint64_t workspace_bytes = 0;           // at least cublas_workspace_bytes + kCudaMinScratchBytes
  uint64_t cublas_workspace_bytes = kCudaCublasWorkspaceBytes;  // the front of the workspace, cuBLAS's
  DType activation_dtype = DType::BF16;   // BF16, F16 or F32
  // Quantized Linears whose checkpoint scales are not the activation dtype (F32 weight_scale_inv, the FP8
  // checkpoints' usual form; BF16 scales under F16 activations): false (the default) rounds each scale to the
  // activation dtype and multiplies there (one bf16x2 / f16x2 multiply a pair: each weight up to 2 steps of that
  // dtype from the reference's, rounded twice); true multiplies in fp32 and rounds once (cuda::ScaleProduct: each
  // weight the reference's rounded once, bit for bit). Measured on an H200 (bench/RESULTS.md, 2026-11-26, fourth
  // session): true decodes Qwen3-VL-4B FP8 (F32 block scales) at 60 tok/s against 188, so it is not the default;
  // scaling each group's fp32 partial sums instead of each weight is the fast way to the same single rounding.
  bool fp32_scale_products = false;
  // Programmatic dependent launch (sm_90+: H100, H200, RTX 50-series; ignored before, and with a CUDA runtime older
  // than 12.0): each kernel is launched so that it may start while the kernel before it in the stream finishes,
  // and waits inside for that kernel's results (kernels.cu, kernel_entry), which hides most of the gap between a
  // decode step's ~300 small kernels: measured on an H200 (bench/RESULTS.md, 2026-11-27 fifth session), decode
  // 5-9% faster at batch 1 and 4-7% at batch 8 (Llama-3.1-8B W4A16 296 -> 315 tok/s, Qwen3-VL-4B FP8 295 -> 320).
  // The same kernels on the same inputs: results are bit for bit those of ordinary launches. Backend::name() ends
  // in ", programmatic launch" when it is in effect.
  bool programmatic_launch = true;
  // Pinned host memory (cudaHostAlloc) for gather_host_rows' looked-up rows: a step's T x H activations (the plan's
  // host_staging_bytes with --host-embeddings). Host memory, not device memory: the arena stays the one device
  // allocation. 0: none (gather_host_rows is then refused with the numbers).
  uint64_t host_staging_bytes = 0;
};

// Binds the backend to options.device: a stream of its own, a cuBLAS handle using the workspace's front.
// invalid_argument for bad options (the numbers in the message), device_error when CUDA fails (no GPU, a
// driver error), unsupported for GPUs older than compute capability 8.0 and in builds without CUDA.
Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options);

namespace cuda {
// Greedy decoding on the device: ids[t] = the column of the largest logit in row t; ties go to the lowest
// column (as torch.argmax) and NaN never wins (an all-NaN row gives 0). logits [T, V] in the backend's
// activation dtype, V > 0; ids I32 vector [T]. invalid_argument when `backend` is not a CUDA backend.
// (A CUDA-only extra until Backend has an argmax op.)
Status argmax(Backend& backend, const Tensor& logits, const Tensor& ids);

// The CUDA stream (a cudaStream_t) `backend` queues all its work on, for interop: CUDA events around its ops,
// graph capture of a run of them (after one warm-up call, which configures the kernels). invalid_argument when
// `backend` is not a CUDA backend.
Result<void*> backend_stream(Backend& backend);

// Device allocations (cudaMalloc calls) kvlite has made in this process: the arena's reservation is the one
// expected; backends make none. Monotonic; 0 in builds without CUDA.
uint64_t device_allocations();

// ---- sampling on the device --------------------------------------------------------------------------------
// One row for cuda::sample (the plan's "sampling_params" buffer holds one per sequence).
struct DeviceSamplingParams {
  float temperature;  // 0: greedy
  int32_t top_k;      // 0, or >= the vocabulary: off
  float top_p;        // 1: off
  float min_p;        // 0: off
  uint32_t draw;      // the request's Rng::next_float() as the integer it is made of: u = draw / 2^24
  int32_t row;        // the logits row to sample
};
static_assert(sizeof(DeviceSamplingParams) == kSamplingParamWords * 4, "one row of sampling_params");

// ids[i] = the token sample_token (sampler.hpp) picks from logits row params[i].row with params[i]'s
// temperature, top_k, top_p and min_p and the draw u = params[i].draw / 2^24 (what the request's Rng gives
// sample_token; the caller takes it from the same Rng, so the random stream is the CPU's). Repetition penalty is
// not applied (sample those rows on the host). The order (scaled logit descending, id ascending) and every
// threshold are the CPU's; the sums differ in rounding only (exact integer sums of probability here, double
// sums in sequence there), so a token differs only when the draw or top_p lands within about 1e-12 of a
// boundary between two candidates. Greedy rows (temperature 0) are argmax, ties to the lowest id, exactly.
// logits [R, V] in the backend's activation dtype; params [n, kSamplingParamWords] I32 holding
// DeviceSamplingParams on the device; scratch F32 [n, V] (the probabilities); ids I32 vector [n].
// invalid_argument when `backend` is not a CUDA backend or the shapes disagree.
Status sample(Backend& backend, const Tensor& logits, const Tensor& params, const Tensor& scratch, const Tensor& ids);

// The same algorithm on the host, one row, step for step as the kernel runs it (the CPU tests check it against
// sample_token; the GPU tests check the kernel against it). logits [V]; scratch [V] floats.
int32_t sample_row_reference(const float* logits, int64_t vocab, const DeviceSamplingParams& params, float* scratch);

// ---- CUDA graphs ---------------------------------------------------------------------------------------------
// Device copy bandwidth, measured: `bytes` copied from src to dst (device memory, not overlapping) `repeats`
// times on the backend's stream, timed with CUDA events; bytes read + written per second.
Result<double> copy_bandwidth(Backend& backend, void* dst, const void* src, uint64_t bytes, int repeats);
}  // namespace cuda

// A CUDA graph: the work some code queued on a CUDA backend's stream, captured once and replayed with whatever
// the buffers it reads hold at replay. Move-only; destroying it frees what the driver holds for it.
class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(CudaGraph&& other) noexcept : exec_(other.exec_) { other.exec_ = nullptr; }
  CudaGraph& operator=(CudaGraph&& other) noexcept;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  bool empty() const { return exec_ == nullptr; }
  void* handle() const { return exec_; }  // the cudaGraphExec_t
  explicit CudaGraph(void* exec) : exec_(exec) {}

 private:
  void* exec_ = nullptr;
};

namespace cuda {
// Runs `record` with the backend's stream in capture mode (thread-local: a synchronizing CUDA call inside is an
// error, not a silent sync) and instantiates what it queued. `record` must only queue work: backend ops on
// device buffers, no copy_from_host / copy_to_host / synchronize. Errors from `record` propagate (the capture is
// abandoned); device_error when CUDA refuses the capture.
Result<CudaGraph> capture_graph(Backend& backend, const std::function<void()>& record);
// Queues the graph on the backend's stream (errors surface at the next synchronize, as for any op).
Status launch_graph(Backend& backend, const CudaGraph& graph);

// ---- quantized Linears on the device -----------------------------------------------------------------------
// Bytes `host` (a QuantWeight over the checkpoint) takes on the device in the layout the GPU's quantized GEMMs
// read (quant_gpu.hpp: repacked tiles, scale / zero-point tables, act-order permutation, F32 bias, split-K
// counters; quant_gpu_layout(host) itemises them). The planner counts these for CUDA plans; the repack itself
// needs no device scratch (upload_quant_weight repacks on the host, 16 MiB of host memory at a time). Host-side
// arithmetic only: defined in every build.
uint64_t quant_device_bytes(const QuantWeight& host);
// The same for a Linear described by describe_linears (int4 or fp8), before loading: what the planner counts
// per quantized Linear for CUDA plans (a g_idx counts as act-order: at most k_pad x 4 bytes over the upload).
uint64_t quant_device_bytes(const LinearDesc& linear);
// The same for Linears fused into one (quant_gpu.hpp: quant_fusion_refusal(parts) == ""): the planner's count for a
// q|k|v or gate|up group that fuses.
uint64_t quant_device_bytes(const std::vector<const QuantWeight*>& parts);
uint64_t quant_device_bytes(const std::vector<const LinearDesc*>& parts);
// Repacks `host` on the host and copies it into device memory at device_dst (capacity >=
// quant_device_bytes(host), 256-byte aligned, on the backend's device) through backend.copy_from_host, and returns
// the device view (layout QuantLayout::cuda_tiles, its pointers into device_dst) that Backend::quant_linear takes
// on that backend; it stays valid while device_dst does. One backend (one stream) runs a given device view at a
// time: its split-K counters live in device_dst. Errors: invalid_argument (not a CUDA backend, not a
// checkpoint view, capacity or alignment), bad_format (an fp8 weight holding the e4m3 NaN code), unsupported (fp8
// scales too large for W8A16 on GPUs before sm_89; builds without CUDA).
Result<QuantWeight> upload_quant_weight(Backend& backend, const QuantWeight& host, void* device_dst,
                                        uint64_t capacity);
// Several Linears fused into one device Linear (quant_gpu.hpp's fused Linears; capacity >= quant_device_bytes(parts)):
// the device view's rows are the parts' rows in order, its name theirs joined by '+'. invalid_argument also when
// the parts do not fuse (quant_fusion_refusal says why).
Result<QuantWeight> upload_quant_weight(Backend& backend, const std::vector<const QuantWeight*>& parts,
                                        void* device_dst, uint64_t capacity);
// Forces the kernel the backend's quant_linear runs (QuantKernel::automatic, the default, chooses by weight,
// device and rows: choose_quant_kernel). For tests and benchmarks, which check and time every kernel on one GPU.
// A forced kernel that cannot run a weight (quant_kernel_refusal) makes that quant_linear fail with unsupported.
// invalid_argument when `backend` is not a CUDA backend; unsupported for mma_w8a8 before sm_89 and in builds
// without CUDA.
Status set_quant_kernel(Backend& backend, QuantKernel kernel);

// ---- index math shared by kernels.cu and the host --------------------------------------------------------

// The sequence owning query row `row`: the s in [0, seqs) with starts[s] <= row < starts[s + 1], the last
// such s when empty sequences repeat a start (as the CPU backend's upper_bound). -1 when no sequence holds
// the row (query_starts not rising from 0 past it). starts has seqs + 1 entries, sorted when well formed.
KVLITE_HD int64_t sequence_of_row(const int32_t* starts, int64_t seqs, int64_t row) {
  if (seqs <= 0 || starts[0] > row) return -1;
  int64_t lo = 0, hi = seqs;  // starts[lo] <= row; the answer is in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (starts[mid] <= row) lo = mid;
    else hi = mid;
  }
  return row < starts[lo + 1] ? lo : -1;
}

// Online softmax, one score at a time (Milakov & Gimelshein 2018): keeps the running maximum and the sum of
// exp(score - maximum); `rescale` is what the values already accumulated must be multiplied by (1 unless the
// maximum grew), `weight` what the new value is accumulated with. Same steps as the CPU backend's loop.
struct SoftmaxStep {
  float rescale, weight;
};
KVLITE_HD SoftmaxStep online_softmax_step(float score, float& running_max, float& running_sum) {
  SoftmaxStep step{1.0f, 0.0f};
  if (score > running_max) {
    step.rescale = expf(running_max - score);  // exp(-inf) = 0 at the first score
    running_sum *= step.rescale;
    running_max = score;
  }
  step.weight = expf(score - running_max);
  running_sum += step.weight;
  return step;
}

// Merging softmax partials (split attention, warps of a block): a partial with maximum m, sum l and
// accumulated values acc joins a total with maximum `total_max` (the largest m) multiplied by this factor.
// A partial that saw no score has m = -inf and factor 0, also when every partial is empty.
KVLITE_HD float softmax_partial_factor(float partial_max, float total_max) {
  return partial_max == -INFINITY ? 0.0f : expf(partial_max - total_max);
}

// Keys [*begin, *end) of split `split` for a query that sees cache indices 0 .. last: chunks of
// `chunk` tokens, the last one cut at last + 1 (empty when the chunk starts past it).
KVLITE_HD void split_key_range(int64_t split, int64_t chunk, int64_t last, int64_t* begin, int64_t* end) {
  *begin = split * chunk;
  *end = (*begin + chunk < last + 1) ? *begin + chunk : last + 1;
  if (*end < *begin) *end = *begin;
}

// Argmax reduction order: is (value, index) better than (best_value, best_index)? Larger wins, ties go to
// the lower index, NaN never wins. Associative and commutative, so any reduction tree gives one answer.
KVLITE_HD bool argmax_better(float value, int32_t index, float best_value, int32_t best_index) {
  return value > best_value || (value == best_value && index < best_index);
}

// ---- the sampler's order and sums (cuda::sample and sample_row_reference) ---------------------------------
// A float's bits as an unsigned integer with the same order (negative values flipped whole, positive ones with
// the sign bit set): -inf < ... < -0 < +0 < ... < +inf.
KVLITE_HD uint32_t orderable_float(float value) {
  const uint32_t bits = float_to_bits(value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
// The sort order of sample_token as one 64-bit key: larger key first = larger scaled logit first, then the
// lower id. Keys are unique, so "the k-th token in order" is a key.
KVLITE_HD uint64_t sampling_key(float scaled, int32_t id) {
  return (uint64_t(orderable_float(scaled)) << 32) | uint64_t(0xffffffffu - uint32_t(id));
}
KVLITE_HD int32_t sampling_key_id(uint64_t key) { return int32_t(0xffffffffu - uint32_t(key & 0xffffffffu)); }
// Probabilities summed as integers of 2^-60: exact and independent of the order of the sum (a block's atomics
// add in any order), and within 2^-61 of each float probability.
KVLITE_HD uint64_t sampling_mass(float probability) {
  return uint64_t(floor(double(probability) * 1152921504606846976.0 + 0.5));  // x 2^60
}
// The mass the kept prefix must reach for top_p: ceil(top_p x 2^60).
KVLITE_HD uint64_t top_p_target(float top_p) { return uint64_t(ceil(double(top_p) * 1152921504606846976.0)); }
// The draw: the first token whose running mass exceeds u x total, u = draw / 2^24, i.e. reaches
// floor(draw x total / 2^24) + 1 (exact in 128 bits).
KVLITE_HD uint64_t draw_target(uint32_t draw, uint64_t total) {
#if defined(__CUDA_ARCH__)
  const uint64_t high = __umul64hi(uint64_t(draw), total), low = uint64_t(draw) * total;
#else  // 32 x 64 -> 96 bits from two 32 x 32 products (no __int128: the public header stays ISO C++)
  const uint64_t low_part = uint64_t(draw) * (total & 0xFFFFFFFFu), high_part = uint64_t(draw) * (total >> 32);
  const uint64_t low = low_part + (high_part << 32);
  const uint64_t high = (high_part >> 32) + (low < low_part ? 1 : 0);
#endif
  return ((high << 40) | (low >> 24)) + 1;
}
// One step of the radix select (8 bits of the key, most significant first): bins[b] holds the weight (count or
// mass) of the candidates whose next digit is b; `before` the weight of the candidates with larger keys outside
// this digit's range. Returns the bin holding the first candidate at which the running weight reaches
// `target` (scanning from the largest digit down) and adds the bins above it to `before`; -1 when the total
// never reaches it.
constexpr int kSamplingDigitBits = 8, kSamplingBins = 256, kSamplingPasses = 8;
KVLITE_HD int sampling_select_bin(const unsigned long long* bins, uint64_t target, uint64_t* before) {
  for (int bin = kSamplingBins - 1; bin >= 0; bin--) {
    if (*before + bins[bin] >= target) return bin;
    *before += bins[bin];
  }
  return -1;
}
// The digit of `key` that pass `pass` (0..7) selects on, and the mask of the digits decided before it.
KVLITE_HD int sampling_digit(uint64_t key, int pass) {
  return int((key >> (56 - kSamplingDigitBits * pass)) & (kSamplingBins - 1));
}
KVLITE_HD uint64_t sampling_decided_mask(int pass) { return pass == 0 ? 0 : ~0ull << (64 - kSamplingDigitBits * pass); }

// Head dimensions each lane of a warp holds in attention (lane l holds l, l + 32, ...): the smallest of the
// compiled counts {2, 3, 4, 8} covering head_dim; 0 when head_dim > kCudaMaxHeadDim. The counts are the heads
// models have: 64 (2), 80 and 96 (3), 128 (4), 256 (8); a head of 32 or less (test models) runs as 2, one of
// 129-224 as 8. (1 and 6 were compiled too: 24 more instances of the largest kernel, for heads no model we serve has.)
KVLITE_HD int attention_dims_per_lane(int64_t head_dim) {
  const int64_t needed = (head_dim + 31) / 32;
  if (head_dim <= 0 || needed > 8) return 0;
  return needed <= 2 ? 2 : needed <= 4 ? int(needed) : 8;
}
// Query heads one attention block serves together (they share each K/V row it loads): bounded so the
// per-lane registers (queries and accumulators, 2 x heads x dims_per_lane floats) stay at 64.
KVLITE_HD constexpr int attention_heads_per_block(int dims_per_lane) { return dims_per_lane <= 4 ? 8 : 4; }

// The attention kernel shapes compiled for an (activation, KV element) pair. Every dims-per-lane count and both
// block sizes are compiled where the KV cache holds the activation type or fp8 -- what `--kv-dtype auto` and `fp8`
// give, the pairs that run in practice. Any other pair (f16 KV under bf16 activations, bf16 KV under f32, ...) runs
// one generic shape, kAttentionGenericDims dims per lane with the 4-warp block: correct for every head_dim up to
// kCudaMaxHeadDim, not tuned. (With the four dims counts: 54 instances of the kernel; all 12 pairs with six counts
// were 144, 40% of kernels.cu's machine code and most of its compile time on every architecture.)
constexpr int kAttentionGenericDims = 8;
KVLITE_HD constexpr bool attention_pair_tuned(bool kv_is_activation_type, bool kv_is_fp8) {
  return kv_is_activation_type || kv_is_fp8;
}
// The dims per lane of the kernel that runs head_dim for the pair (0: no kernel, head_dim too large).
KVLITE_HD constexpr int attention_kernel_dims(int dims_per_lane, bool pair_tuned) {
  return dims_per_lane == 0 || pair_tuned ? dims_per_lane : kAttentionGenericDims;
}

// How attention splits each query's keys across blocks (flash-decoding): more blocks when rows x heads alone
// would leave SMs idle, each split a chunk of at least kMinChunk keys, partials fitting the scratch.
struct AttentionSplit {
  int64_t splits = 1;  // blocks per (row, head group); 1: no partials, the block writes the output
  int64_t chunk = 1;   // keys per split (the whole max_context when splits == 1)
};
// (16: at batch 1 a few hundred keys then still spread over tens of splits; with 128 Llama-3.1-8B's 8 KV heads ran a
// 192-key decode context as 8 blocks whose warps each took 48 keys one after another, 55 us a layer on an H100.)
constexpr int64_t kAttentionMinChunk = 16;
constexpr int64_t kAttentionMaxSplits = 256;
// blocks: rows x KV heads x head passes (the grid without splitting); target_blocks: what fills the GPU;
// partial_bytes: scratch bytes one split of every (row, head) needs; scratch_bytes: what there is.
inline AttentionSplit plan_attention_split(int64_t blocks, int64_t max_context, int64_t target_blocks,
                                           uint64_t partial_bytes, uint64_t scratch_bytes) {
  AttentionSplit plan;
  plan.chunk = max_context > 0 ? max_context : 1;
  if (blocks <= 0 || blocks >= target_blocks || max_context <= kAttentionMinChunk) return plan;
  int64_t splits = (target_blocks + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, max_context / kAttentionMinChunk);  // so every chunk has kMinChunk keys
  splits = std::min<int64_t>(splits, kAttentionMaxSplits);
  if (partial_bytes > 0) splits = std::min<int64_t>(splits, int64_t(scratch_bytes / partial_bytes));
  if (splits < 2) return plan;
  plan.chunk = (max_context + splits - 1) / splits;
  plan.splits = (max_context + plan.chunk - 1) / plan.chunk;  // no empty trailing split
  return plan;
}

// The paged attention kernel's warps a block for a grid of `blocks` on `sms` SMs: 8 while the grid fits one wave of
// one block an SM (its 8-warp form holds 172 registers a thread), else 4 (kernels.cu's attention section says why).
constexpr int kPagedAttentionWarpsFew = 4, kPagedAttentionWarpsMany = 8;
KVLITE_HD constexpr int paged_attention_warps(int64_t blocks, int64_t sms) {
  return blocks <= sms ? kPagedAttentionWarpsMany : kPagedAttentionWarpsFew;
}

// How many of a launch's `planned` splits a query that sees `keys` keys uses, and the chunk each takes. The grid
// is sized for the largest context the launch (or a decode graph captured for max_model_len) may see; each query
// spreads its own keys evenly over as many splits as give chunks of at least kAttentionMinChunk keys, up to
// `planned`, and the splits past those are empty for it (their blocks return at once; the combine skips them).
// A graph captured for 32,768 tokens with 66 splits thus runs a 50-token context in 3 splits of 17 keys and a
// 3,000-token one in 66 of 46, rather than in as many splits as 32,768 tokens would take.
KVLITE_HD int64_t attention_chunk(int64_t planned, int64_t keys) {
  if (keys <= 0) return 1;
  const int64_t by_length = keys / kAttentionMinChunk;
  const int64_t splits = planned <= 1 || by_length <= 1 ? 1 : (by_length < planned ? by_length : planned);
  return (keys + splits - 1) / splits;
}
// (keys over the chunk, rounded up: rounding the chunk up can leave the last of `splits` without keys)
KVLITE_HD int64_t attention_splits_used(int64_t planned, int64_t keys) {
  if (keys <= 0) return 1;
  const int64_t chunk = attention_chunk(planned, keys);
  return (keys + chunk - 1) / chunk;
}

// out [T, N] = x [T, K] @ w[N, K]^T as cuBLAS sees it: cuBLAS is column-major, and a row-major [r, c] matrix
// with row stride s is a column-major c x r matrix with leading dimension s. So
//   out^T (N x T, ld out.stride) = op_T(w as K x N, ld w.stride) x (x as K x T, ld x.stride):
// m = N, n = T, k = K, A = w with CUBLAS_OP_T, B = x with CUBLAS_OP_N. false when a size exceeds int.
struct GemmShape {
  int m = 0, n = 0, k = 0;
  int lda = 0, ldb = 0, ldc = 0;
};
// Leading dimension of a view: its row stride, or its width when it has one row (the stride is unused).
inline int64_t leading_dimension(const Tensor& t) {
  return t.rows <= 1 ? std::max<int64_t>(t.cols, 1) : t.row_stride;
}
inline bool linear_gemm_shape(const Tensor& x, const Tensor& weight, const Tensor& out, GemmShape* shape) {
  const int64_t values[6] = {weight.rows, x.rows, x.cols, leading_dimension(weight), leading_dimension(x),
                             leading_dimension(out)};
  for (int64_t v : values)
    if (v > INT_MAX) return false;
  *shape = GemmShape{int(values[0]), int(values[1]), int(values[2]), int(values[3]), int(values[4]), int(values[5])};
  return true;
}

// The workspace carved once at construction (see the top of this part). false when it is too small.
struct CudaWorkspaceLayout {
  uint64_t cublas_offset = 0, cublas_bytes = 0;
  uint64_t fault_offset = 0;  // 256 bytes for the fault record
  uint64_t scratch_offset = 0, scratch_bytes = 0;
};
inline bool cuda_workspace_layout(uint64_t workspace_bytes, uint64_t cublas_bytes, CudaWorkspaceLayout* layout) {
  CudaWorkspaceLayout l;
  l.cublas_bytes = cublas_bytes / 256 * 256;  // cuBLAS wants a multiple of 256 bytes
  l.fault_offset = l.cublas_bytes;
  l.scratch_offset = l.fault_offset + 256;
  if (l.scratch_offset > workspace_bytes || workspace_bytes - l.scratch_offset < kCudaMinScratchBytes) return false;
  l.scratch_bytes = workspace_bytes - l.scratch_offset;
  *layout = l;
  return true;
}
}  // namespace cuda

}  // namespace kvlite
