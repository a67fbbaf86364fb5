// batch: the host staging of one step (what llama.cpp calls a batch): the step's tokens packed as the model reads
// them, sized once at open, and which request each logits row belongs to. The engine's step and a draft model's
// steps (speculative.inl) fill it in turn. Also the host's view of a chunk of logits rows.
#include <cstring>
#include <utility>
#include <vector>

namespace kvlite {
namespace detail {

// `count` values of host memory in F32, BF16 or F16, widened to float (exact): logits and image features a
// backend keeps in its 16-bit activation dtype, read on the host.
inline void widen_to_float(const void* data, DType dtype, size_t count, float* out) {
  if (dtype == DType::F32) {
    memcpy(out, data, count * sizeof(float));
    return;
  }
  const uint8_t* bytes = static_cast<const uint8_t*>(data);
  uint16_t bits = 0;
  if (dtype == DType::BF16) {
    for (size_t j = 0; j < count; j++) {
      memcpy(&bits, bytes + 2 * j, 2);
      out[j] = bf16_to_float(bits);
    }
  } else {
    for (size_t j = 0; j < count; j++) {
      memcpy(&bits, bytes + 2 * j, 2);
      out[j] = f16_to_float(bits);
    }
  }
}

// Row i of a chunk of host logits [rows, vocab] as floats: in place when they are F32, else widened into `scratch`
// [vocab] (16-bit activations).
inline float* host_logits_row(const Tensor& logits, int64_t i, int64_t vocab, float* scratch) {
  if (logits.dtype == DType::F32) return static_cast<float*>(logits.data) + i * vocab;
  widen_to_float(static_cast<const uint8_t*>(logits.data) + size_t(i * vocab) * 2, logits.dtype, size_t(vocab),
                 scratch);
  return scratch;
}

// The request a logits row of the step belongs to, and which of its tokens the row follows.
struct RowOwner {
  EngineRequest* request;
  int64_t position;  // index into request->tokens
};

// Host staging of one step, sized once (Tmax tokens, Smax sequences).
struct StepBatch {
  std::vector<int32_t> token_ids, slots, logit_row_ids;  // [Tmax]
  std::vector<int32_t> window_slots;          // [Tmax] the sliding layers' slots (their own pages), when they have them
  std::vector<int32_t> positions;             // [position_rows, Tmax] (packed to [position_rows, T] per step)
  int64_t position_rows = 1;                  // 3 for M-RoPE (qwen3_vl)
  std::vector<ImageRun> image_runs;           // of the current step
  std::vector<int32_t> query_starts;          // [Smax + 1]
  std::vector<int32_t> context_lens;          // [Smax]
  std::vector<RowOwner> row_owners;           // [Tmax]

  void open(size_t max_tokens, size_t max_seqs, int64_t rows_of_positions) {
    for (auto* v : {&token_ids, &slots, &logit_row_ids, &window_slots}) v->assign(max_tokens, 0);
    position_rows = rows_of_positions;
    positions.assign(size_t(position_rows) * max_tokens, 0);
    query_starts.assign(max_seqs + 1, 0);
    context_lens.assign(max_seqs, 0);
    row_owners.assign(max_tokens, {nullptr, 0});
  }

  // The step packed into the staging arrays (token_ids, positions [position_rows, tokens], slots, query_starts,
  // context_lens, logit_row_ids), as the model reads it; the pool's block tables are the batch's (and window_kv's,
  // the sliding layers' pages, with window_slots, when they have their own).
  StepInput input(const KVPagePool& kv, int64_t tokens, int64_t rows_of_positions, int64_t seqs, int64_t max_context,
                  int64_t logit_rows, const KVPagePool* window_kv = nullptr) {
    StepInput input;
    input.tokens = tokens;
    input.token_ids = token_ids.data();
    input.positions = positions.data();
    input.position_rows = rows_of_positions;
    input.slots = slots.data();
    input.seqs = seqs;
    input.query_starts = query_starts.data();
    input.context_lens = context_lens.data();
    input.max_context = max_context;
    input.block_tables = Tensor::matrix(const_cast<int32_t*>(kv.block_tables()), DType::I32, kv.max_seqs(),
                                        kv.max_pages_per_seq());
    input.logit_rows = logit_rows;
    input.logit_row_ids = logit_row_ids.data();
    if (window_kv) {
      input.window_slots = window_slots.data();
      input.window_block_tables = Tensor::matrix(const_cast<int32_t*>(window_kv->block_tables()), DType::I32,
                                                 window_kv->max_seqs(), window_kv->max_pages_per_seq());
    }
    return input;
  }
};

}  // namespace detail
}  // namespace kvlite
