// ---------------------------------------------------------------------------------------------------------
// rope: rotary position embeddings as transformers computes them (modeling_rope_utils.py, transformers 5.x):
// the inverse frequencies and attention factor of every scaling type in ROPE_INIT_FUNCTIONS (default, linear,
// dynamic, yarn, longrope, llama3), the frequency switch of `dynamic_rope_update` for the two whose
// frequencies depend on the sequence's length (dynamic, longrope), and the cos/sin tables rope() applies.
// Host helpers, shared by every backend and model.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// What one rotary call uses: the inverse frequencies and the factor cos and sin are multiplied by
// (transformers' `attention_scaling`: yarn's mscale and longrope's attention factor scale q and k, so q.k by
// its square; 1 for the other types).
struct RopeFrequencies {
  std::vector<float> inv_freq;  // [rotary_dim / 2]
  float attention_factor = 1.0f;
};

// rotary_dim = int(head_dim * partial_rotary_factor) (Phi-4-mini: 0.75): rope() rotates the first rotary_dim
// dimensions of each head (rotate_half within them) and leaves the rest. Even and in 2..head_dim, or an error.
Result<int64_t> rope_rotary_dim(const RopeConfig& rope, int64_t head_dim);

// ROPE_INIT_FUNCTIONS[rope.type](config, seq_len=seq_len) in float32, step for step; seq_len 0 is Python's
// None (what the rotary module's __init__ passes). Only dynamic and longrope read seq_len:
//   dynamic:  base' = base * (factor * max(seq_len, max_pos) / max_pos - (factor - 1)) ** (d / (d - 2))
//   longrope: long_factor when seq_len > original_max_position_embeddings, short_factor otherwise.
// Unknown types are refused (ErrorCode::unsupported, naming the type).
Result<RopeFrequencies> rope_frequencies(const RopeConfig& rope, int64_t rotary_dim, int64_t seq_len = 0);

// Whether the frequencies depend on the sequence's length (dynamic, longrope).
bool rope_depends_on_length(const RopeConfig& rope);

// The frequencies a freshly made transformers rotary module uses for a forward call whose largest position is
// seq_len - 1 (`seq_len = max(position_ids) + 1` in dynamic_rope_update):
//   dynamic:  seq_len > max_position_embeddings ? rope_frequencies(rope, d, seq_len) : the init ones
//   longrope: seq_len > original_max_position_embeddings ? the long ones : the short (init) ones
//   others:   the init ones, whatever seq_len.
// transformers never re-rotates cached keys: a key keeps the frequencies of the call that computed it.
Result<RopeFrequencies> rope_frequencies_for_length(const RopeConfig& rope, int64_t rotary_dim, int64_t seq_len);

// The context a RoPE scaling is meant to reach, for planning (vLLM's rule): yarn original * factor; linear and
// dynamic max_position_embeddings * factor; the others (longrope, llama3 write theirs) max_position_embeddings.
// Never below max_position_embeddings.
int64_t rope_context_length(const RopeConfig& rope, int64_t max_position_embeddings);

// inv_freq of rope_frequencies(rope, rotary_dim) alone (its attention factor dropped: use rope_frequencies
// for types that have one).
Result<std::vector<float>> rope_inv_freq(const RopeConfig& rope, int64_t rotary_dim);

// cos/sin tables [tokens, half] for rope(), half = inv_freq.size(): angle = float(inv_freq[i] * position)
// in float32 as transformers forms it, then its cos and sin, each times attention_factor in float32.
// positions I32 [position_rows, tokens] (transformers' position_ids layout): 1 row for plain RoPE; 3 rows
// (t, h, w) for M-RoPE, laid over the frequencies as `layout` says (RopeConfig::MropeLayout):
//   interleaved (Qwen3-VL): frequency i takes row h when i % 3 == 1 and i < 3 * mrope_section[1], row w when
//                           i % 3 == 2 and i < 3 * mrope_section[2], else row t;
//   sectioned (Qwen2.5-VL): row t below section[0], row h below section[0] + section[1], row w after.
// cos, sin: host arrays of tokens * half floats.
Status rope_tables(const std::vector<float>& inv_freq, const int32_t* positions, int64_t position_rows,
                   int64_t tokens, const std::vector<int>& mrope_section, float* cos, float* sin,
                   float attention_factor = 1.0f,
                   RopeConfig::MropeLayout layout = RopeConfig::MropeLayout::interleaved);

// The length transformers' dynamic_rope_update sees for each token of a step: seq_len = max(position) + 1 over
// the tokens of the token's sequence in the step (sequence s holds tokens query_starts[s] .. query_starts[s + 1]
// - 1; positions [tokens], the first position row). lengths [tokens]. RotaryEmbedding::tables reads them.
Status rope_step_lengths(const int32_t* positions, int64_t tokens, const int32_t* query_starts, int64_t seqs,
                         int32_t* lengths);

// A model's rotary embedding: one per RopeConfig (a model with per-layer-kind RoPE, e.g. Gemma 3's local and
// global layers, keeps one per kind). Makes the cos/sin tables of a step, the frequencies picked per token by
// the length transformers' rotary forward would see.
class RotaryEmbedding {
 public:
  static Result<RotaryEmbedding> create(const RopeConfig& rope, int64_t head_dim);
  RotaryEmbedding() = default;

  int64_t rotary_dim() const { return rotary_dim_; }
  int64_t half() const { return rotary_dim_ / 2; }  // the tables' columns
  const RopeConfig& config() const { return rope_; }
  bool depends_on_length() const { return rope_depends_on_length(rope_); }
  // The init frequencies (what rope_frequencies(rope, rotary_dim) gives).
  const RopeFrequencies& init_frequencies() const { return init_; }

  // cos, sin [tokens, half()] for positions [position_rows, tokens]. lengths[t] is the sequence length
  // transformers' dynamic_rope_update sees for token t's forward call, max(position_ids) + 1 over the tokens of
  // its sequence in the call (TextModel passes that per sequence of the step); read only when
  // depends_on_length(), and may be null otherwise. Length-dependent types take one position row.
  Status tables(const int32_t* positions, int64_t position_rows, int64_t tokens, const int32_t* lengths,
                float* cos, float* sin) const;

 private:
  RopeConfig rope_;
  int64_t rotary_dim_ = 0;
  RopeFrequencies init_;
  RopeFrequencies long_;  // longrope: the long factors' frequencies
  // dynamic: the last length's frequencies (a step's sequences mostly share few lengths)
  mutable int64_t cached_length_ = -1;
  mutable RopeFrequencies cached_;
};

}  // namespace kvlite
