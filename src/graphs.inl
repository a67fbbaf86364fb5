// graphs: CUDA graphs of the decode step. A decode step of S sequences (one token each, in pool slots 0 .. S-1)
// replays the graph of the smallest bucket B >= S: the step is padded to B rows; rows past its tokens belong to
// the attention batch's spare sequence B (whose block table points at page 0 and whose context is its own rows:
// it reads, never writes, KV: its slots are -1), so the captured launches (B rows, B + 1 sequences) fit every step
// of the bucket. Captured once at open (capture); the engine offers each step to run() before running it eagerly.
#include <algorithm>
#include <map>
#include <utility>
#include <vector>

namespace kvlite {
namespace detail {

class DecodeGraphs {
 public:
  // At open: one graph per bucket the step buffers hold (max_seqs sequences, max_batched_tokens tokens), after an
  // eager run of each padded step (which loads the kernels and lets cuBLAS pick its algorithms, so capturing
  // allocates nothing), and the device memory the graphs took, measured (info.graph_buckets, graph_memory_bytes).
  // The model, backend and pool outlive the graphs.
  // window_pool: the sliding layers' pages (Arena::kv_window), or nullptr; its block tables and slots are padded
  // the same way (the spare sequence reads its page 0).
  void capture(TextModel& model, Backend& backend, const KVPagePool& pool, const KVPagePool* window_pool,
               int64_t position_rows, int64_t max_seqs, int64_t max_batched_tokens, int64_t max_model_len,
               EngineInfo& info) {
    model_ = &model;
    backend_ = &backend;
    pool_ = &pool;
    window_pool_ = window_pool;
    position_rows_ = position_rows;
    // The longest context a graph's attention was captured for: every step's context is at most max_model_len.
    max_context_ = std::max<int64_t>(max_model_len, max_seqs);
    std::vector<int64_t> buckets;
    for (int64_t bucket : decode_graph_buckets(max_seqs))
      if (bucket <= max_batched_tokens) buckets.push_back(bucket);
    if (buckets.empty()) return;
    const int64_t largest = buckets.back(), pages = pool.max_pages_per_seq();
    padded_.token_ids.assign(size_t(largest), 0);
    padded_.slots.assign(size_t(largest), -1);
    padded_.positions.assign(size_t(position_rows * largest), 0);
    padded_.query_starts.assign(size_t(largest + 2), 0);
    padded_.context_lens.assign(size_t(largest + 1), 0);
    padded_.block_tables.assign(size_t((largest + 1) * pages), 0);
    if (window_pool_) {
      padded_.window_slots.assign(size_t(largest), -1);
      padded_.window_block_tables.assign(size_t((largest + 1) * pages), 0);
    }
    StepInput shape;  // only tokens and image_runs matter to compute()
    for (int64_t bucket : buckets) {
      shape.tokens = bucket;
      stage_padded(nullptr, bucket);
      model.compute(shape);
    }
    check(backend.synchronize());
    // Measured once everything the eager runs load (kernels, cuBLAS's state) is loaded: the graphs' own memory.
    Result<std::pair<uint64_t, uint64_t>> before = cuda::memory_info();
    if (!before) throw before.error();
    for (int64_t bucket : buckets) {
      shape.tokens = bucket;
      stage_padded(nullptr, bucket);
      Result<CudaGraph> graph = cuda::capture_graph(backend, [&] { model.compute(shape); });
      if (!graph) throw graph.error();
      graphs_.emplace(bucket, std::move(*graph));
      info.graph_buckets.push_back(bucket);
    }
    Result<std::pair<uint64_t, uint64_t>> after = cuda::memory_info();
    if (!after) throw after.error();
    info.graph_memory_bytes = before->first > after->first ? before->first - after->first : 0;
  }

  // Runs `step` from a graph when it is a decode step (one token for each of its `requests`) a bucket holds;
  // false otherwise (the caller runs it eagerly).
  bool run(const StepInput& step, int64_t requests) {
    if (graphs_.empty() || step.image_runs > 0 || step.tokens != requests) return false;
    if (backend_->op_timing()) return false;  // timed: op by op (a replay would time as no op at all)
    auto bucket = graphs_.lower_bound(step.seqs);
    if (bucket == graphs_.end()) return false;
    stage_padded(&step, bucket->first);
    check(cuda::launch_graph(*backend_, bucket->second));
    return true;
  }

 private:
  static void check(const Status& status) {
    if (!status) throw status.error();
  }

  // The padded form of `step` (n_real tokens of `step`, or none) for bucket B, staged.
  void stage_padded(const StepInput* step, int64_t bucket) {
    const int64_t real = step ? step->tokens : 0, seqs = step ? step->seqs : 0;
    const int64_t pages = pool_->max_pages_per_seq();
    PaddedStep& p = padded_;
    std::fill(p.token_ids.begin(), p.token_ids.end(), 0);
    std::fill(p.slots.begin(), p.slots.end(), -1);
    std::fill(p.positions.begin(), p.positions.end(), 0);
    std::fill(p.context_lens.begin(), p.context_lens.end(), 0);
    if (step) {
      std::copy(step->token_ids, step->token_ids + real, p.token_ids.begin());
      std::copy(step->slots, step->slots + real, p.slots.begin());
      for (int64_t row = 0; row < position_rows_; row++)
        std::copy(step->positions + row * real, step->positions + (row + 1) * real, p.positions.begin() + row * bucket);
      std::copy(step->query_starts, step->query_starts + seqs + 1, p.query_starts.begin());
      std::copy(step->context_lens, step->context_lens + seqs, p.context_lens.begin());
      std::copy(pool_->block_tables(), pool_->block_tables() + seqs * pages, p.block_tables.begin());
      if (window_pool_) {
        std::copy(step->window_slots, step->window_slots + real, p.window_slots.begin());
        std::copy(window_pool_->block_tables(), window_pool_->block_tables() + seqs * pages,
                  p.window_block_tables.begin());
      }
    }
    if (window_pool_) {
      std::fill(p.window_slots.begin() + real, p.window_slots.end(), -1);
      // (a sliding layer's released pages are -1: the kernels never read them; the spare sequence reads page 0)
      std::fill(p.window_block_tables.begin() + bucket * pages, p.window_block_tables.begin() + (bucket + 1) * pages, 0);
    }
    for (int64_t s = seqs + (step ? 1 : 0); s <= bucket; s++) p.query_starts[size_t(s)] = int32_t(real);
    p.query_starts[size_t(bucket + 1)] = int32_t(bucket);
    p.context_lens[size_t(bucket)] = int32_t(bucket - real);  // the spare sequence: the padding rows
    std::fill(p.block_tables.begin() + bucket * pages, p.block_tables.begin() + (bucket + 1) * pages, 0);
    StepInput input;
    input.tokens = bucket;
    input.token_ids = p.token_ids.data();
    input.positions = p.positions.data();
    input.position_rows = position_rows_;
    input.slots = p.slots.data();
    input.seqs = bucket + 1;
    input.query_starts = p.query_starts.data();
    input.context_lens = p.context_lens.data();
    input.max_context = max_context_;
    input.block_tables = Tensor::matrix(p.block_tables.data(), DType::I32, bucket + 1, pages);
    input.logit_rows = step ? step->logit_rows : 0;
    input.logit_row_ids = step ? step->logit_row_ids : nullptr;
    if (window_pool_) {
      input.window_slots = p.window_slots.data();
      input.window_block_tables = Tensor::matrix(p.window_block_tables.data(), DType::I32, bucket + 1, pages);
    }
    model_->stage(input);
  }

  TextModel* model_ = nullptr;
  Backend* backend_ = nullptr;
  const KVPagePool* pool_ = nullptr;
  const KVPagePool* window_pool_ = nullptr;
  int64_t position_rows_ = 1, max_context_ = 0;
  std::map<int64_t, CudaGraph> graphs_;  // by bucket
  // The host staging of a step padded to a bucket (sized for the largest).
  struct PaddedStep {
    std::vector<int32_t> token_ids, slots, positions, query_starts, context_lens, block_tables;
    std::vector<int32_t> window_slots, window_block_tables;  // the sliding layers' own (window_pool_)
  } padded_;
};

}  // namespace detail
}  // namespace kvlite
