// backend: the validation every backend shares, and the rotary-table helpers.
#include <chrono>
#include <cmath>
#include <cstring>

namespace kvlite {

const char* op_name(Op op) {
  switch (op) {
    case Op::gather_rows: return "gather_rows";
    case Op::rms_norm: return "rms_norm";
    case Op::add_rms_norm: return "add_rms_norm";
    case Op::rope: return "rope";
    case Op::linear: return "linear";
    case Op::quant_linear: return "quant_linear";
    case Op::silu_mul: return "silu_mul";
    case Op::add: return "add";
    case Op::copy: return "copy";
    case Op::kv_write: return "kv_write";
    case Op::attention: return "attention";
    case Op::embedding_bag: return "embedding_bag";
    case Op::layer_norm: return "layer_norm";
    case Op::gelu: return "gelu";
    case Op::segment_attention: return "segment_attention";
    case Op::rope_kv_write: return "rope_kv_write";
    case Op::gelu_mul: return "gelu_mul";
    case Op::scale: return "scale";
    case Op::soft_cap: return "soft_cap";
  }
  return "?";
}

namespace detail {

// "[3, 64] F32" (plus the stride when rows are not packed).
inline std::string describe(const Tensor& t) {
  std::string text = format("[%lld, %lld] %s", (long long)t.rows, (long long)t.cols, dtype_name(t.dtype));
  if (t.rows > 1 && t.row_stride != t.cols) text += format(" (row stride %lld)", (long long)t.row_stride);
  return text;
}

// Checks what every tensor argument must satisfy; `op` and `name` make the message.
inline void check_view(const char* op, const char* name, const Tensor& t) {
  if (t.rows < 0 || t.cols < 0)
    fail(ErrorCode::invalid_argument, format("%s: %s has a negative shape %s", op, name, describe(t).c_str()));
  if (dtype_bits(t.dtype) < 8)
    fail(ErrorCode::invalid_argument,
         format("%s: %s has dtype %s, which packs several elements per byte; views need whole-byte elements",
                op, name, dtype_name(t.dtype)));
  if (t.rows > 1 && t.row_stride < t.cols)
    fail(ErrorCode::invalid_argument,
         format("%s: %s is %s with row stride %lld, smaller than its %lld columns (rows would overlap)", op, name,
                describe(t).c_str(), (long long)t.row_stride, (long long)t.cols));
  if (t.elements() > 0 && t.data == nullptr)
    fail(ErrorCode::invalid_argument, format("%s: %s is %s but its data pointer is null", op, name, describe(t).c_str()));
}

inline void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  check_view(op, name, t);
  if (t.dtype != dtype)
    fail(ErrorCode::invalid_argument, format("%s: %s is %s; it must be %s", op, name, describe(t).c_str(), dtype_name(dtype)));
}

inline void check_shape(const char* op, const char* name, const Tensor& t, int64_t rows, int64_t cols) {
  if (t.rows != rows || t.cols != cols)
    fail(ErrorCode::invalid_argument,
         format("%s: %s is %s; it must be [%lld, %lld]", op, name, describe(t).c_str(), (long long)rows, (long long)cols));
}

// A contiguous vector of n elements of `dtype`, [1, n] or [n, 1].
inline void check_vector(const char* op, const char* name, const Tensor& t, int64_t n, DType dtype) {
  check_dtype(op, name, t, dtype);
  if ((t.rows != 1 && t.cols != 1) || t.elements() != n || !t.contiguous())
    fail(ErrorCode::invalid_argument,
         format("%s: %s is %s; it must be a contiguous vector of %lld elements ([1, %lld] or [%lld, 1])", op, name,
                describe(t).c_str(), (long long)n, (long long)n, (long long)n));
}

inline void check_supported(const Backend& backend, Op op, DType dtype, const char* operand) {
  if (!backend.supports(op, dtype))
    fail(ErrorCode::unsupported, format("%s: the %s backend does not support %s %s", op_name(op),
                                        backend.name().c_str(), operand, dtype_name(dtype)));
}

// Two views overlap when they share a byte. Views with the same row stride whose rows do not wrap (the column
// halves of one fused buffer: gate and up of gate_up, q / k / v of qkv) interleave without touching: for them
// the test is exact, on rows and columns; otherwise it is conservative, on the byte spans.
inline bool views_overlap(const Tensor& a, const Tensor& b) {
  if (a.elements() == 0 || b.elements() == 0) return false;
  auto span = [](const Tensor& t) {
    const uint8_t* begin = static_cast<const uint8_t*>(t.data);
    return std::make_pair(begin, begin + ((t.rows - 1) * t.row_stride + t.cols) * t.element_bytes());
  };
  auto sa = span(a), sb = span(b);
  if (!(sa.first < sb.second && sb.first < sa.second)) return false;
  const int64_t stride_a = a.rows > 1 ? a.row_stride * a.element_bytes() : 0;
  const int64_t stride_b = b.rows > 1 ? b.row_stride * b.element_bytes() : 0;
  const int64_t stride = std::max(stride_a, stride_b);
  if (stride == 0 || (stride_a != 0 && stride_b != 0 && stride_a != stride_b)) return true;
  // Both as (first row, first byte in the row, bytes per row) in rows of `stride` bytes from the lower start.
  const uint8_t* base = std::min(sa.first, sb.first);
  struct Rect { int64_t row, column, width, rows; };
  auto rect = [&](const Tensor& t, const std::pair<const uint8_t*, const uint8_t*>& s) {
    const int64_t offset = int64_t(s.first - base);
    return Rect{offset / stride, offset % stride, t.cols * t.element_bytes(), t.rows};
  };
  const Rect ra = rect(a, sa), rb = rect(b, sb);
  if (ra.column + ra.width > stride || rb.column + rb.width > stride) return true;  // rows wrap: the spans decide
  const bool rows_meet = ra.row < rb.row + rb.rows && rb.row < ra.row + ra.rows;
  const bool columns_meet = ra.column < rb.column + rb.width && rb.column < ra.column + ra.width;
  return rows_meet && columns_meet;
}

inline bool same_view(const Tensor& a, const Tensor& b) {
  return a.data == b.data && a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols &&
         (a.rows <= 1 || a.row_stride == b.row_stride);
}

// `out` may be `input` itself, never a partial overlap of it.
inline void check_alias(const char* op, const char* out_name, const Tensor& out, const char* in_name,
                        const Tensor& in, bool may_be_same) {
  if (views_overlap(out, in) && !(may_be_same && same_view(out, in)))
    fail(ErrorCode::invalid_argument,
         format("%s: %s overlaps %s; %s", op, out_name, in_name,
                may_be_same ? "it may be the same view or a separate buffer" : "it must be a separate buffer"));
}

inline void check_kv_cache(const char* op, const KVCacheView& cache, int64_t layer) {
  const KVPageLayout& l = cache.layout;
  if (l.layers <= 0 || l.page_tokens <= 0 || l.kv_heads <= 0 || l.head_dim <= 0 || cache.num_pages <= 0)
    fail(ErrorCode::invalid_argument,
         format("%s: the KV cache layout is empty or negative (layers %lld, page_tokens %lld, kv_heads %lld, "
                "head_dim %lld, pages %lld)", op, (long long)l.layers, (long long)l.page_tokens,
                (long long)l.kv_heads, (long long)l.head_dim, (long long)cache.num_pages));
  if (cache.pages == nullptr) fail(ErrorCode::invalid_argument, format("%s: the KV cache's pages pointer is null", op));
  if (layer < 0 || layer >= l.layers)
    fail(ErrorCode::invalid_argument,
         format("%s: layer %lld is outside the KV cache's %lld layers", op, (long long)layer, (long long)l.layers));
  if ((cache.k_scales == nullptr) != (cache.v_scales == nullptr))
    fail(ErrorCode::invalid_argument, format("%s: the KV cache has K scales or V scales, not both", op));
}

}  // namespace detail

template <class Run>
void Backend::run_op(Op op, Run&& run) {
  if (!op_timing_) {
    run();
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  run();
  impl_synchronize();
  OpTime& time = op_times_[size_t(op)];
  time.calls++;
  time.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

Status Backend::copy_from_host(const void* src, const Tensor& dst) {
  return detail::guard([&] {
    detail::check_view("copy_from_host", "dst", dst);
    if (dst.elements() > 0 && src == nullptr)
      detail::fail(ErrorCode::invalid_argument, "copy_from_host: the host source pointer is null");
    impl_copy_from_host(src, dst);
  });
}

Status Backend::copy_to_host(const Tensor& src, void* dst) {
  return detail::guard([&] {
    detail::check_view("copy_to_host", "src", src);
    if (src.elements() > 0 && dst == nullptr)
      detail::fail(ErrorCode::invalid_argument, "copy_to_host: the host destination pointer is null");
    impl_copy_to_host(src, dst);
  });
}

Status Backend::synchronize() {
  return detail::guard([&] { impl_synchronize(); });
}

Status Backend::gather_rows(const Tensor& table, const Tensor& ids, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "gather_rows";
    detail::check_view(op, "table", table);
    detail::check_supported(*this, Op::gather_rows, table.dtype, "table dtype");
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_vector(op, "ids", ids, ids.elements(), DType::I32);
    detail::check_shape(op, "out", out, ids.elements(), table.cols);
    detail::check_alias(op, "out", out, "table", table, false);
    run_op(Op::gather_rows, [&] { impl_gather_rows(table, ids, out); });
  });
}

Status Backend::gather_host_rows(const Tensor& table, const int32_t* ids, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "gather_host_rows";
    detail::check_view(op, "table", table);
    detail::check_supported(*this, Op::gather_rows, table.dtype, "table dtype");
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, out.rows, table.cols);
    detail::check_alias(op, "out", out, "table", table, false);
    if (out.rows > 0 && ids == nullptr) detail::fail(ErrorCode::invalid_argument, "gather_host_rows: ids is null");
    if (out.rows > 0 && table.data == nullptr)
      detail::fail(ErrorCode::invalid_argument, "gather_host_rows: the host table is null");
    for (int64_t t = 0; t < out.rows; t++)
      if (ids[t] < 0 || ids[t] >= table.rows)
        detail::fail(ErrorCode::invalid_argument,
                     detail::format("gather_host_rows: ids[%lld] = %d is outside the table's %lld rows", (long long)t,
                                    ids[t], (long long)table.rows));
    run_op(Op::gather_rows, [&] { impl_gather_host_rows(table, ids, out); });
  });
}

namespace detail {
void gather_host_rows_into(const Tensor& table, const int32_t* ids, int64_t count, DType dtype, void* dst) {
  const int64_t cols = table.cols;
  const size_t in_bytes = size_t(dtype_bytes(table.dtype, 1)), out_bytes = size_t(dtype_bytes(dtype, 1));
  const uint8_t* base = static_cast<const uint8_t*>(table.data);
  uint8_t* out = static_cast<uint8_t*>(dst);
  if (table.dtype != DType::F32 && table.dtype != DType::BF16 && table.dtype != DType::F16)
    fail(ErrorCode::internal, format("gather_host_rows: table dtype %s", dtype_name(table.dtype)));
  for (int64_t t = 0; t < count; t++) {
    const uint8_t* row = base + size_t(ids[t]) * size_t(table.row_stride) * in_bytes;
    uint8_t* to = out + size_t(t) * size_t(cols) * out_bytes;
    if (dtype == table.dtype) {
      std::memcpy(to, row, size_t(cols) * in_bytes);
      continue;
    }
    for (int64_t c = 0; c < cols; c++) {
      const float v = scale_at(row, table.dtype, c);  // F32 / BF16 / F16 widened exactly
      if (dtype == DType::F32) {
        std::memcpy(to + c * 4, &v, 4);
      } else {
        const uint16_t h = dtype == DType::BF16 ? float_to_bf16(v) : float_to_f16(v);
        std::memcpy(to + c * 2, &h, 2);
      }
    }
  }
}
}  // namespace detail

Status Backend::rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "rms_norm";
    detail::check_dtype(op, "x", x, activation_dtype());
    detail::check_view(op, "weight", weight);
    detail::check_supported(*this, Op::rms_norm, weight.dtype, "weight dtype");
    int64_t group = weight.elements();
    detail::check_vector(op, "weight", weight, group, weight.dtype);
    if (group == 0 || x.cols % group != 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("rms_norm: x is %s but weight has %lld elements; x's columns must be a multiple "
                                  "of the weight's length (the row, or head_dim for per-head norms)",
                                  detail::describe(x).c_str(), (long long)group));
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, x.cols);
    detail::check_alias(op, "out", out, "x", x, true);
    if (!(eps >= 0.0f)) detail::fail(ErrorCode::invalid_argument, detail::format("rms_norm: eps %g must be >= 0", eps));
    run_op(Op::rms_norm, [&] { impl_rms_norm(x, weight, eps, out); });
  });
}

Status Backend::add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, float eps,
                             const Tensor& out) {
  return detail::guard([&] {
    const char* op = "add_rms_norm";
    detail::check_dtype(op, "x", x, activation_dtype());
    detail::check_dtype(op, "residual", residual, activation_dtype());
    detail::check_shape(op, "residual", residual, x.rows, x.cols);
    detail::check_view(op, "weight", weight);
    detail::check_supported(*this, Op::add_rms_norm, weight.dtype, "weight dtype");
    detail::check_vector(op, "weight", weight, x.cols, weight.dtype);
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, x.cols);
    detail::check_alias(op, "residual", residual, "x", x, false);
    detail::check_alias(op, "out", out, "x", x, true);
    detail::check_alias(op, "out", out, "residual", residual, false);
    if (!(eps >= 0.0f))
      detail::fail(ErrorCode::invalid_argument, detail::format("add_rms_norm: eps %g must be >= 0", eps));
    run_op(Op::add_rms_norm, [&] { impl_add_rms_norm(x, residual, weight, eps, out); });
  });
}

namespace detail {
inline void check_rope(const Backend& backend, const char* op, const Tensor& x, const Tensor& cos, const Tensor& sin,
                       int64_t head_dim) {
  check_dtype(op, "x", x, backend.activation_dtype());
  check_supported(backend, Op::rope, x.dtype, "x dtype");
  check_dtype(op, "cos", cos, DType::F32);
  check_dtype(op, "sin", sin, DType::F32);
  if (head_dim <= 0 || x.cols % head_dim != 0)
    fail(ErrorCode::invalid_argument, format("%s: x is %s, not a whole number of heads of head_dim %lld", op,
                                             describe(x).c_str(), (long long)head_dim));
  if (cos.cols == 0 || 2 * cos.cols > head_dim)
    fail(ErrorCode::invalid_argument,
         format("%s: cos is %s; it needs 1 .. head_dim/2 = %lld columns (one per frequency)", op,
                describe(cos).c_str(), (long long)(head_dim / 2)));
  check_shape(op, "cos", cos, x.rows, cos.cols);
  check_shape(op, "sin", sin, x.rows, cos.cols);
}
inline void check_kv_write(const Backend& backend, const char* op, const KVCacheView& cache, int64_t layer,
                           const Tensor& k, const Tensor& v, const Tensor& slots) {
  check_kv_cache(op, cache, layer);
  check_supported(backend, Op::kv_write, cache.dtype, "KV dtype");
  const int64_t width = cache.layout.kv_heads * cache.layout.head_dim;
  check_dtype(op, "k", k, backend.activation_dtype());
  check_dtype(op, "v", v, backend.activation_dtype());
  check_shape(op, "k", k, k.rows, width);
  check_shape(op, "v", v, k.rows, width);
  check_vector(op, "slots", slots, k.rows, DType::I32);
}
}  // namespace detail

Status Backend::rope_kv_write(const Tensor& qk, const Tensor& cos, const Tensor& sin, int64_t head_dim,
                              const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v,
                              const Tensor& slots) {
  return detail::guard([&] {
    const char* op = "rope_kv_write";
    detail::check_rope(*this, op, qk, cos, sin, head_dim);
    detail::check_kv_write(*this, op, cache, layer, k, v, slots);
    // k: qk's last k.cols columns, row for row (the keys the rope rotates are the ones stored)
    const int64_t element = dtype_bytes(qk.dtype, 1);
    const bool last_columns = k.rows == qk.rows && k.cols <= qk.cols && k.row_stride == qk.row_stride &&
                              static_cast<const char*>(k.data) ==
                                  static_cast<const char*>(qk.data) + (qk.cols - k.cols) * element;
    if (!last_columns || cache.layout.head_dim != head_dim)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("%s: k (%s) must be the last %lld columns of qk (%s), of the cache's head_dim %lld "
                                  "(rope's is %lld)", op, detail::describe(k).c_str(), (long long)k.cols,
                                  detail::describe(qk).c_str(), (long long)cache.layout.head_dim,
                                  (long long)head_dim));
    run_op(Op::rope_kv_write, [&] { impl_rope_kv_write(qk, cos, sin, head_dim, cache, layer, k, v, slots); });
  });
}

Status Backend::rope(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim) {
  return detail::guard([&] {
    detail::check_rope(*this, "rope", x, cos, sin, head_dim);
    run_op(Op::rope, [&] { impl_rope(x, cos, sin, head_dim); });
  });
}

Status Backend::linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "linear";
    detail::check_dtype(op, "x", x, activation_dtype());
    detail::check_view(op, "weight", weight);
    detail::check_supported(*this, Op::linear, weight.dtype, "weight dtype");
    if (weight.cols != x.cols)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("linear: weight is %s but x is %s; weight must be [out_features, in_features] "
                                  "with in_features = x's %lld columns",
                                  detail::describe(weight).c_str(), detail::describe(x).c_str(), (long long)x.cols));
    if (bias.data != nullptr) {
      detail::check_view(op, "bias", bias);
      detail::check_supported(*this, Op::linear, bias.dtype, "bias dtype");
      detail::check_vector(op, "bias", bias, weight.rows, bias.dtype);
    }
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, weight.rows);
    detail::check_alias(op, "out", out, "x", x, false);
    detail::check_alias(op, "out", out, "weight", weight, false);
    run_op(Op::linear, [&] { impl_linear(x, weight, bias, out); });
  });
}

Status Backend::quant_linear(const Tensor& x, const QuantWeight& weight, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "quant_linear";
    detail::check_dtype(op, "x", x, activation_dtype());
    if (weight.format != WeightFormat::int4 && weight.format != WeightFormat::fp8 && weight.format != WeightFormat::int8)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quant_linear: %s is %s; quant_linear runs int4, int8 and fp8 weights",
                                  weight.name.c_str(), weight_format_name(weight.format)));
    detail::check_supported(*this, Op::quant_linear,
                            weight.format == WeightFormat::int4   ? DType::I32
                            : weight.format == WeightFormat::int8 ? DType::I8
                                                                  : DType::F8_E4M3,
                            "weight dtype");
    const QuantLayout wanted = kind() == BackendKind::cuda ? QuantLayout::cuda_tiles : QuantLayout::checkpoint;
    if (weight.layout != wanted)
      detail::fail(ErrorCode::invalid_argument,
                   wanted == QuantLayout::cuda_tiles
                       ? detail::format("quant_linear: %s is the checkpoint's host view; upload it with "
                                        "cuda::upload_quant_weight for the CUDA backend", weight.name.c_str())
                       : detail::format("quant_linear: %s was repacked for the CUDA backend (cuda::upload_quant_weight); "
                                        "this backend reads the checkpoint's view", weight.name.c_str()));
    if (weight.in_features != x.cols)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("quant_linear: %s is [out %lld, in %lld] but x is %s; in_features must be x's %lld "
                                  "columns", weight.name.c_str(), (long long)weight.out_features,
                                  (long long)weight.in_features, detail::describe(x).c_str(), (long long)x.cols));
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, weight.out_features);
    detail::check_alias(op, "out", out, "x", x, false);
    run_op(Op::quant_linear, [&] { impl_quant_linear(x, weight, out); });
  });
}

bool linear_group_fuses(const LinearGroup& group) {
  if (group.parts.size() < 2) return false;
  const bool quantized = group.parts[0].quant != nullptr, biased = group.parts[0].bias.data != nullptr;
  std::vector<const QuantWeight*> quant;
  for (const LinearWeights& part : group.parts) {
    if ((part.quant != nullptr) != quantized || part.in_features() != group.parts[0].in_features()) return false;
    if (quantized) quant.push_back(part.quant.get());
    else if ((part.bias.data != nullptr) != biased) return false;
  }
  return !quantized || cuda::quant_fusion_refusal(quant).empty();
}

bool linear_group_fuses(const std::vector<const LinearDesc*>& parts) {
  if (parts.size() < 2) return false;
  const bool quantized = parts[0]->format != WeightFormat::dense, biased = parts[0]->has_bias;
  for (const LinearDesc* part : parts) {
    if ((part->format != WeightFormat::dense) != quantized || part->in_features != parts[0]->in_features) return false;
    if (!quantized && part->has_bias != biased) return false;
  }
  return !quantized || cuda::quant_fusion_refusal(parts).empty();
}

Status Backend::linear(const Tensor& x, const LinearGroup& group, const Tensor& out) {
  return detail::guard([&] {
    if (group.parts.empty()) detail::fail(ErrorCode::invalid_argument, "linear: a LinearGroup with no parts");
    detail::check_shape("linear", "out", out, x.rows, group.out_features());
    int64_t column = 0;
    for (const LinearWeights& part : group.parts) {
      const Status done = linear(x, part, out.slice_cols(column, part.out_features()));
      if (!done.ok()) throw done.error();
      column += part.out_features();
    }
  });
}

Status Backend::silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "silu_mul";
    detail::check_dtype(op, "gate", gate, activation_dtype());
    detail::check_supported(*this, Op::silu_mul, gate.dtype, "activation dtype");
    detail::check_dtype(op, "up", up, activation_dtype());
    detail::check_shape(op, "up", up, gate.rows, gate.cols);
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, gate.rows, gate.cols);
    detail::check_alias(op, "out", out, "gate", gate, true);
    detail::check_alias(op, "out", out, "up", up, true);
    run_op(Op::silu_mul, [&] { impl_silu_mul(gate, up, out); });
  });
}

Status Backend::gelu_mul(const Tensor& gate, const Tensor& up, GeluApprox approx, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "gelu_mul";
    detail::check_dtype(op, "gate", gate, activation_dtype());
    detail::check_supported(*this, Op::gelu_mul, gate.dtype, "activation dtype");
    detail::check_dtype(op, "up", up, activation_dtype());
    detail::check_shape(op, "up", up, gate.rows, gate.cols);
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, gate.rows, gate.cols);
    detail::check_alias(op, "out", out, "gate", gate, true);
    detail::check_alias(op, "out", out, "up", up, true);
    run_op(Op::gelu_mul, [&] { impl_gelu_mul(gate, up, approx, out); });
  });
}

Status Backend::scale(const Tensor& x, float factor, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "scale";
    detail::check_dtype(op, "x", x, activation_dtype());
    detail::check_supported(*this, Op::scale, x.dtype, "activation dtype");
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, x.cols);
    detail::check_alias(op, "out", out, "x", x, true);
    if (!std::isfinite(factor))
      detail::fail(ErrorCode::invalid_argument, detail::format("scale: factor %g must be finite", factor));
    run_op(Op::scale, [&] { impl_scale(x, factor, out); });
  });
}

Status Backend::soft_cap(const Tensor& x, float cap, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "soft_cap";
    detail::check_dtype(op, "x", x, activation_dtype());
    detail::check_supported(*this, Op::soft_cap, x.dtype, "activation dtype");
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, x.cols);
    detail::check_alias(op, "out", out, "x", x, true);
    if (!(cap > 0.0f) || !std::isfinite(cap))
      detail::fail(ErrorCode::invalid_argument, detail::format("soft_cap: cap %g must be positive and finite", cap));
    run_op(Op::soft_cap, [&] { impl_soft_cap(x, cap, out); });
  });
}

Status Backend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "add";
    detail::check_dtype(op, "a", a, activation_dtype());
    detail::check_supported(*this, Op::add, a.dtype, "activation dtype");
    detail::check_dtype(op, "b", b, activation_dtype());
    detail::check_shape(op, "b", b, a.rows, a.cols);
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, a.rows, a.cols);
    detail::check_alias(op, "out", out, "a", a, true);
    detail::check_alias(op, "out", out, "b", b, true);
    run_op(Op::add, [&] { impl_add(a, b, out); });
  });
}

Status Backend::copy(const Tensor& src, const Tensor& dst) {
  return detail::guard([&] {
    const char* op = "copy";
    detail::check_view(op, "src", src);
    detail::check_view(op, "dst", dst);
    detail::check_supported(*this, Op::copy, src.dtype, "source dtype");
    detail::check_supported(*this, Op::copy, dst.dtype, "destination dtype");
    detail::check_shape(op, "dst", dst, src.rows, src.cols);
    detail::check_alias(op, "dst", dst, "src", src, false);
    run_op(Op::copy, [&] { impl_copy(src, dst); });
  });
}

Status Backend::embedding_bag(const Tensor& table, const Tensor& indices, const Tensor& weights,
                              const Tensor& out) {
  return detail::guard([&] {
    const char* op = "embedding_bag";
    detail::check_view(op, "table", table);
    detail::check_supported(*this, Op::embedding_bag, table.dtype, "table dtype");
    detail::check_dtype(op, "indices", indices, DType::I32);
    detail::check_dtype(op, "weights", weights, DType::F32);
    detail::check_shape(op, "weights", weights, indices.rows, indices.cols);
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, indices.rows, table.cols);
    detail::check_alias(op, "out", out, "table", table, false);
    detail::check_alias(op, "out", out, "weights", weights, false);
    run_op(Op::embedding_bag, [&] { impl_embedding_bag(table, indices, weights, out); });
  });
}

Status Backend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "layer_norm";
    detail::check_dtype(op, "x", x, activation_dtype());
    detail::check_view(op, "weight", weight);
    detail::check_supported(*this, Op::layer_norm, weight.dtype, "weight dtype");
    detail::check_vector(op, "weight", weight, x.cols, weight.dtype);
    detail::check_vector(op, "bias", bias, x.cols, weight.dtype);
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, x.cols);
    detail::check_alias(op, "out", out, "x", x, true);
    if (!(eps >= 0.0f)) detail::fail(ErrorCode::invalid_argument, detail::format("layer_norm: eps %g must be >= 0", eps));
    run_op(Op::layer_norm, [&] { impl_layer_norm(x, weight, bias, eps, out); });
  });
}

Status Backend::gelu(const Tensor& x, GeluApprox approx, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "gelu";
    detail::check_dtype(op, "x", x, activation_dtype());
    detail::check_supported(*this, Op::gelu, x.dtype, "activation dtype");
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, x.rows, x.cols);
    detail::check_alias(op, "out", out, "x", x, true);
    if (approx != GeluApprox::none && approx != GeluApprox::tanh)
      detail::fail(ErrorCode::invalid_argument, detail::format("gelu: unknown approximation %d", int(approx)));
    run_op(Op::gelu, [&] { impl_gelu(x, approx, out); });
  });
}

Status Backend::segment_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_starts,
                                  int64_t max_segment, int64_t head_dim, float scale, const Tensor& out) {
  return detail::guard([&] {
    const char* op = "segment_attention";
    detail::check_dtype(op, "q", q, activation_dtype());
    detail::check_supported(*this, Op::segment_attention, q.dtype, "activation dtype");
    detail::check_dtype(op, "k", k, activation_dtype());
    detail::check_dtype(op, "v", v, activation_dtype());
    if (head_dim <= 0 || q.cols == 0 || q.cols % head_dim != 0 || k.cols == 0 || k.cols % head_dim != 0 ||
        (q.cols / head_dim) % (k.cols / head_dim) != 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("segment_attention: q is %s and k is %s; with head_dim %lld they must hold whole "
                                  "heads, the query heads a multiple of the KV heads",
                                  detail::describe(q).c_str(), detail::describe(k).c_str(), (long long)head_dim));
    detail::check_shape(op, "k", k, q.rows, k.cols);
    detail::check_shape(op, "v", v, q.rows, k.cols);
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, q.rows, q.cols);
    detail::check_alias(op, "out", out, "q", q, false);
    detail::check_alias(op, "out", out, "k", k, false);
    detail::check_alias(op, "out", out, "v", v, false);
    int64_t segments = segment_starts.elements() - 1;
    if (segments < 1)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("segment_attention: segment_starts is %s; it needs segments + 1 >= 2 elements",
                                  detail::describe(segment_starts).c_str()));
    detail::check_vector(op, "segment_starts", segment_starts, segments + 1, DType::I32);
    if (max_segment < 0 || max_segment > q.rows)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("segment_attention: max_segment %lld must be in [0, %lld] (q's rows)",
                                  (long long)max_segment, (long long)q.rows));
    if (!(scale > 0.0f) || !std::isfinite(scale))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("segment_attention: scale %g must be positive and finite", scale));
    run_op(Op::segment_attention,
           [&] { impl_segment_attention(q, k, v, segment_starts, max_segment, head_dim, scale, out); });
  });
}

Status Backend::kv_write(const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v,
                         const Tensor& slots) {
  return detail::guard([&] {
    detail::check_kv_write(*this, "kv_write", cache, layer, k, v, slots);
    run_op(Op::kv_write, [&] { impl_kv_write(cache, layer, k, v, slots); });
  });
}

Status Backend::attention(const Tensor& q, const KVCacheView& cache, int64_t layer, const AttentionBatch& batch,
                          float scale, const Tensor& out, const AttentionOptions& options) {
  return detail::guard([&] {
    const char* op = "attention";
    detail::check_kv_cache(op, cache, layer);
    detail::check_supported(*this, Op::attention, cache.dtype, "KV dtype");
    const int64_t head_dim = cache.layout.head_dim, kv_heads = cache.layout.kv_heads;
    detail::check_dtype(op, "q", q, activation_dtype());
    if (q.cols % head_dim != 0 || (q.cols / head_dim) % kv_heads != 0 || q.cols == 0)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("attention: q is %s; it must hold heads x head_dim %lld columns with heads a "
                                  "positive multiple of the cache's %lld KV heads",
                                  detail::describe(q).c_str(), (long long)head_dim, (long long)kv_heads));
    detail::check_dtype(op, "out", out, activation_dtype());
    detail::check_shape(op, "out", out, q.rows, q.cols);
    detail::check_alias(op, "out", out, "q", q, false);
    int64_t seqs = batch.context_lens.elements();
    detail::check_vector(op, "context_lens", batch.context_lens, seqs, DType::I32);
    detail::check_vector(op, "query_starts", batch.query_starts, seqs + 1, DType::I32);
    detail::check_dtype(op, "block_tables", batch.block_tables, DType::I32);
    if (batch.block_tables.rows != seqs)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("attention: block_tables is %s but there are %lld sequences (context_lens); it "
                                  "needs one row per sequence", detail::describe(batch.block_tables).c_str(),
                                  (long long)seqs));
    if (batch.max_context < 0 || batch.max_context > batch.block_tables.cols * cache.layout.page_tokens)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("attention: max_context %lld is negative or more than block_tables' %lld pages "
                                  "of %lld tokens hold", (long long)batch.max_context,
                                  (long long)batch.block_tables.cols, (long long)cache.layout.page_tokens));
    if (!(scale > 0.0f) || !std::isfinite(scale))
      detail::fail(ErrorCode::invalid_argument, detail::format("attention: scale %g must be positive and finite", scale));
    if (options.window < 0 || options.window > INT32_MAX)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("attention: window %lld must be 0 (none) or a positive count below 2^31",
                                  (long long)options.window));
    if (!(options.logit_softcap >= 0.0f) || !std::isfinite(options.logit_softcap))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("attention: logit_softcap %g must be 0 (none) or positive and finite",
                                  options.logit_softcap));
    run_op(Op::attention, [&] { impl_attention(q, cache, layer, batch, scale, out, options); });
  });
}

}  // namespace kvlite
