// vision: implementation. The encoder mirrors transformers' Qwen3VLVisionModel.forward (modeling_qwen3_vl.py),
// Qwen2_5_VisionTransformerPretrainedModel.forward (modeling_qwen2_5_vl.py) and the index helpers of
// vision_utils.py; the PyTorch line is in the comment above each call.
#include <algorithm>
#include <cmath>

namespace kvlite {

Result<VisionWeights> bind_vision_weights(const ModelConfig& config, const TensorStore& store) {
  return detail::guard([&] {
    using detail::fail;
    using detail::format;
    const VisionConfig& v = config.vision;
    if ((config.arch != Arch::qwen3_vl && config.arch != Arch::qwen2_5_vl) || !v.present)
      fail(ErrorCode::unsupported, format("%s: model_type '%s' has no Qwen3-VL or Qwen2.5-VL vision tower",
                                          config.origin.c_str(), config.model_type.c_str()));
    const VisionTraits& traits = v.traits;
    const std::string& visual = traits.prefix;  // "model.visual." | "visual."
    const bool rms = traits.norm == VisionNorm::rms_norm, swiglu = traits.mlp == VisionMlp::swiglu;
    const int64_t vh = v.hidden_size, vI = v.intermediate_size, out = v.out_hidden_size;
    const int64_t merged = vh * v.spatial_merge_size * v.spatial_merge_size;
    const int64_t patch_values = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size;

    detail::model::WeightBinder bind(config, store);
    // nn.LayerNorm (weight, bias) or Qwen2_5_VLRMSNorm (weight)
    auto layer_norm = [&](const std::string& module, int64_t n) {
      if (rms) return LayerNormWeights{bind.bind(module + ".weight", {n}), Tensor{}};
      return LayerNormWeights{bind.bind(module + ".weight", {n}), bind.bind(module + ".bias", {n})};
    };
    // Qwen3VLVisionPatchMerger (norm, linear_fc1, linear_fc2) | Qwen2_5_VLPatchMerger (ln_q, mlp.0, mlp.2)
    auto patch_merger = [&](const std::string& module, bool norm_after_shuffle) {
      PatchMergerWeights m;
      m.norm = layer_norm(module + (swiglu ? ".ln_q" : ".norm"), norm_after_shuffle ? merged : vh);
      m.fc1 = bind.linear(module + (swiglu ? ".mlp.0" : ".linear_fc1"), merged, merged, true);
      m.fc2 = bind.linear(module + (swiglu ? ".mlp.2" : ".linear_fc2"), out, merged, true);
      m.norm_after_shuffle = norm_after_shuffle;
      return m;
    };
    VisionWeights w;
    // nn.Conv3d(C, vh, kernel = stride = (T, P, P)): each patch meets the kernel once, so it is a Linear over
    // the patch's C x T x P x P values in the kernel's own (c, t, y, x) order - preprocess_image's row order.
    w.patch_embed.weight = bind.bind_as(visual + "patch_embed.proj.weight",
                                        {vh, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size}, vh,
                                        patch_values);
    // Qwen2_5_VisionPatchEmbed: nn.Conv3d(..., bias=False)
    if (traits.patch_embed_bias) w.patch_embed.bias = bind.bind(visual + "patch_embed.proj.bias", {vh});
    if (traits.learned_positions) w.pos_embed = bind.bind(visual + "pos_embed.weight", {v.num_position_embeddings, vh});
    w.blocks.resize(size_t(v.depth));
    for (int64_t b = 0; b < v.depth; b++) {
      const std::string block = visual + format("blocks.%lld.", (long long)b);
      VisionBlockWeights& bw = w.blocks[size_t(b)];
      bw.norm1 = layer_norm(block + "norm1", vh);
      bw.norm2 = layer_norm(block + "norm2", vh);
      bw.qkv = bind.linear(block + "attn.qkv", 3 * vh, vh, true);
      bw.proj = bind.linear(block + "attn.proj", vh, vh, true);
      if (swiglu) {  // Qwen2_5_VLMLP(config, bias=True)
        bw.fc1 = bind.linear(block + "mlp.gate_proj", vI, vh, true);
        bw.up = bind.linear(block + "mlp.up_proj", vI, vh, true);
        bw.fc2 = bind.linear(block + "mlp.down_proj", vh, vI, true);
      } else {
        bw.fc1 = bind.linear(block + "mlp.linear_fc1", vI, vh, true);
        bw.fc2 = bind.linear(block + "mlp.linear_fc2", vh, vI, true);
      }
    }
    w.merger = patch_merger(visual + "merger", false);
    for (size_t j = 0; j < v.deepstack_visual_indexes.size(); j++)
      w.deepstack.push_back(patch_merger(visual + format("deepstack_merger_list.%zu", j), true));
    bind.finish();
    return w;
  });
}

// ---- multimodal RoPE positions ---------------------------------------------------------------------------

Result<MropePositions> mrope_positions(const std::vector<int32_t>& ids, int32_t image_token_id,
                                       const std::vector<ImageGrid>& grids, int64_t spatial_merge_size) {
  return detail::guard([&] {
    using detail::fail;
    using detail::format;
    if (spatial_merge_size <= 0)
      fail(ErrorCode::invalid_argument, format("mrope_positions: spatial_merge_size %lld must be positive",
                                               (long long)spatial_merge_size));
    const int64_t S = int64_t(ids.size());
    MropePositions result;
    result.positions.assign(size_t(3 * S), 0);
    int32_t* t_row = result.positions.data();
    int32_t* h_row = t_row + S;
    int32_t* w_row = h_row + S;
    int64_t current = 0, max_position = -1;  // current_pos in get_rope_index
    size_t image = 0;
    for (int64_t s = 0; s < S;) {
      if (ids[size_t(s)] != image_token_id) {
        // text: torch.arange(text_len).view(1, -1).expand(3, -1) + current_pos
        t_row[s] = h_row[s] = w_row[s] = int32_t(current);
        max_position = std::max(max_position, current);
        current++;
        s++;
        continue;
      }
      int64_t run = 0;
      while (s + run < S && ids[size_t(s + run)] == image_token_id) run++;
      if (image >= grids.size())
        fail(ErrorCode::invalid_argument,
             format("mrope_positions: image tokens at %lld..%lld but only %zu image grid%s were given",
                    (long long)s, (long long)(s + run - 1), grids.size(), grids.size() == 1 ? "" : "s"));
      const ImageGrid& g = grids[image];
      // get_vision_position_ids(current_pos, grid_thw, 1, spatial_merge_size)
      const int64_t gt = g.grid_t, gh = g.grid_h / spatial_merge_size, gw = g.grid_w / spatial_merge_size;
      if (gt <= 0 || gh <= 0 || gw <= 0 || run != gt * gh * gw)
        fail(ErrorCode::invalid_argument,
             format("mrope_positions: image %zu has %lld tokens (%lld..%lld) but its grid %lld x %lld x %lld with "
                    "merge %lld makes %lld; each image's <|image_pad|> run must hold exactly its tokens",
                    image, (long long)run, (long long)s, (long long)(s + run - 1), (long long)g.grid_t,
                    (long long)g.grid_h, (long long)g.grid_w, (long long)spatial_merge_size,
                    (long long)(std::max<int64_t>(gt, 0) * std::max<int64_t>(gh, 0) * std::max<int64_t>(gw, 0))));
      for (int64_t ti = 0; ti < gt; ti++)
        for (int64_t i = 0; i < gh; i++)
          for (int64_t j = 0; j < gw; j++, s++) {
            t_row[s] = int32_t(current + ti);
            h_row[s] = int32_t(current + i);
            w_row[s] = int32_t(current + j);
          }
      max_position = std::max(max_position, current + std::max(gt - 1, std::max(gh - 1, gw - 1)));
      // current_pos += max(grid_thw[1], grid_thw[2]) // spatial_merge_size
      current += std::max(g.grid_h, g.grid_w) / spatial_merge_size;
      image++;
    }
    if (image != grids.size())
      fail(ErrorCode::invalid_argument,
           format("mrope_positions: %zu image grid%s given but the ids hold %zu image%s (runs of <|image_pad|>)",
                  grids.size(), grids.size() == 1 ? "" : "s", image, image == 1 ? "" : "s"));
    // mrope_position_deltas = llm_positions.max() + 1 - len(input_ids)
    result.rope_delta = max_position + 1 - S;
    return result;
  });
}

Status check_vision_input(const VisionConfig& v, const VisionInput& image) {
  return detail::guard([&] {
    using detail::fail;
    using detail::format;
    const ImageGrid& g = image.grid;
    const int64_t merge_side = v.spatial_merge_size, side = limits::max_vision_grid_side;
    if (g.grid_t != 1)
      fail(ErrorCode::invalid_argument, format("image grid_t is %lld: an image is one frame (grid_t 1)", (long long)g.grid_t));
    for (auto [name, value] : {std::pair<const char*, int64_t>{"grid_h", g.grid_h}, {"grid_w", g.grid_w}})
      if (value < merge_side || value > side || value % merge_side != 0)
        fail(ErrorCode::invalid_argument,
             format("image %s is %lld: it must be a multiple of the merge size %lld between %lld and %lld patches "
                    "(KVLITE_MAX_VISION_GRID_SIDE)", name, (long long)value, (long long)merge_side,
                    (long long)merge_side, (long long)side));
    // Bounded above: grid_h x grid_w <= 2^24 and row_size <= 64 x 64 x 64^2 = 2^24 (KVLITE_MAX_VISION_PATCH).
    const int64_t rows = g.grid_h * g.grid_w, tokens = rows / (merge_side * merge_side);
    if (g.image_tokens != tokens)
      fail(ErrorCode::invalid_argument,
           format("image_tokens is %lld but a %lld x %lld grid with merge size %lld makes %lld", (long long)g.image_tokens,
                  (long long)g.grid_h, (long long)g.grid_w, (long long)merge_side, (long long)tokens));
    const int64_t row_size = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size;
    if (image.row_size != row_size)
      fail(ErrorCode::invalid_argument,
           format("row_size is %lld but this vision tower's rows hold %lld values (%lld channels x %lld frames x %lld^2)",
                  (long long)image.row_size, (long long)row_size, (long long)v.in_channels,
                  (long long)v.temporal_patch_size, (long long)v.patch_size));
    const uint64_t values = detail::checked_mul(uint64_t(rows), uint64_t(row_size), "pixel_values", ErrorCode::invalid_argument);
    if (image.pixel_values.size() != values)
      fail(ErrorCode::invalid_argument,
           format("pixel_values holds %zu values; a %lld x %lld grid of rows of %lld needs %llu", image.pixel_values.size(),
                  (long long)g.grid_h, (long long)g.grid_w, (long long)row_size, (unsigned long long)values));
    for (size_t i = 0; i < image.pixel_values.size(); i++)
      if (!std::isfinite(image.pixel_values[i]))
        fail(ErrorCode::invalid_argument, format("pixel_values[%zu] is not finite (%g)", i, double(image.pixel_values[i])));
  });
}

// ---- the vision tower --------------------------------------------------------------------------------------

namespace detail {
namespace vision {

inline void check(const Status& status) {
  if (!status) throw status.error();
}

// One axis of get_vision_interpolation_indices_and_weights(mode="bilinear", align_corners=True): the two
// table rows a patch coordinate falls between and their weights, in float32 as torch computes them:
//   src = index * (side - 1) / clamp(size - 1, min=1); taps floor, floor + 1 (clamped to the table);
//   weight = clamp(1 - |src - floor - offset|, min=0)
struct AxisTaps {
  int64_t tap[2];
  float weight[2];
};
inline AxisTaps axis_taps(int64_t index, int64_t size, int64_t side) {
  const float src = float(index) * float(side - 1) / float(std::max<int64_t>(size - 1, 1));
  const float floor = std::floor(src);
  AxisTaps taps;
  for (int offset = 0; offset < 2; offset++) {
    taps.tap[offset] = std::min<int64_t>(std::max<int64_t>(int64_t(floor) + offset, 0), side - 1);
    const float distance = std::fabs(src - floor - float(offset));
    taps.weight[offset] = std::max(1.0f - distance, 0.0f);
  }
  return taps;
}

}  // namespace vision
}  // namespace detail

VisionModel::VisionModel(const ModelConfig& config, VisionWeights weights, Backend& backend, Arena& arena,
                         const Plan& plan)
    : config_(config), weights_(std::move(weights)), backend_(backend) {
  using detail::fail;
  using detail::format;
  const VisionConfig& v = config_.vision;
  const int64_t vh = v.hidden_size, vI = v.intermediate_size, merge = v.spatial_merge_size * v.spatial_merge_size;
  head_dim_ = vh / v.num_heads;
  levels_ = 1 + int64_t(v.deepstack_visual_indexes.size());
  max_images_ = plan.options.max_images;
  // The planner's patch budget: whole merge windows of max_image_pixels, per image.
  const int64_t window = v.patch_size * v.spatial_merge_size;
  max_patches_ = plan.options.max_image_pixels / (window * window) * merge * max_images_;
  side_ = int64_t(std::llround(std::sqrt(double(v.num_position_embeddings))));
  if (v.traits.learned_positions && side_ * side_ != v.num_position_embeddings)
    fail(ErrorCode::unsupported,
         format("%s: vision_config.num_position_embeddings %lld is not a square; the position table is side x side",
                config_.origin.c_str(), (long long)v.num_position_embeddings));
  if (head_dim_ % 4 != 0)
    fail(ErrorCode::unsupported,
         format("%s: the vision head_dim %lld is not a multiple of 4 (its 2-D RoPE splits each half into row and "
                "column frequencies)", config_.origin.c_str(), (long long)head_dim_));
  const bool swiglu = v.traits.mlp == VisionMlp::swiglu;
  if (v.hidden_act == "gelu_pytorch_tanh") {
    block_gelu_ = GeluApprox::tanh;
  } else if (v.hidden_act == "gelu") {
    block_gelu_ = GeluApprox::none;
  } else if (v.hidden_act == "silu" && swiglu) {
    block_silu_ = true;
  } else {
    fail(ErrorCode::unsupported, format("%s: vision_config.hidden_act '%s' is not supported (gelu_pytorch_tanh, gelu%s)",
                                        config_.origin.c_str(), v.hidden_act.c_str(), swiglu ? ", silu" : ""));
  }
  // vit_merger_window_size = self.window_size // self.spatial_merge_size // self.patch_size
  if (v.traits.window_size > 0) merger_window_side_ = v.traits.window_size / (v.spatial_merge_size * v.patch_size);
  // self.scaling = self.head_dim ** -0.5
  attention_scale_ = float(std::pow(double(head_dim_), -0.5));
  // Qwen3VLVisionRotaryEmbedding: inv_freq = 1 / base ** (arange(0, spatial_dim, 2) / spatial_dim),
  // spatial_dim = head_dim / 2: rope_inv_freq's "default" at rotary_dim = head_dim / 2.
  RopeConfig rope;
  rope.theta = v.rope_theta;
  Result<std::vector<float>> inv_freq = rope_inv_freq(rope, head_dim_ / 2);
  if (!inv_freq) throw inv_freq.error();
  rope_inv_freq_ = std::move(*inv_freq);

  const int64_t N = max_patches_, tokens = N / merge;
  const int64_t patch_values = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size;
  const DType act = backend_.activation_dtype();
  detail::model::BufferCarver buffers(arena);
  buffers.carve("vision", vision_buffers(config_, plan.options.max_image_pixels, max_images_, act));
  pixel_patches_ = buffers.view("pixel_patches", act, N, patch_values);
  hidden_ = buffers.view("vision_hidden", act, N, vh);
  normed_ = buffers.view("vision_normed", act, N, vh);
  qkv_ = buffers.view("vision_qkv", act, N, 3 * vh);
  attn_out_ = buffers.view("vision_attn_out", act, N, vh);
  mlp_ = buffers.view("vision_mlp", act, N, vI);
  merger_in_ = buffers.view("merger_in", act, tokens, merge * vh);
  merged_ = buffers.view("merged", act, levels_ * tokens, v.out_hidden_size);
  if (v.traits.learned_positions) {
    pos_indices_ = buffers.view("vision_pos_indices", DType::I32, N, 4);
    pos_weights_ = buffers.view("vision_pos_weights", DType::F32, N, 4);
    pos_indices_host_.resize(size_t(N * 4));
    pos_weights_host_.resize(size_t(N * 4));
  }
  if (swiglu) gate_up_ = buffers.view("vision_gate_up", act, N, 2 * vI);
  if (merger_window_side_ > 0) {
    window_segments_ = buffers.view("vision_window_segments", DType::I32, tokens + 1, 1);
    window_order_ = buffers.view("vision_window_order", DType::I32, tokens, 1);
    window_segments_host_.resize(size_t(tokens + 1));
    pixels_ordered_.resize(size_t(N * patch_values));
  }
  order_host_.resize(size_t(tokens));
  reverse_host_.resize(size_t(tokens));
  rope_cos_ = buffers.view("vision_rope_cos", DType::F32, N, head_dim_ / 2);
  rope_sin_ = buffers.view("vision_rope_sin", DType::F32, N, head_dim_ / 2);
  segments_ = buffers.view("vision_segments", DType::I32, max_images_ + 1, 1);

  cos_host_.resize(size_t(N * head_dim_ / 2));
  sin_host_.resize(size_t(N * head_dim_ / 2));
  segments_host_.resize(size_t(max_images_ + 1));
  if (act != DType::F32) pixels_16bit_.resize(size_t(N * patch_values));
}

Tensor VisionModel::output(int64_t level) const {
  const int64_t tokens_per_level = merged_.rows / levels_;
  return merged_.slice_rows(level * tokens_per_level, tokens_);
}

void VisionModel::encode(const std::vector<const VisionInput*>& images) {
  using detail::fail;
  using detail::format;
  using detail::vision::check;
  const VisionConfig& v = config_.vision;
  const int64_t merge_side = v.spatial_merge_size, merge = merge_side * merge_side;
  const int64_t half = head_dim_ / 2, quarter = head_dim_ / 4;

  // ---- host side: the images' rows, position taps, RoPE tables and segments (get_vision_* helpers) ----
  if (images.empty() || int64_t(images.size()) > max_images_)
    fail(ErrorCode::internal, format("vision encode: %zu images; one call takes 1..%lld", images.size(),
                                     (long long)max_images_));
  int64_t N = 0, longest = 0;
  for (const VisionInput* image : images) {
    Status valid = check_vision_input(v, *image);
    if (!valid) fail(valid.error().code, "vision encode: " + valid.error().message);
    N += image->rows();
    longest = std::max(longest, image->rows());
  }
  if (N > max_patches_)
    fail(ErrorCode::invalid_argument,
         format("vision encode: %lld patches; the plan's vision buffers hold %lld (max_images %lld of at most "
                "max_image_pixels each): raise max_image_pixels or encode fewer images at once",
                (long long)N, (long long)max_patches_, (long long)max_images_));
  tokens_ = N / merge;
  const VisionTraits& traits = v.traits;
  const int64_t patch_values = images[0]->row_size;
  // get_vision_window_index: per image, the merge windows grouped into attention windows of
  // vit_merger_window_size^2 (raster order of windows, raster order inside each; the padding of the last row
  // and column of windows holds nothing), and cu_window_seqlens, their boundaries in patches with the empty
  // windows dropped (torch.unique_consecutive). Without windows the order is the identity.
  int64_t unit = 0;  // merge windows of the images before
  size_t windows = 0;
  int64_t longest_window = 0;
  if (merger_window_side_ > 0) window_segments_host_[0] = 0;
  for (const VisionInput* image : images) {
    const ImageGrid& g = image->grid;
    const int64_t units_h = g.grid_h / merge_side, units_w = g.grid_w / merge_side;
    if (merger_window_side_ <= 0) {
      for (int64_t u = 0; u < units_h * units_w; u++) order_host_[size_t(unit + u)] = int32_t(unit + u);
    } else {
      const int64_t side = merger_window_side_;
      int64_t at = unit;
      for (int64_t wy = 0; wy * side < units_h; wy++)
        for (int64_t wx = 0; wx * side < units_w; wx++) {
          const int64_t y_end = std::min(units_h, (wy + 1) * side), x_end = std::min(units_w, (wx + 1) * side);
          for (int64_t y = wy * side; y < y_end; y++)
            for (int64_t x = wx * side; x < x_end; x++) order_host_[size_t(at++)] = int32_t(unit + y * units_w + x);
          // cu_seqlens_tmp = seqlens.cumsum(0) * spatial_merge_unit + cu_window_seqlens[-1]
          window_segments_host_[windows + 1] = int32_t(at * merge);
          longest_window = std::max(longest_window, (y_end - wy * side) * (x_end - wx * side) * merge);
          windows++;
        }
    }
    unit += units_h * units_w;
  }
  // reverse_indices = torch.argsort(window_index)
  for (int64_t j = 0; j < tokens_; j++) reverse_host_[size_t(order_host_[size_t(j)])] = int32_t(j);

  // Per processed row (in window order): its image, its patch coordinates, its position taps and RoPE angles.
  int64_t row = 0;
  segments_host_[0] = 0;
  unit = 0;
  for (size_t k = 0; k < images.size(); k++) {
    const ImageGrid& g = images[k]->grid;
    // Merge window u of an image is at (u / windows_w, u % windows_w) (raster order); its row r at
    // (r / 2 % 2, r % 2) inside it.
    const int64_t windows_w = g.grid_w / merge_side, units = g.grid_h * g.grid_w / merge;
    for (int64_t within = 0; within < g.grid_h * g.grid_w; within++, row++) {
      const int64_t source_unit = order_host_[size_t(row / merge)] - unit;  // the merge window this row is from
      const int64_t in_window = row % merge;
      const int64_t in_col = in_window % merge_side, in_row = in_window / merge_side;
      const int64_t block_col = source_unit % windows_w, block_row = source_unit / windows_w;
      const int64_t patch_row = block_row * merge_side + in_row, patch_col = block_col * merge_side + in_col;
      if (traits.learned_positions) {
        // indices = h_taps * side + w_taps (outer product), weights = h_weights * w_weights
        const detail::vision::AxisTaps h = detail::vision::axis_taps(patch_row, g.grid_h, side_);
        const detail::vision::AxisTaps w = detail::vision::axis_taps(patch_col, g.grid_w, side_);
        for (int a = 0; a < 2; a++)
          for (int b = 0; b < 2; b++) {
            pos_indices_host_[size_t(row * 4 + a * 2 + b)] = int32_t(h.tap[a] * side_ + w.tap[b]);
            pos_weights_host_[size_t(row * 4 + a * 2 + b)] = h.weight[a] * w.weight[b];
          }
      }
      // Qwen3VLVisionRotaryEmbedding / Qwen2_5_VLVisionRotaryEmbedding: freqs = position_ids[..., None].float()
      // * inv_freq (float32), then cos/sin laid out as [row frequencies | column frequencies], the half that
      // rope() rotates with (Qwen2.5-VL permutes them with the rows: permute_input_for_window_attn).
      for (int64_t i = 0; i < quarter; i++) {
        const float row_angle = float(patch_row) * rope_inv_freq_[size_t(i)];
        const float col_angle = float(patch_col) * rope_inv_freq_[size_t(i)];
        cos_host_[size_t(row * half + i)] = float(std::cos(double(row_angle)));
        sin_host_[size_t(row * half + i)] = float(std::sin(double(row_angle)));
        cos_host_[size_t(row * half + quarter + i)] = float(std::cos(double(col_angle)));
        sin_host_[size_t(row * half + quarter + i)] = float(std::sin(double(col_angle)));
      }
    }
    // cu_seqlens: one segment per image (per frame); window order keeps each image's rows together
    segments_host_[k + 1] = int32_t(row);
    unit += units;
  }

  Tensor pixels = pixel_patches_.slice_rows(0, N);  // [N, C T P P]
  // The rows in processing order: as given, or gathered merge window by merge window into window order
  // (hidden_states[window_index] after the patch embedding, which is row-wise: the same as reordering its input).
  if (merger_window_side_ > 0) {
    std::vector<const float*> unit_rows(static_cast<size_t>(tokens_), nullptr);
    int64_t u = 0;
    for (const VisionInput* image : images)
      for (int64_t r = 0; r < image->rows(); r += merge) unit_rows[size_t(u++)] = image->pixel_values.data() + r * patch_values;
    const size_t unit_values = size_t(merge * patch_values);
    for (int64_t j = 0; j < tokens_; j++)
      std::copy(unit_rows[size_t(order_host_[size_t(j)])], unit_rows[size_t(order_host_[size_t(j)])] + unit_values,
                pixels_ordered_.data() + size_t(j) * unit_values);
  }
  if (pixels.dtype == DType::F32) {
    if (merger_window_side_ > 0) {
      check(backend_.copy_from_host(pixels_ordered_.data(), pixels));
    } else {
      int64_t at = 0;
      for (const VisionInput* image : images) {
        check(backend_.copy_from_host(image->pixel_values.data(), pixels.slice_rows(at, image->rows())));
        at += image->rows();
      }
    }
  } else {  // pixel_values.type(self.visual.dtype): rounded to the 16-bit activations on the host
    size_t at = 0;
    auto round = [&](float value) { pixels_16bit_[at++] = pixels.dtype == DType::BF16 ? float_to_bf16(value) : float_to_f16(value); };
    if (merger_window_side_ > 0) {
      for (size_t i = 0; i < size_t(N * patch_values); i++) round(pixels_ordered_[i]);
    } else {
      for (const VisionInput* image : images)
        for (float value : image->pixel_values) round(value);
    }
    check(backend_.copy_from_host(pixels_16bit_.data(), pixels));
  }
  if (traits.learned_positions) {
    check(backend_.copy_from_host(pos_indices_host_.data(), pos_indices_.slice_rows(0, N)));
    check(backend_.copy_from_host(pos_weights_host_.data(), pos_weights_.slice_rows(0, N)));
  }
  Tensor cos = rope_cos_.slice_rows(0, N), sin = rope_sin_.slice_rows(0, N);  // [N, head_dim / 2]
  check(backend_.copy_from_host(cos_host_.data(), cos));
  check(backend_.copy_from_host(sin_host_.data(), sin));
  Tensor segments = segments_.slice_rows(0, int64_t(images.size()) + 1);
  check(backend_.copy_from_host(segments_host_.data(), segments));
  Tensor window_segments, window_order;
  if (merger_window_side_ > 0) {
    window_segments = window_segments_.slice_rows(0, int64_t(windows) + 1);
    check(backend_.copy_from_host(window_segments_host_.data(), window_segments));
    window_order = window_order_.slice_rows(0, tokens_);
    check(backend_.copy_from_host(reverse_host_.data(), window_order));
  }

  // ---- the tower ----
  const int64_t vh = v.hidden_size;
  Tensor hidden = hidden_.slice_rows(0, N);      // [N, vh] the residual stream
  Tensor normed = normed_.slice_rows(0, N);      // [N, vh]
  Tensor qkv = qkv_.slice_rows(0, N);            // [N, 3 vh]
  Tensor q = qkv.slice_cols(0, vh);              // [N, vh]: reshape(N, 3, heads, head_dim) -> q | k | v
  Tensor k = qkv.slice_cols(vh, vh);
  Tensor val = qkv.slice_cols(2 * vh, vh);
  Tensor attn = attn_out_.slice_rows(0, N);      // [N, vh]
  Tensor mlp = mlp_.slice_rows(0, N);            // [N, vI]
  const int64_t vI = v.intermediate_size;

  // hidden_states = self.patch_embed(hidden_states)  (Qwen2.5-VL: no bias; rows already in window order, as
  // hidden_states = self.permute_input_for_window_attn(hidden_states, window_index, seq_len) leaves them)
  check(backend_.linear(pixels, weights_.patch_embed.weight, weights_.patch_embed.bias, hidden));
  if (traits.learned_positions) {
    // pos_embeds = (self.pos_embed(interp_indices) * interp_weights[:, :, None]).sum(1)
    check(backend_.embedding_bag(weights_.pos_embed, pos_indices_.slice_rows(0, N), pos_weights_.slice_rows(0, N),
                                 normed));
    // hidden_states = hidden_states + pos_embeds
    check(backend_.add(hidden, normed, hidden));
  }
  for (int64_t b = 0; b < v.depth; b++) {
    const VisionBlockWeights& w = weights_.blocks[size_t(b)];
    // self.attn(self.norm1(hidden_states), ...)
    norm(hidden, w.norm1, normed);
    // query_states, key_states, value_states = self.qkv(hidden_states).reshape(N, 3, heads, -1)...
    check(backend_.linear(normed, w.qkv, qkv));
    // apply_rotary_pos_emb_vision(query_states, key_states, cos, sin)
    // (one call: q and k are adjacent column blocks of qkv)                   qk [N, 2 vh]
    check(backend_.rope(qkv.slice_cols(0, 2 * vh), cos, sin, head_dim_));
    // non-causal attention within each image (cu_seqlens), scaling head_dim ** -0.5; Qwen2.5-VL:
    // cu_seqlens_now = cu_seqlens if layer_num in self.fullatt_block_indexes else cu_window_seqlens
    if (traits.full_attention(b))
      check(backend_.segment_attention(q, k, val, segments, longest, head_dim_, attention_scale_, attn));
    else
      check(backend_.segment_attention(q, k, val, window_segments, longest_window, head_dim_, attention_scale_, attn));
    // attn_output = self.proj(attn_output); hidden_states = hidden_states + attn_output
    check(backend_.linear(attn, w.proj, normed));
    check(backend_.add(hidden, normed, hidden));
    // hidden_states = hidden_states + self.mlp(self.norm2(hidden_states))
    norm(hidden, w.norm2, normed);
    if (traits.mlp == VisionMlp::swiglu) {
      // Qwen2_5_VLMLP: self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))   gate_up [N, 2 vI]
      Tensor gate_up = gate_up_.slice_rows(0, N);
      Tensor gate = gate_up.slice_cols(0, vI), up = gate_up.slice_cols(vI, vI);
      check(backend_.linear(normed, w.fc1, gate));
      check(backend_.linear(normed, w.up, up));
      if (block_silu_) check(backend_.silu_mul(gate, up, mlp));
      else check(backend_.gelu_mul(gate, up, block_gelu_, mlp));
    } else {
      // fc2(act(fc1(x)))
      check(backend_.linear(normed, w.fc1, mlp));
      check(backend_.gelu(mlp, block_gelu_, mlp));
    }
    check(backend_.linear(mlp, w.fc2, normed));
    check(backend_.add(hidden, normed, hidden));
    // if layer_num in self.deepstack_visual_indexes: deepstack_merger_list[index](hidden_states)
    for (size_t j = 0; j < v.deepstack_visual_indexes.size(); j++)
      if (v.deepstack_visual_indexes[j] == b) run_merger(weights_.deepstack[j], hidden, 1 + int64_t(j));
  }
  // merged_hidden_states = self.merger(hidden_states)
  run_merger(weights_.merger, hidden, 0);
  check(backend_.synchronize());
}

void VisionModel::run_merger(const PatchMergerWeights& merger, const Tensor& hidden, int64_t level) {
  using detail::vision::check;
  const int64_t merge = config_.vision.spatial_merge_size * config_.vision.spatial_merge_size;
  const int64_t N = hidden.rows, vh = hidden.cols;
  const int64_t tokens = N / merge, width = merge * vh;
  // x.view(-1, 4 vh): the 4 patches of a merge window are consecutive rows, so the view is a reshape
  auto shuffled = [&](const Tensor& t) { return Tensor::matrix(t.data, t.dtype, tokens, width); };
  Tensor normed = merger_in_.slice_rows(0, tokens);  // [N / 4, 4 vh]
  if (merger.norm_after_shuffle) {
    // self.norm(x.view(-1, self.hidden_size))
    norm(shuffled(hidden), merger.norm, normed);
  } else if (merger_window_side_ > 0) {
    // Qwen2.5-VL: merged_hidden_states = self.merger(hidden_states)[reverse_indices, :]. The merger is row-wise
    // over merge windows, so its input is put back in raster order first (one row of 4 vh per merge window),
    // then ln_q per patch in place: self.ln_q(x).view(-1, self.hidden_size)
    check(backend_.gather_rows(shuffled(hidden), window_order_.slice_rows(0, tokens), normed));
    const Tensor patches = Tensor::matrix(normed.data, normed.dtype, N, vh);
    norm(patches, merger.norm, patches);
  } else {
    // self.norm(x).view(-1, self.hidden_size): per patch, written as [N, vh] into the same rows
    norm(hidden, merger.norm, Tensor::matrix(normed.data, normed.dtype, N, vh));
  }
  // self.linear_fc2(self.act_fn(self.linear_fc1(x))), act_fn = nn.GELU() (erf)  (Qwen2.5-VL: mlp.2(GELU(mlp.0 x)))
  Tensor fc1_out = shuffled(attn_out_);  // [N / 4, 4 vh]
  check(backend_.linear(normed, merger.fc1, fc1_out));
  check(backend_.gelu(fc1_out, GeluApprox::none, fc1_out));
  const int64_t tokens_per_level = merged_.rows / levels_;
  Tensor out = merged_.slice_rows(level * tokens_per_level, tokens);  // [N / 4, out]
  check(backend_.linear(fc1_out, merger.fc2, out));
}

// Qwen2_5_VLRMSNorm(eps=1e-6) or nn.LayerNorm(eps=1e-6), as the family's traits say.
void VisionModel::norm(const Tensor& x, const LayerNormWeights& weights, const Tensor& out) {
  using detail::vision::check;
  if (config_.vision.traits.norm == VisionNorm::rms_norm) check(backend_.rms_norm(x, weights.weight, 1e-6f, out));
  else check(backend_.layer_norm(x, weights.weight, weights.bias, 1e-6f, out));
}
}  // namespace kvlite
