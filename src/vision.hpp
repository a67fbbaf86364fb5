// ---------------------------------------------------------------------------------------------------------
// vision: the Qwen vision towers (Qwen3-VL, Qwen2.5-VL) written once against Backend, the family differences
// read from VisionTraits (config.hpp), and the multimodal RoPE positions of a prompt with images
// (transformers' modeling_qwen3_vl.py: Qwen3VLVisionModel; modeling_qwen2_5_vl.py:
// Qwen2_5_VisionTransformerPretrainedModel; get_rope_index of both, which agree for images).
//
// Qwen3-VL:
//   pixel rows (N, 3 x 2 x 16 x 16) ─► patch embed (the Conv3d as a Linear) + bilinear position table
//     ─► [ LayerNorm ─► qkv ─► 2-D RoPE ─► attention within each image ─► proj ─► + ─► LayerNorm ─►
//          fc1 ─► GELU (tanh) ─► fc2 ─► + ] x depth
//            └─ after the blocks in deepstack_visual_indexes: 2 x 2 shuffle ─► LayerNorm ─► fc1 ─► GELU ─► fc2
//               ─► DeepStack feature j (N / 4, out), added to the LLM's hidden states after decoder layer j
//     ─► LayerNorm ─► 2 x 2 shuffle ─► fc1 ─► GELU ─► fc2 ─► merged embeddings (N / 4, out): one per
//        <|image_pad|> token, replacing its embedding
//
// Qwen2.5-VL (no position table, no DeepStack):
//   pixel rows ─► patch embed (no bias) ─► reorder by attention window (get_window_index) ─►
//     [ RMSNorm ─► qkv ─► 2-D RoPE ─► attention within each window (each image in fullatt_block_indexes) ─► proj
//       ─► + ─► RMSNorm ─► down(silu(gate) * up) ─► + ] x depth
//     ─► back to raster order (reverse_indices) ─► RMSNorm (ln_q) ─► 2 x 2 shuffle ─► fc ─► GELU ─► fc
//
// Patches arrive in 2 x 2 merge-window order (preprocess_image's rows), so "shuffling" a window's four
// patches into one row of 4 x hidden is a reshape of contiguous rows, free. Qwen2.5-VL's window reordering
// moves whole merge windows, so it keeps them contiguous too, and the merger is row-wise: un-permuting its
// input (one gather_rows) equals transformers' un-permuting of its output.
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

// nn.LayerNorm's parameters: weight and bias [C]; an RMSNorm (Qwen2.5-VL) has no bias (bias.data null).
struct LayerNormWeights {
  Tensor weight;
  Tensor bias;
};

// Qwen3VLVisionBlock / Qwen2_5_VLVisionBlock. vh hidden, vI intermediate.
struct VisionBlockWeights {
  LayerNormWeights norm1, norm2;  // [vh]
  LinearWeights qkv;              // [3 vh, vh] + bias: q | k | v rows
  LinearWeights proj;             // [vh, vh] + bias
  LinearWeights fc1;              // mlp.linear_fc1 [vI, vh] + bias      | SwiGLU: mlp.gate_proj [vI, vh] + bias
  LinearWeights up;               // (absent)                            | SwiGLU: mlp.up_proj [vI, vh] + bias
  LinearWeights fc2;              // mlp.linear_fc2 [vh, vI] + bias      | SwiGLU: mlp.down_proj [vh, vI] + bias
};

// Qwen3VLVisionPatchMerger: norm over vh per patch (the final merger) or over 4 vh after the shuffle
// (DeepStack's), then fc1 [4 vh, 4 vh] -> GELU (erf) -> fc2 [out, 4 vh], all with biases.
// Qwen2_5_VLPatchMerger: ln_q (RMSNorm over vh per patch), mlp.0 [4 vh, 4 vh] -> GELU (erf) -> mlp.2 [out, 4 vh].
struct PatchMergerWeights {
  LayerNormWeights norm;
  LinearWeights fc1, fc2;
  bool norm_after_shuffle = false;
};

struct VisionWeights {
  LinearWeights patch_embed;  // the Conv3d kernel [vh, C, T, P, P] viewed as [vh, C T P P] (c, t, y, x order)
  Tensor pos_embed;           // [side^2, vh], the learned side x side position table (absent in Qwen2.5-VL)
  std::vector<VisionBlockWeights> blocks;          // [depth]
  PatchMergerWeights merger;                       // model.visual.merger
  std::vector<PatchMergerWeights> deepstack;       // model.visual.deepstack_merger_list, one per tap
};

// Binds model.visual.* of a qwen3_vl checkpoint (visual.* of a qwen2_5_vl one) as views into the store's mmap
// (BF16, F16 or F32). Absent
// tensors are listed together (missing_tensor); a wrong shape or dtype is bad_format naming the tensor.
Result<VisionWeights> bind_vision_weights(const ModelConfig& config, const TensorStore& store);

// ---- multimodal RoPE positions ---------------------------------------------------------------------------
// Qwen3-VL's and Qwen2.5-VL's get_rope_index for one sequence (the same for still images: Qwen2.5-VL's
// tokens_per_second scales only video frames): positions [3, S] (rows t, h, w) and rope_delta.
//   - a run of text tokens continues from the current position on all three rows;
//   - image k's tokens (a contiguous run of image_token_id, grids[k].image_tokens of them) are its
//     (grid_t, grid_h / merge, grid_w / merge) token grid in t-major, row-major order at (p + t, p + i, p + j)
//     where p is the current position; the current position then advances by max(grid_h, grid_w) / merge.
//   - rope_delta = max position + 1 - S: a token decoded at cache index c has position c + rope_delta on all
//     three rows.
struct MropePositions {
  std::vector<int32_t> positions;  // [3, S]: positions[r * S + s]
  int64_t rope_delta = 0;
};
// invalid_argument when the image tokens do not form one run per grid of exactly its image_tokens.
Result<MropePositions> mrope_positions(const std::vector<int32_t>& ids, int32_t image_token_id,
                                       const std::vector<ImageGrid>& grids, int64_t spatial_merge_size);

// A VisionInput may come from the caller rather than preprocess_image: everything that sizes memory is checked
// against the vision config before anything is allocated from it. One frame (grid_t 1); grid_h and grid_w
// positive multiples of spatial_merge_size, at most KVLITE_MAX_VISION_GRID_SIDE patches each; image_tokens =
// grid_h x grid_w / merge^2; row_size = in_channels x temporal_patch_size x patch_size^2; exactly
// grid_h x grid_w rows of pixel_values, all finite. invalid_argument naming the field and the numbers.
#ifndef KVLITE_MAX_VISION_GRID_SIDE
#define KVLITE_MAX_VISION_GRID_SIDE 4096  // patches per side: 65,536 pixels at patch 16 [Qwen3-VL's default: 1024]
#endif
namespace limits {
constexpr int64_t max_vision_grid_side = KVLITE_MAX_VISION_GRID_SIDE;
}  // namespace limits
Status check_vision_input(const VisionConfig& vision, const VisionInput& image);

// ---- the vision tower --------------------------------------------------------------------------------------
// The encoder over a Backend, its buffers carved from the arena region "vision" by the names of the plan's
// vision_buffers(). Not thread-safe (one encode at a time, like the backend).
class VisionModel {
 public:
  VisionModel(const ModelConfig& config, VisionWeights weights, Backend& backend, Arena& arena, const Plan& plan);

  // Patches one encode() call holds (summed over its images) and images it holds.
  int64_t max_patches() const { return max_patches_; }
  int64_t max_images() const { return max_images_; }
  // Output levels: 0 the final merger, 1 + j DeepStack tap j.
  int64_t levels() const { return levels_; }

  // Runs the tower over `images` (preprocess_image's outputs, at most max_images() of them with at most
  // max_patches() rows together; each frame attends only to itself). Afterwards output(level) holds the
  // images' tokens in order. Throws kvlite::Error (callers guard).
  void encode(const std::vector<const VisionInput*>& images);
  // F32 [tokens of the last encode, out_hidden_size], in the backend's memory.
  Tensor output(int64_t level) const;

 private:
  void run_merger(const PatchMergerWeights& merger, const Tensor& hidden, int64_t level);
  void norm(const Tensor& x, const LayerNormWeights& weights, const Tensor& out);

  ModelConfig config_;
  VisionWeights weights_;
  Backend& backend_;
  int64_t max_patches_ = 0, max_images_ = 0, levels_ = 0;
  int64_t side_ = 0;  // the position table is side x side
  int64_t head_dim_ = 0;
  float attention_scale_ = 1.0f;
  GeluApprox block_gelu_ = GeluApprox::tanh;  // the gelu MLP's, or SwiGLU's gate activation when not silu
  bool block_silu_ = false;                   // SwiGLU with silu (Qwen2.5-VL's hidden_act)
  int64_t merger_window_side_ = 0;            // merge windows per attention window side; 0: no windows
  std::vector<float> rope_inv_freq_;  // [head_dim / 4]
  int64_t tokens_ = 0;                // of the last encode

  // host staging, sized once
  std::vector<int32_t> pos_indices_host_;   // [N, 4]
  std::vector<float> pos_weights_host_;     // [N, 4]
  std::vector<float> cos_host_, sin_host_;  // [N, head_dim / 2]
  std::vector<int32_t> segments_host_;      // [frames + 1]
  std::vector<uint16_t> pixels_16bit_;      // [N, patch values] when activations are 16-bit
  std::vector<float> pixels_ordered_;       // [N, patch values] F32 rows in window order (window attention)
  std::vector<int32_t> order_host_;         // [N / 4] window_index: the merge window each processed row-group is
  std::vector<int32_t> reverse_host_;       // [N / 4] reverse_indices = argsort(window_index)
  std::vector<int32_t> window_segments_host_;  // [windows + 1] cu_window_seqlens (empty windows dropped)

  // Views of the planned buffers (names in quotes), full size.
  Tensor pixel_patches_;  // "pixel_patches"      [N, C T P P]
  Tensor hidden_;         // "vision_hidden"      [N, vh] the residual stream (activation dtype)
  Tensor normed_;         // "vision_normed"      [N, vh]: LayerNorm outputs, proj / fc2 outputs, pos embeds
  Tensor qkv_;            // "vision_qkv"         [N, 3 vh]
  Tensor attn_out_;       // "vision_attn_out"    [N, vh]; as [N / 4, 4 vh] the mergers' fc1 output
  Tensor mlp_;            // "vision_mlp"         [N, vI]
  Tensor merger_in_;      // "merger_in"          [N / 4, 4 vh]: the mergers' LayerNorm output
  Tensor merged_;         // "merged"             [levels, N / 4, out] activation dtype (as [levels * N / 4, out])
  Tensor pos_indices_;    // "vision_pos_indices" [N, 4] int32
  Tensor pos_weights_;    // "vision_pos_weights" [N, 4] fp32
  Tensor rope_cos_;       // "vision_rope_cos"    [N, head_dim / 2] fp32
  Tensor rope_sin_;       // "vision_rope_sin"    [N, head_dim / 2] fp32
  Tensor segments_;       // "vision_segments"    [frames + 1] int32
  Tensor gate_up_;        // "vision_gate_up"     [N, 2 vI] (SwiGLU)
  Tensor window_segments_;  // "vision_window_segments" [N / 4 + 1] int32 (window attention)
  Tensor window_order_;     // "vision_window_order"    [N / 4] int32: reverse_indices
};

}  // namespace kvlite
