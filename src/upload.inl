// upload: a GPU engine's weights, from the checkpoint's mmap into the CUDA arena's weights region (Engine::open
// calls it once, before the first step), and the bytes a decode step reads of them. A part of its own so that
// the engine's step code and the one-time upload can be read and changed apart.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvlite {
namespace detail {
namespace engine {

// ---- weights on a GPU -------------------------------------------------------------------------------------
// Fills a CUDA arena's weights region from the mmap, in the order the model binds them: every tensor at a
// 256-byte boundary, copied in chunks of at most the plan's upload_chunk_bytes straight from the mapped file
// (pageable memory: no pinned buffer). Dense Linears (weight and bias) must be in the activation dtype for
// cuBLAS: when the checkpoint's dtype differs, each chunk is staged raw in the KV region (free until the first
// step) and the backend's copy converts it into place. Embedding tables and norm weights stay as stored (the
// ops read any float dtype); quantized Linears go through cuda::upload_quant_weight into the GPU's layout. The
// planner counts exactly this (weights_item with cuda_weight_slack, and repack_item).
class WeightUploader {
 public:
  WeightUploader(Backend& backend, const Arena& arena, uint64_t chunk_bytes)
      : backend_(backend), act_(backend.activation_dtype()), chunk_bytes_(std::max<uint64_t>(chunk_bytes, 256)) {
    const ArenaRegion* weights = arena.region("weights");
    const ArenaRegion* repack = arena.region("repack");
    const ArenaRegion* kv = arena.region("kv");
    if (!weights || !repack || !kv) fail(ErrorCode::internal, "the arena has no weights, repack or kv region");
    // The quantized Linears' GPU layout takes more than their bytes on disk: the plan's repack region, right
    // after the weights', holds the difference, so the two are filled as one span.
    if (repack->offset != align_up(weights->offset + weights->bytes, kPlanAlignment))
      fail(ErrorCode::internal, "the arena's repack region does not follow its weights region");
    next_ = arena.base() + weights->offset;
    begin_ = next_;
    end_ = arena.base() + repack->offset + repack->bytes;
    staging_ = arena.base() + kv->offset;
    staging_bytes_ = std::min(kv->bytes, chunk_bytes_);
  }

  // The share of the weights + repack span filled so far, in [0, 1]: load progress.
  double filled() const { return end_ > begin_ ? double(next_ - begin_) / double(end_ - begin_) : 1.0; }

  // A dense device copy of `host` (a view into the mmap) in `dtype`.
  Tensor tensor(const Tensor& host, DType dtype, const std::string& what) {
    if (host.data == nullptr) return host;  // an absent optional tensor (no bias)
    uint8_t* dst = take(dtype_bytes(dtype, uint64_t(host.elements())), what);
    fill(host, dtype, dst, what);
    return Tensor{dst, dtype, host.rows, host.cols, host.cols};
  }

  // One dense device tensor of `dtype` holding the rows of `hosts` (each [rows_i, cols], or all absent) one after
  // another: a fused Linear's weight or bias.
  Tensor stacked(const std::vector<Tensor>& hosts, DType dtype, const std::string& what) {
    if (hosts.empty() || hosts[0].data == nullptr) return Tensor{};
    int64_t rows = 0;
    for (const Tensor& host : hosts) rows += host.rows;
    uint8_t* dst = take(dtype_bytes(dtype, uint64_t(rows * hosts[0].cols)), what);
    uint8_t* next = dst;
    for (const Tensor& host : hosts) {
      fill(host, dtype, next, what);
      next += dtype_bytes(dtype, uint64_t(host.elements()));
    }
    return Tensor{dst, dtype, rows, hosts[0].cols, hosts[0].cols};
  }

  // `host` (a view into the mmap) converted to `dtype` into device memory at dst.
  void fill(const Tensor& host, DType dtype, uint8_t* dst, const std::string& what) {
    if (!host.contiguous())
      fail(ErrorCode::internal, format("uploading %s: the host view is not contiguous", what.c_str()));
    const uint64_t n = uint64_t(host.elements());
    const uint64_t source_bytes = uint64_t(host.element_bytes()), target_bytes = dtype_bytes(dtype, 1);
    const uint8_t* src = static_cast<const uint8_t*>(host.data);
    if (dtype == host.dtype) {
      for (uint64_t offset = 0; offset < n * source_bytes; offset += chunk_bytes_) {
        const uint64_t bytes = std::min(chunk_bytes_, n * source_bytes - offset);
        check(backend_.copy_from_host(src + offset, Tensor::matrix(dst + offset, DType::U8, 1, int64_t(bytes))));
      }
    } else {
      // Converting rows of kRowWidth elements (the copy kernel runs a block per row) and one shorter tail.
      constexpr uint64_t kRowWidth = 4096;
      const uint64_t stage_elements = std::max<uint64_t>(staging_bytes_ / source_bytes, 1);
      for (uint64_t offset = 0; offset < n;) {
        uint64_t count = std::min(stage_elements, n - offset);
        uint64_t rows = 1, cols = count;
        if (count >= kRowWidth) {
          rows = count / kRowWidth;
          cols = kRowWidth;
          count = rows * cols;
        }
        const Tensor staged = Tensor::matrix(staging_, host.dtype, int64_t(rows), int64_t(cols));
        check(backend_.copy_from_host(src + offset * source_bytes, staged));
        check(backend_.copy(staged, Tensor::matrix(dst + offset * target_bytes, dtype, int64_t(rows), int64_t(cols))));
        offset += count;
      }
    }
  }

  LinearWeights linear(const LinearWeights& host, const std::string& what) {
    LinearWeights device;
    if (host.quant) {
      // The GPU layout of int4 / int8 / fp8 weights is cuda::upload_quant_weight's (quant_gpu.hpp): its error, if
      // any, is the answer. int8 stays 1 byte a weight there and runs through dequantize + cuBLAS; W8A8's int8
      // activations are not emulated on the GPU, which runs such Linears as W8A16.
      const uint64_t bytes = cuda::quant_device_bytes(*host.quant);
      uint8_t* dst = take(bytes, what);
      Result<QuantWeight> uploaded = cuda::upload_quant_weight(backend_, *host.quant, dst, bytes);
      if (!uploaded)
        fail(uploaded.error().code, format("%s on the GPU: %s", what.c_str(), uploaded.error().message.c_str()));
      device.quant = std::make_shared<const QuantWeight>(std::move(*uploaded));
      return device;
    }
    device.weight = tensor(host.weight, act_, what + ".weight");
    device.bias = tensor(host.bias, act_, what + ".bias");
    return device;
  }

  // A LinearGroup (q|k|v, gate|up) as one device Linear when its parts fuse (linear_group_fuses), else part by part.
  LinearGroup linear_group(const LinearGroup& host, const std::vector<std::string>& whats) {
    std::string joined;
    for (const std::string& what : whats) joined += (joined.empty() ? "" : "+") + what;
    LinearGroup device;
    if (!linear_group_fuses(host)) {
      for (size_t i = 0; i < host.parts.size(); i++)
        device.parts.push_back(linear(host.parts[i], i < whats.size() ? whats[i] : joined));
      return device;
    }
    LinearWeights fused;
    if (host.parts[0].quant) {
      std::vector<const QuantWeight*> parts;
      for (const LinearWeights& part : host.parts) parts.push_back(part.quant.get());
      const uint64_t bytes = cuda::quant_device_bytes(parts);
      uint8_t* dst = take(bytes, joined);
      Result<QuantWeight> uploaded = cuda::upload_quant_weight(backend_, parts, dst, bytes);
      if (!uploaded)
        fail(uploaded.error().code, format("%s on the GPU: %s", joined.c_str(), uploaded.error().message.c_str()));
      fused.quant = std::make_shared<const QuantWeight>(std::move(*uploaded));
    } else {
      std::vector<Tensor> weights, biases;
      for (const LinearWeights& part : host.parts) {
        weights.push_back(part.weight);
        biases.push_back(part.bias);
      }
      fused.weight = stacked(weights, act_, joined + ".weight");
      fused.bias = stacked(biases, act_, joined + ".bias");
    }
    device.parts.push_back(std::move(fused));
    return device;
  }

  uint64_t remaining() const { return uint64_t(end_ - next_); }
  DType activation_dtype() const { return act_; }

 private:
  static void check(const Status& status) {
    if (!status) throw status.error();
  }
  uint8_t* take(uint64_t bytes, const std::string& what) {
    uint8_t* start = next_;
    const uint64_t misalignment = uint64_t(reinterpret_cast<uintptr_t>(start) % kPlanAlignment);
    if (misalignment != 0) start += kPlanAlignment - misalignment;
    if (start > end_ || bytes > uint64_t(end_ - start))
      fail(ErrorCode::internal,
           format("uploading %s (%s): the plan's weights region has only %s left; the planner and the uploader "
                  "disagree", what.c_str(), format_bytes(bytes).c_str(),
                  format_bytes(start > end_ ? 0 : uint64_t(end_ - start)).c_str()));
    next_ = start + bytes;
    return start;
  }

  Backend& backend_;
  DType act_;
  uint64_t chunk_bytes_;
  uint8_t* begin_ = nullptr;
  uint8_t* next_ = nullptr;
  uint8_t* end_ = nullptr;
  uint8_t* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
};

// The vision tower's weights (Qwen3-VL, Qwen2.5-VL) into the same span, after the text model's: Linears (the patch
// embedding's Conv3d kernel among them) in the activation dtype, the position table and norms as stored (absent
// tensors - Qwen2.5-VL's patch bias, position table, RMSNorm biases - stay absent).
VisionWeights upload_vision_weights(const VisionWeights& host, WeightUploader& upload) {
  auto norm = [&](const LayerNormWeights& h, const std::string& what) {
    return LayerNormWeights{upload.tensor(h.weight, h.weight.dtype, what + ".weight"),
                            upload.tensor(h.bias, h.bias.dtype, what + ".bias")};
  };
  auto merger = [&](const PatchMergerWeights& h, const std::string& what) {
    PatchMergerWeights d;
    d.norm = norm(h.norm, what + ".norm");
    d.fc1 = upload.linear(h.fc1, what + ".linear_fc1");
    d.fc2 = upload.linear(h.fc2, what + ".linear_fc2");
    d.norm_after_shuffle = h.norm_after_shuffle;
    return d;
  };
  VisionWeights device;
  device.patch_embed = upload.linear(host.patch_embed, "visual.patch_embed");
  device.pos_embed = upload.tensor(host.pos_embed, host.pos_embed.dtype, "visual.pos_embed");
  device.blocks.resize(host.blocks.size());
  for (size_t b = 0; b < host.blocks.size(); b++) {
    const VisionBlockWeights& h = host.blocks[b];
    VisionBlockWeights& d = device.blocks[b];
    const std::string block = format("visual.blocks.%zu.", b);
    d.norm1 = norm(h.norm1, block + "norm1");
    d.norm2 = norm(h.norm2, block + "norm2");
    d.qkv = upload.linear(h.qkv, block + "attn.qkv");
    d.proj = upload.linear(h.proj, block + "attn.proj");
    d.fc1 = upload.linear(h.fc1, block + "mlp.fc1");  // linear_fc1 | gate_proj
    if (h.up.weight.data || h.up.quant) d.up = upload.linear(h.up, block + "mlp.up_proj");  // SwiGLU only
    d.fc2 = upload.linear(h.fc2, block + "mlp.fc2");  // linear_fc2 | down_proj
  }
  device.merger = merger(host.merger, "visual.merger");
  for (size_t i = 0; i < host.deepstack.size(); i++)
    device.deepstack.push_back(merger(host.deepstack[i], format("visual.deepstack_merger_list.%zu", i)));
  return device;
}

// host_embeddings (PlanOptions::host_embeddings, an untied table): embed_tokens stays the mmap's host view, looked
// up on the host each step (the plan's weights row leaves it out).
TextModelWeights upload_text_weights(const TextModelWeights& host, WeightUploader& upload,
                                     const std::function<void(uint64_t)>& progress, uint64_t host_bytes,
                                     bool host_embeddings = false) {
  // Progress in the checkpoint's bytes: the span's share filled, of the bytes on disk (after each layer).
  auto report = [&] { progress(uint64_t(std::min(1.0, upload.filled()) * double(host_bytes))); };
  const DType act = upload.activation_dtype();
  TextModelWeights device;
  const bool tied = !host.lm_head.quant && host.lm_head.weight.data == host.embed_tokens.data;
  if (host_embeddings && tied)
    fail(ErrorCode::internal, "--host-embeddings with a tied embedding table: the plan refuses it");
  if (host_embeddings) {
    device.embed_tokens = host.embed_tokens;
    device.embed_tokens_on_host = true;
  } else {
    device.embed_tokens = upload.tensor(host.embed_tokens, host.embed_tokens.dtype, "embed_tokens");
  }
  device.layers.resize(host.layers.size());
  for (size_t l = 0; l < host.layers.size(); l++) {
    const DecoderLayerWeights& h = host.layers[l];
    DecoderLayerWeights& d = device.layers[l];
    const std::string layer = format("layers.%zu.", l);
    d.input_layernorm = upload.tensor(h.input_layernorm, h.input_layernorm.dtype, layer + "input_layernorm");
    d.qkv_proj = upload.linear_group(
        h.qkv_proj, {layer + "self_attn.q_proj", layer + "self_attn.k_proj", layer + "self_attn.v_proj"});
    d.q_norm = upload.tensor(h.q_norm, h.q_norm.dtype, layer + "self_attn.q_norm");
    d.k_norm = upload.tensor(h.k_norm, h.k_norm.dtype, layer + "self_attn.k_norm");
    d.o_proj = upload.linear(h.o_proj, layer + "self_attn.o_proj");
    d.attention_output_norm =
        upload.tensor(h.attention_output_norm, h.attention_output_norm.dtype, layer + "attention_output_norm");
    d.post_attention_layernorm =
        upload.tensor(h.post_attention_layernorm, h.post_attention_layernorm.dtype, layer + "post_attention_layernorm");
    d.mlp_output_norm = upload.tensor(h.mlp_output_norm, h.mlp_output_norm.dtype, layer + "mlp_output_norm");
    d.gate_up_proj = upload.linear_group(h.gate_up_proj, {layer + "mlp.gate_proj", layer + "mlp.up_proj"});
    d.down_proj = upload.linear(h.down_proj, layer + "mlp.down_proj");
    report();
  }
  device.norm = upload.tensor(host.norm, host.norm.dtype, "norm");
  if (tied && device.embed_tokens.dtype == act) {
    device.lm_head.weight = device.embed_tokens;  // one table serves both, as on the host
  } else if (tied) {
    device.lm_head.weight = upload.tensor(host.embed_tokens, act, "lm_head (tied, converted)");
  } else {
    device.lm_head = upload.linear(host.lm_head, "lm_head");
  }
  return device;
}

// The bytes of a quantized Linear as the checkpoint stores them (what the CPU reads from the mmap).
uint64_t checkpoint_bytes(const QuantWeight& w) {
  const uint64_t n = uint64_t(w.out_features), k = uint64_t(w.in_features);
  uint64_t bytes = w.format == WeightFormat::int4 ? n * uint64_t(w.packed_cols) * 4 : n * k;
  bytes += dtype_bytes(w.scale_dtype, uint64_t(w.scale_rows * w.scale_cols));
  if (w.zero_points)  // int4: packed 8 a word along N; int8: one byte each
    bytes += w.format == WeightFormat::int8 ? n * uint64_t(w.scale_cols) : ((n + 7) / 8) * uint64_t(w.scale_cols) * 4;
  if (w.g_idx) bytes += k * 4;
  if (w.bias) bytes += dtype_bytes(w.bias_dtype, n);
  return bytes;
}

// Bytes one decode step reads of `weights`: every Linear and norm, and the lm_head (EngineInfo). Quantized
// Linears in the GPU's layout when on_device, as stored otherwise.
uint64_t decode_weight_bytes(const TextModelWeights& weights, bool on_device) {
  auto bytes = [](const Tensor& t) { return t.data ? dtype_bytes(t.dtype, uint64_t(t.elements())) : 0; };
  auto linear = [&](const LinearWeights& l) {
    if (!l.quant) return bytes(l.weight) + bytes(l.bias);
    return on_device ? cuda::quant_device_bytes(*l.quant) : checkpoint_bytes(*l.quant);
  };
  auto group = [&](const LinearGroup& g) {
    uint64_t sum = 0;
    for (const LinearWeights& part : g.parts) sum += linear(part);
    return sum;
  };
  uint64_t total = bytes(weights.norm) + linear(weights.lm_head);
  for (const DecoderLayerWeights& w : weights.layers)
    total += bytes(w.input_layernorm) + bytes(w.post_attention_layernorm) + bytes(w.q_norm) + bytes(w.k_norm) +
             bytes(w.attention_output_norm) + bytes(w.mlp_output_norm) + group(w.qkv_proj) + linear(w.o_proj) +
             group(w.gate_up_proj) + linear(w.down_proj);
  return total;
}

}  // namespace engine
}  // namespace detail
}  // namespace kvlite
