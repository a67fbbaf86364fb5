// ---------------------------------------------------------------------------------------------------------
// backend: the operations a forward pass runs, on tensors that live where the backend computes (host memory
// for the CPU, device memory for CUDA). The model is written once against this interface; the CPU backend is
// the reference every CUDA kernel is checked against.
//
// Conventions shared by every op:
//   - Tensors are 2-D views [rows, cols]: activations are [tokens, features]; a linear weight is
//     [out_features, in_features] as PyTorch stores it. Views may be row or column slices of larger buffers
//     (q, k and v are column slices of one fused qkv buffer), so every op honours row_stride.
//   - A "vector of n" (norm weight, bias, token ids, slots...) is a contiguous tensor of n elements in
//     either orientation ([1, n] or [n, 1]).
//   - Activations have the backend's activation_dtype() (F32 on the CPU unless CpuBackendOptions says BF16 or
//     F16); index vectors are I32.
//   - Ops never allocate: every output is a caller-owned buffer (the arena's activation region). Scratch is
//     sized when the backend is made.
//   - Ops validate shapes and dtypes here, once for every backend, and return invalid_argument (or
//     unsupported, when supports() says no) with the shapes in the message. A backend may run asynchronously:
//     errors found on the device surface at synchronize().
//   - One caller at a time: a backend is not safe to call from two threads at once.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// A view of `rows` x `cols` elements of `dtype`; row r starts r * row_stride elements after `data`.
// Never owns memory.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0;  // elements between the starts of consecutive rows, >= cols

  // A dense [rows, cols] view.
  static Tensor matrix(void* data, DType dtype, int64_t rows, int64_t cols) {
    return Tensor{data, dtype, rows, cols, cols};
  }
  // A vector of n elements, as [n, 1].
  static Tensor vector(void* data, DType dtype, int64_t n) { return Tensor{data, dtype, n, 1, 1}; }

  int64_t elements() const { return rows * cols; }
  int64_t element_bytes() const { return int64_t(dtype_bytes(dtype, 1)); }
  // True when the elements are one run of memory (vectors must be).
  bool contiguous() const { return rows <= 1 || row_stride == cols; }
  // Rows [first, first + count).
  Tensor slice_rows(int64_t first, int64_t count) const {
    return Tensor{static_cast<uint8_t*>(data) + first * row_stride * element_bytes(), dtype, count, cols, row_stride};
  }
  // Columns [first, first + count) of every row (q, k or v inside a fused qkv buffer; one head).
  Tensor slice_cols(int64_t first, int64_t count) const {
    return Tensor{static_cast<uint8_t*>(data) + first * element_bytes(), dtype, rows, count, row_stride};
  }
};

// The paged KV cache as kernels see it: the base of the KV pages and their layout (see KVPageLayout).
struct KVCacheView {
  void* pages = nullptr;      // page 0; page p starts p * layout.page_elements() elements later
  DType dtype = DType::BF16;  // element type of K and V (the CPU stores F32, BF16, F16 or F8_E4M3)
  KVPageLayout layout;
  int64_t num_pages = 0;
  // F8_E4M3 pages hold x / scale, saturated to +-448 and rounded to nearest even; reads give e4m3 x scale (as
  // vLLM's fp8 KV cache). One scale per layer for K and one for V ([num_layers] floats in host memory, read when
  // the op is enqueued: a checkpoint's self_attn.k_scale / v_scale); nullptr: 1.0, as vLLM uses without them.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
};

// The sequences of one attention call. Sequence s owns the query rows [query_starts[s], query_starts[s+1])
// and n_s = query_starts[s+1] - query_starts[s] of them. Its queries are the LAST n_s tokens of its context:
// query j (0-based) sits at cache index context_lens[s] - n_s + j and attends causally to cache indices
// 0 .. that index. So one call mixes chunked prefill (n_s > 1, earlier chunks already cached) and decode
// (n_s = 1). Their K/V must already be written (kv_write) before attention runs.
struct AttentionBatch {
  Tensor query_starts;      // I32 vector [seqs + 1]; query_starts[0] = 0, last = query tokens
  Tensor context_lens;      // I32 vector [seqs]: cached tokens of each sequence, this step's included
  Tensor block_tables;      // I32 [seqs, max_pages_per_seq]: row s lists sequence s's pages in order
  int64_t max_context = 0;  // >= every context_lens[s] (lets a GPU size its work without reading them)
};

// Every op of the interface, for supports() and for messages.
enum class Op {
  gather_rows, rms_norm, add_rms_norm, rope, linear, quant_linear, silu_mul, add, copy, kv_write, attention,
  // the vision encoder's (Qwen3-VL)
  embedding_bag, layer_norm, gelu, segment_attention,
  // rope then kv_write as one call (Backend::rope_kv_write)
  rope_kv_write,
  // Gemma's: GeGLU's gate, the embedding scale, the final logit soft-cap
  gelu_mul, scale, soft_cap,
};
constexpr int kOpCount = int(Op::soft_cap) + 1;

// One op's share of a backend's work while op timing is on (Backend::set_op_timing): how many calls, and their
// host wall time with the backend synchronized after each, so that on a GPU an op's time is its launch and its
// kernels, nothing else overlapping.
struct OpTime {
  int64_t calls = 0;
  double seconds = 0.0;
};
using OpTimes = std::array<OpTime, kOpCount>;  // indexed by int(Op)

// An nn.Linear as the model binds it: dense (weight [out_features, in_features] in BF16/F16/F32, bias
// [out_features] or none) or quantized (quant: the checkpoint's int4 / fp8 tensors and their own bias, see
// quant.hpp; weight and bias are then empty). Backend::linear(x, LinearWeights, out) runs either.
struct LinearWeights {
  Tensor weight;
  Tensor bias;
  std::shared_ptr<const QuantWeight> quant;  // set: a quantized Linear

  int64_t out_features() const { return quant ? quant->out_features : weight.rows; }
  int64_t in_features() const { return quant ? quant->in_features : weight.cols; }
};

// Linears that read one input and write adjacent column blocks of one output, in order: q_proj | k_proj | v_proj
// into the qkv buffer, gate_proj | up_proj into gate_up. The model runs a group as one Linear; a backend runs each
// part into its columns. The CUDA uploader stores a group that fuses (quant_fusion_refusal for quantized parts;
// dense parts with biases in all or none) as one part: one GEMM instead of three or two small ones.
struct LinearGroup {
  std::vector<LinearWeights> parts;

  int64_t out_features() const {
    int64_t n = 0;
    for (const LinearWeights& part : parts) n += part.out_features();
    return n;
  }
};

// Whether the CUDA uploader stores `group` as one Linear: two or more parts of one in_features, all quantized and
// fusing (cuda::quant_fusion_refusal), or all dense with a bias in every part or in none (their rows are stacked; a
// dense part's dtype does not matter, every one is converted to the activation dtype).
bool linear_group_fuses(const LinearGroup& group);
// The same from the parts' descriptors (describe_linears), for the planner: the same answer, but for act-order
// parts (no: their g_idx tensors decide; see cuda::quant_fusion_refusal).
bool linear_group_fuses(const std::vector<const LinearDesc*>& parts);

// GELU's two forms: nn.GELU() / "gelu" (exact, with erf) and "gelu_pytorch_tanh" (the tanh approximation).
enum class GeluApprox { none, tanh };

// What one layer's attention adds to plain causal attention (BlockTraits, per layer kind).
struct AttentionOptions {
  // > 0: a sliding window of W tokens: the query at cache index i sees keys i - W + 1 .. i (transformers'
  // sliding_window_overlay: kv_idx > q_idx - W); 0: every earlier key.
  int64_t window = 0;
  // > 0: Gemma-2's soft-cap of the scaled scores before the mask, scores = cap * tanh(scores / cap).
  float logit_softcap = 0.0f;
};
const char* op_name(Op op);

namespace detail {
// Host rows for Backend::gather_host_rows: dst[t, :] = table[ids[t], :] for t < count, converted to `dtype`
// (BF16/F16/F32, rounded to nearest even as the device's conversions are) and packed (cols = table.cols). The ids
// were checked by the caller. (The CUDA backend's staging; shared so that the CPU tests check it.)
void gather_host_rows_into(const Tensor& table, const int32_t* ids, int64_t count, DType dtype, void* dst);
}  // namespace detail

class Backend {
 public:
  virtual ~Backend() = default;

  // ---- identity and capabilities ---------------------------------------------------------------------
  virtual BackendKind kind() const = 0;
  virtual std::string name() const = 0;  // for logs: "cpu (8 threads)"
  // The dtype of every activation tensor the ops read and write (CUDA: BF16 by default; the CPU: F32 by default).
  virtual DType activation_dtype() const = 0;
  // Can `op` run with `dtype` as its stored operand? That operand is: the table (gather_rows,
  // embedding_bag), the weight (rms_norm, add_rms_norm, linear, layer_norm), the K/V element (kv_write,
  // attention), the destination (copy), the stored weight element for quant_linear (I32: pack-quantized
  // int4, F8_E4M3: fp8); for the others (rope, silu_mul, add, gelu, segment_attention) the
  // activation dtype.
  virtual bool supports(Op op, DType dtype) const = 0;

  // ---- op timing (kvlite bench --profile) -------------------------------------------------------------------
  // On: each op waits for its own work (synchronize) and adds its calls and wall time to op_times(), which keep
  // counting until timing is turned off (turning it on does not clear them: take differences). Costs a wait per
  // op, so only for finding where a step's time goes; never while a CUDA graph is being captured (the engine
  // runs eager steps when it times ops).
  void set_op_timing(bool on) { op_timing_ = on; }
  bool op_timing() const { return op_timing_; }
  const OpTimes& op_times() const { return op_times_; }

  // ---- memory movement ---------------------------------------------------------------------------------
  // dst <- src, where src holds dst.rows x dst.cols elements of dst.dtype, row after row, on the host.
  Status copy_from_host(const void* src, const Tensor& dst);
  // dst (host, dense rows) <- src.
  Status copy_to_host(const Tensor& src, void* dst);
  // Waits for queued work; reports the first error a queued op met.
  Status synchronize();

  // ---- ops -------------------------------------------------------------------------------------------
  // out[t, :] = table[ids[t], :], converted to the activation dtype. Embedding lookup (table
  // [vocab, hidden], BF16/F16/F32) and row selection (e.g. the last token of each sequence before the
  // lm_head). table [V, H]; ids I32 vector [T], each in [0, V); out [T, H].
  Status gather_rows(const Tensor& table, const Tensor& ids, const Tensor& out);
  // The same lookup from a table in HOST memory (PlanOptions::host_embeddings: the checkpoint's mmap) by ids in
  // host memory: out[t, :] = table[ids[t], :] in the activation dtype, t < out.rows. table [V, H] BF16/F16/F32;
  // ids: out.rows int32 values, each in [0, V) (checked on the host, before anything is copied); out [T, H] in the
  // backend's memory. The CPU gathers (its memory is the host's: gather_rows). CUDA gathers the rows on the host
  // into its pinned staging buffer (CudaBackendOptions::host_staging_bytes: at least T x H activations; rows
  // converted there when the table's dtype is not the activations') and copies them into out on its stream,
  // returning once the copy is done (as copy_from_host: the staging buffer is free again). Not inside a CUDA graph
  // capture: a step's lookup runs before its graph is launched. Timed as gather_rows.
  Status gather_host_rows(const Tensor& table, const int32_t* ids, const Tensor& out);

  // RMSNorm in groups: each row of x is split into x.cols / W groups of W = weight's length, and each group
  // is normalised on its own: out = weight * (x * rsqrt(mean(x^2) + eps)), in fp32 (LlamaRMSNorm).
  // W = x.cols is the layer norm; W = head_dim is Qwen3's per-head q_norm / k_norm over [T, heads * D].
  // x, out [T, C]; weight vector [W], C % W == 0. out may be x.
  Status rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out);

  // The pre-norm residual step fused: residual += x; out = rms_norm(residual) (weight over the whole row).
  // This is transformers' `hidden = residual + hidden; residual = hidden; hidden = norm(hidden)`.
  // x, residual, out [T, H]; weight vector [H]. out may be x, never residual.
  Status add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, float eps,
                      const Tensor& out);

  // Rotary embedding in place, rotate_half convention (Llama/Qwen; not GPT-J's interleaved pairs): for each
  // head and each frequency i < R/2, with a = x[i], b = x[i + R/2], c = cos[t, i], s = sin[t, i]:
  //   x[i] = a*c - b*s;  x[i + R/2] = b*c + a*s      (x*cos + rotate_half(x)*sin, since emb = cat(f, f))
  // Dimensions R .. head_dim-1 are left alone (partial rotary). Build cos/sin with rope_tables().
  // x [T, heads * head_dim]; cos, sin F32 [T, R/2] with R <= head_dim.
  Status rope(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim);

  // out = x @ weight^T (+ bias): nn.Linear. x [T, K]; weight [N, K] (BF16/F16/F32); bias vector [N] or
  // none (bias.data == nullptr); out [T, N]. out must not overlap x.
  Status linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out);

  // out = x @ W^T (+ W's bias) for a quantized Linear: W's int4 or fp8 values dequantized exactly as the
  // checkpoint's reference defines them (quant.hpp), never the whole matrix at once. x [T, K]; out [T, N],
  // not overlapping x. The weight's tensors must be where the backend computes (the CPU reads the mmap).
  Status quant_linear(const Tensor& x, const QuantWeight& weight, const Tensor& out);

  // Either of the two above, as the Linear is stored.
  Status linear(const Tensor& x, const LinearWeights& weights, const Tensor& out) {
    return weights.quant ? quant_linear(x, *weights.quant, out) : linear(x, weights.weight, weights.bias, out);
  }

  // A LinearGroup: part i into columns [n_i, n_i + N_i) of out, n_i the earlier parts' N summed. x [T, K] (every
  // part's in_features); out [T, the parts' N summed].
  Status linear(const Tensor& x, const LinearGroup& group, const Tensor& out);

  // SwiGLU's gate: out = silu(gate) * up, silu(g) = g / (1 + exp(-g)). gate, up, out [T, I] (gate and up
  // may be the two halves of one fused gate_up buffer). out may be gate or up.
  Status silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out);

  // GeGLU's gate (Gemma): out = gelu(gate) * up, the gelu (gelu() below) stored in the activation dtype before
  // the product, as PyTorch's act_fn(gate_proj(x)) * up_proj(x). gate, up, out [T, I]; out may be gate or up.
  Status gelu_mul(const Tensor& gate, const Tensor& up, GeluApprox approx, const Tensor& out);

  // out = x * factor, the product in fp32 (Gemma's inputs_embeds * normalizer). x, out [T, C]; out may be x.
  Status scale(const Tensor& x, float factor, const Tensor& out);

  // out = cap * tanh(x / cap), each of the three steps stored as PyTorch does in fp32 (Gemma-2's final logit
  // soft-capping: logits / cap; tanh; * cap). x, out [T, C]; cap > 0; out may be x.
  Status soft_cap(const Tensor& x, float cap, const Tensor& out);

  // out = a + b. a, b, out [T, H]. out may be a or b.
  Status add(const Tensor& a, const Tensor& b, const Tensor& out);

  // dst = src, converting between F32, BF16 and F16 (round to nearest even). Same shape; no overlap.
  Status copy(const Tensor& src, const Tensor& dst);

  // out[t, :] = sum over j of weights[t, j] * table[indices[t, j], :], each product in fp32 and the sum taken in
  // order j = 0, 1, ...: F.embedding_bag(mode="sum", per_sample_weights) - the bilinear resampling of a learned
  // position table (4 taps per row). table [V, H] (BF16/F16/F32); indices I32 [T, J], each in [0, V); weights
  // F32 [T, J]; out [T, H].
  Status embedding_bag(const Tensor& table, const Tensor& indices, const Tensor& weights, const Tensor& out);

  // nn.LayerNorm over each row, in fp32: out = (x - mean) / sqrt(var + eps) * weight + bias, var the biased
  // variance. x, out [T, C]; weight, bias vectors [C] (BF16/F16/F32, the same dtype). out may be x.
  Status layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& out);

  // out = gelu(x): 0.5 x (1 + erf(x / sqrt 2)) (GeluApprox::none), or 0.5 x (1 + tanh(sqrt(2 / pi) (x +
  // 0.044715 x^3))) (GeluApprox::tanh). x, out [T, C]. out may be x.
  Status gelu(const Tensor& x, GeluApprox approx, const Tensor& out);

  // Non-causal attention within segments of contiguous rows (a vision encoder's images: cu_seqlens): segment
  // s is rows [segment_starts[s], segment_starts[s+1]), and each of its queries attends to all of its keys,
  // never to another segment's. Per query head, softmax(scale * q.K^T) @ V in fp32 with the running maximum
  // subtracted; grouped-query: query head h reads KV head h / (heads / kv_heads).
  // q, out [N, heads * head_dim]; k, v [N, kv_heads * head_dim] (q, k and v may be column slices of one
  // fused qkv buffer); segment_starts I32 vector [segments + 1], from 0 to N, non-decreasing; max_segment >=
  // every segment's length (lets a GPU size its work without reading segment_starts). out must not overlap
  // q, k or v.
  Status segment_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_starts,
                           int64_t max_segment, int64_t head_dim, float scale, const Tensor& out);

  // Stores layer `layer`'s K and V rows of T tokens into the KV pages. slots I32 vector [T]: token t goes
  // to page slots[t] / page_tokens at offset slots[t] % page_tokens; a negative slot skips the token
  // (padding). k, v [T, kv_heads * head_dim]. Converted to cache.dtype (round to nearest even).
  Status kv_write(const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v, const Tensor& slots);

  // rope(qk, cos, sin, head_dim), then kv_write(cache, layer, k, v, slots), k being the last kv_heads * head_dim
  // columns of qk (the keys just rotated): a decoder layer's two steps between its q|k|v projection and its
  // attention, as one call so that a backend can do both in one pass (CUDA: one kernel, each rotated key stored as
  // it is made; the CPU: the two ops). The same checks as the two ops, and the same results, bit for bit.
  Status rope_kv_write(const Tensor& qk, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                       const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v, const Tensor& slots);

  // Causal paged attention for a batch of sequences (see AttentionBatch), grouped-query: query head h reads
  // KV head h / (heads / kv_heads). Per query head: softmax(scale * q.K^T) @ V over its visible tokens,
  // in fp32 with the running maximum subtracted; no [T, context] matrix is formed. options: a sliding window
  // (only the last window keys are visible) and a soft-cap of the scaled scores.
  // q, out [T, heads * head_dim] with head_dim = cache.layout.head_dim; scale usually 1/sqrt(head_dim).
  Status attention(const Tensor& q, const KVCacheView& cache, int64_t layer, const AttentionBatch& batch,
                   float scale, const Tensor& out, const AttentionOptions& options = {});

 protected:
  // The backend's work, called after the shared validation above has passed. They may throw kvlite::Error
  // (detail::fail) for what only they can check (e.g. values of index vectors on the CPU).
  virtual void impl_copy_from_host(const void* src, const Tensor& dst) = 0;
  virtual void impl_copy_to_host(const Tensor& src, void* dst) = 0;
  virtual void impl_synchronize() = 0;
  virtual void impl_gather_rows(const Tensor& table, const Tensor& ids, const Tensor& out) = 0;
  virtual void impl_gather_host_rows(const Tensor& table, const int32_t* ids, const Tensor& out) = 0;
  virtual void impl_rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) = 0;
  virtual void impl_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, float eps,
                                 const Tensor& out) = 0;
  virtual void impl_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim) = 0;
  virtual void impl_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out) = 0;
  virtual void impl_quant_linear(const Tensor& x, const QuantWeight& weight, const Tensor& out) = 0;
  virtual void impl_silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) = 0;
  virtual void impl_gelu_mul(const Tensor& gate, const Tensor& up, GeluApprox approx, const Tensor& out) = 0;
  virtual void impl_scale(const Tensor& x, float factor, const Tensor& out) = 0;
  virtual void impl_soft_cap(const Tensor& x, float cap, const Tensor& out) = 0;
  virtual void impl_add(const Tensor& a, const Tensor& b, const Tensor& out) = 0;
  virtual void impl_copy(const Tensor& src, const Tensor& dst) = 0;
  virtual void impl_embedding_bag(const Tensor& table, const Tensor& indices, const Tensor& weights,
                                  const Tensor& out) = 0;
  virtual void impl_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                               const Tensor& out) = 0;
  virtual void impl_gelu(const Tensor& x, GeluApprox approx, const Tensor& out) = 0;
  virtual void impl_segment_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& segment_starts, int64_t max_segment, int64_t head_dim,
                                      float scale, const Tensor& out) = 0;
  virtual void impl_kv_write(const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v,
                             const Tensor& slots) = 0;
  virtual void impl_attention(const Tensor& q, const KVCacheView& cache, int64_t layer,
                              const AttentionBatch& batch, float scale, const Tensor& out,
                              const AttentionOptions& options) = 0;
  // The two ops in order, unless a backend fuses them.
  virtual void impl_rope_kv_write(const Tensor& qk, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                                  const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v,
                                  const Tensor& slots) {
    impl_rope(qk, cos, sin, head_dim);
    impl_kv_write(cache, layer, k, v, slots);
  }

 private:
  // Runs an op's impl_ call, timed when op timing is on.
  template <class Run>
  void run_op(Op op, Run&& run);
  bool op_timing_ = false;
  OpTimes op_times_{};
};

// ---- the CPU backend ------------------------------------------------------------------------------------
// CPU threads are capped at the machine's hardware threads times this factor: more than one per hardware thread
// only adds switching, and the cap keeps a mistyped count (INT32_MAX) from reserving gigabytes of thread handles.
#ifndef KVLITE_MAX_THREADS_PER_HARDWARE_THREAD
#define KVLITE_MAX_THREADS_PER_HARDWARE_THREAD 4
#endif
namespace limits {
constexpr int max_threads_per_hardware_thread = KVLITE_MAX_THREADS_PER_HARDWARE_THREAD;
}  // namespace limits
// The most threads a CPU backend accepts here: max(1, std::thread::hardware_concurrency()) x
// KVLITE_MAX_THREADS_PER_HARDWARE_THREAD. EngineOptions::threads, kvlite_options.threads and
// CpuBackendOptions::threads above it are refused (invalid_argument) before anything is reserved.
int max_cpu_threads();
namespace detail {
// The threads a CPU option's value asks for: `threads` when > 0, else one per hardware thread (at least 1).
int cpu_threads_or_all(int threads);
void check_cpu_threads(int64_t threads, const char* what);  // throws invalid_argument naming `what` and the cap
}  // namespace detail
// CpuKernels (which Linear kernels a CPU backend runs) is declared in device.hpp: the plan sizes their scratch.
namespace detail {
// CpuKernels::fast_lowp's activation quantization of one row (src/cpu_lowp.inl; exposed for the tests): x [K]
// (K a multiple of 128) per 32 columns, d = max|x| / 127, q = nearest-even(x 127 / max|x|) clamped to +-127;
// q [K] in natural order, or for int4 weights each 128 columns as their 64 even ones then their 64 odd ones;
// lane_scales [K / 4]: for each 64 bytes of q, the d of the block each 4-byte lane's columns are in (int4:
// lane l of 128 columns is block l / 4; natural: lane l of 64 columns, block l / 8); group_sums [K / group]:
// sum over the group of d sum q.
void quantize_q8_activations(const float* x, int64_t K, bool int4_layout, int64_t group, int8_t* q,
                             float* lane_scales, float* group_sums);
}  // namespace detail
// The instruction set the fast kernels use. automatic: the best this CPU has (checked at run time);
// portable: plain C++ (every machine); avx2: AVX2 + FMA + F16C; avx512: AVX-512 F/BW/VL; neon: AArch64's
// Advanced SIMD (fast_lowp adds the dot-product instructions where the CPU has them). Forcing one the CPU (or
// the build's target) lacks is refused by make_cpu_backend (tests force each in turn).
enum class CpuIsa : uint8_t { automatic, portable, avx2, avx512, neon };
const char* cpu_isa_name(CpuIsa isa);
bool cpu_isa_supported(CpuIsa isa);  // automatic and portable: always; the others by the CPU's features
CpuIsa best_cpu_isa();               // what automatic resolves to here
struct CpuBackendOptions {
  int threads = 0;             // worker threads, the caller included; 0: one per hardware thread; at most max_cpu_threads()
  int64_t max_head_dim = 256;  // largest head_dim attention will see (sizes the per-thread scratch)
  // Largest in_features a quant_linear will see: sizes the per-thread dequantization scratch (16 weight rows
  // of K floats each, plus one activation chunk when fp8_activations is on).
  int64_t max_quant_in_features = 16384;
  // W8A8 as the GPU runs fp8 weights: quant_linear quantizes each activation row to fp8 and back first
  // (quantize_fp8_activations, per block_k columns for block weights, else per row). For tests.
  bool fp8_activations = false;
  // Reserve the activation chunk for int8 W8A8 weights (QuantWeight::int8_activations), whose activations always go
  // through int8 per token, as their checkpoint declares. The engine sets it when the model has such Linears.
  bool int8_activations = false;
  // How activations are stored: F32 (the float32 reference), or BF16 / F16 to run the GPU's numerics on the CPU:
  // every op still computes in f32 and rounds (to nearest even) on each store, where the CUDA kernels round.
  DType activation_dtype = DType::F32;
  // The Linear kernels (last, so that existing aggregate initializers keep their meaning).
  CpuKernels kernels = CpuKernels::fast;
  CpuIsa isa = CpuIsa::automatic;  // for kernels fast and fast_lowp
  // fast_lowp's BF16 kernel (AVX-512 BF16): how many weight rows a one-token GEMV reads side by side, 1 or 8
  // (each row's sum is the same either way, bit for bit); 0: the CPU's faster one (8 on Intel, 1 elsewhere).
  int bf16_stream_rows = 0;
};
// The host memory make_cpu_backend(options) allocates as scratch, all of it at start: per worker thread one
// attention row set ((2 + 8) x max_head_dim floats, whole 64-byte lines) and 16 dequantized weight rows of
// max_quant_in_features floats; one 64-token chunk of max_quant_in_features floats when activations are 16-bit
// (widened to f32 for quant_linear) and one more when fp8 / int8 activations are on. The CPU plan's workspace row.
uint64_t cpu_backend_scratch_bytes(const CpuBackendOptions& options);
// Starts the thread pool and allocates all scratch. Results do not depend on `threads`: every output
// element is computed by one thread in a fixed order, so 1 thread and 16 give the same bits.
Result<std::unique_ptr<Backend>> make_cpu_backend(const CpuBackendOptions& options = {});

// The rotary tables rope() takes are made by src/rope.hpp (rope_tables, RotaryEmbedding).

}  // namespace kvlite
