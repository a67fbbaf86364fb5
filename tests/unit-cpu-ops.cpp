// cpu-ops: every op of the CPU backend against a plain scalar reference written here in double precision,
// on seeded random inputs (never zeros) at odd shapes, with outputs poisoned with NaN first and inputs padded
// with NaN between rows (so reading or writing outside a view shows up as NaN).
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include "host_floats.hpp"
#include "paged_attention.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

using namespace kvlite;
using namespace host_floats;
using namespace paged_attention;

namespace {

std::unique_ptr<Backend> cpu(int threads) {
  CpuBackendOptions options;
  options.threads = threads;
  options.max_head_dim = 64;
  // This suite checks the reference ops against double precision; the fast Linears (the default) are checked
  // against these in cpu-fast:, so the reference must stay checked against the truth here.
  options.kernels = CpuKernels::reference;
  return make_cpu_backend(options).value();
}

const DType kWeightTypes[] = {DType::F32, DType::BF16, DType::F16};

bool same_bits(const Matrix& a, const Matrix& b) { return a.bytes == b.bytes; }

}  // namespace

// ---- gather_rows --------------------------------------------------------------------------------------------

TEST_CASE("gather_rows copies table rows of BF16/F16/F32 into F32 activations") {
  auto backend = cpu(3);
  Random rng(11);
  for (DType dtype : kWeightTypes)
    for (int64_t hidden : {7, 64, 129})
      for (int64_t tokens : {1, 3, 17}) {
        CAPTURE(std::string(dtype_name(dtype))); CAPTURE(hidden); CAPTURE(tokens);
        Matrix table(dtype, 23, hidden, 3);
        table.randomize(rng);
        std::vector<int32_t> ids(static_cast<size_t>(tokens));
        for (auto& id : ids) id = int32_t(rng.below(23));
        Matrix out(DType::F32, tokens, hidden, 2);
        REQUIRE(backend->gather_rows(table.view(), Tensor::vector(ids.data(), DType::I32, tokens), out.view()).ok());
        Compare cmp{0, 0};  // conversion to float is exact
        for (int64_t t = 0; t < tokens; t++)
          for (int64_t c = 0; c < hidden; c++) cmp(out.get(t, c), table.get(ids[size_t(t)], c), t, c);
        CHECK_COMPARE(cmp);
        CHECK(out.padding_untouched());
      }
}

TEST_CASE("gather_rows refuses an id outside the table, naming it") {
  auto backend = cpu(1);
  Random rng(12);
  Matrix table(DType::BF16, 5, 8);
  table.randomize(rng);
  std::vector<int32_t> ids = {2, 5, 1};
  Matrix out(DType::F32, 3, 8);
  Status status = backend->gather_rows(table.view(), Tensor::vector(ids.data(), DType::I32, 3), out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().code == ErrorCode::invalid_argument);
  CHECK(status.error().message.find("ids[1] = 5") != std::string::npos);
}

// ---- rms_norm -----------------------------------------------------------------------------------------------

// LlamaRMSNorm (modeling_llama.py): x * rsqrt(mean(x^2) + eps) * weight, here in double.
static void reference_rms_norm(const Matrix& x, int64_t t, int64_t first, int64_t n, const Matrix& weight, double eps,
                               std::vector<double>& out) {
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += double(x.get(t, first + i)) * x.get(t, first + i);
  double inv_rms = 1.0 / std::sqrt(sum / double(n) + eps);
  out.resize(size_t(n));
  for (int64_t i = 0; i < n; i++) out[size_t(i)] = double(weight.get(0, i)) * (x.get(t, first + i) * inv_rms);
}

TEST_CASE("rms_norm matches LlamaRMSNorm over whole rows and per head (Qwen3 q/k norm)") {
  auto backend = cpu(3);
  Random rng(21);
  struct Shape { int64_t cols, group; };
  const Shape shapes[] = {{7, 7}, {64, 64}, {129, 129}, {4 * 16, 16}, {6 * 32, 32}, {8 * 64, 64}};
  for (DType dtype : kWeightTypes)
    for (const Shape& shape : shapes)
      for (int64_t tokens : {1, 3, 17})
        for (float eps : {1e-6f, 1e-5f})
          for (float scale : {3.0f, 0.003f}) {  // at 0.003, mean(x^2) ~ 3e-6: eps weighs in
            CAPTURE(std::string(dtype_name(dtype))); CAPTURE(shape.cols); CAPTURE(shape.group); CAPTURE(tokens); CAPTURE(scale);
            Matrix x(DType::F32, tokens, shape.cols, 5), weight(dtype, 1, shape.group), out(DType::F32, tokens, shape.cols, 1);
            x.randomize(rng, scale);
            weight.randomize(rng);
            REQUIRE(backend->rms_norm(x.view(), weight.view(), eps, out.view()).ok());
            Compare cmp{1e-6, 2e-6};
            std::vector<double> ref;
            for (int64_t t = 0; t < tokens; t++)
              for (int64_t g = 0; g < shape.cols; g += shape.group) {
                reference_rms_norm(x, t, g, shape.group, weight, eps, ref);
                for (int64_t i = 0; i < shape.group; i++) cmp(out.get(t, g + i), ref[size_t(i)], t, g + i);
              }
            CHECK_COMPARE(cmp);
            CHECK(out.padding_untouched());
          }
}

TEST_CASE("rms_norm works in place on a column slice (q inside a fused qkv buffer)") {
  auto backend = cpu(2);
  Random rng(22);
  const int64_t tokens = 5, heads = 6, kv_heads = 3, head_dim = 16, width = (heads + 2 * kv_heads) * head_dim;
  Matrix qkv(DType::F32, tokens, width), before(DType::F32, tokens, width), weight(DType::BF16, 1, head_dim);
  qkv.randomize(rng);
  weight.randomize(rng);
  before.bytes = qkv.bytes;
  Tensor q = qkv.view().slice_cols(0, heads * head_dim);
  REQUIRE(backend->rms_norm(q, weight.view(), 1e-6f, q).ok());
  Compare cmp{1e-6, 2e-6};
  std::vector<double> ref;
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t h = 0; h < heads; h++) {
      reference_rms_norm(before, t, h * head_dim, head_dim, weight, 1e-6, ref);
      for (int64_t i = 0; i < head_dim; i++) cmp(qkv.get(t, h * head_dim + i), ref[size_t(i)], t, h * head_dim + i);
    }
    for (int64_t c = heads * head_dim; c < width; c++) cmp(qkv.get(t, c), before.get(t, c), t, c);  // k, v untouched
  }
  CHECK_COMPARE(cmp);
}

TEST_CASE("add_rms_norm adds x into the residual, then normalises the residual") {
  auto backend = cpu(3);
  Random rng(23);
  for (DType dtype : kWeightTypes)
    for (int64_t hidden : {7, 64, 129})
      for (int64_t tokens : {1, 3, 17}) {
        CAPTURE(std::string(dtype_name(dtype))); CAPTURE(hidden); CAPTURE(tokens);
        Matrix x(DType::F32, tokens, hidden, 2), residual(DType::F32, tokens, hidden, 3), weight(dtype, 1, hidden);
        Matrix out(DType::F32, tokens, hidden, 1);
        x.randomize(rng);
        residual.randomize(rng, 4.0f);
        weight.randomize(rng);
        Matrix sum(DType::F32, tokens, hidden);
        for (int64_t t = 0; t < tokens; t++)
          for (int64_t c = 0; c < hidden; c++) sum.set(t, c, residual.get(t, c) + x.get(t, c));  // one float add
        REQUIRE(backend->add_rms_norm(x.view(), residual.view(), weight.view(), 1e-5f, out.view()).ok());
        Compare sum_cmp{0, 0}, out_cmp{1e-6, 2e-6};
        std::vector<double> ref;
        for (int64_t t = 0; t < tokens; t++) {
          reference_rms_norm(sum, t, 0, hidden, weight, 1e-5, ref);
          for (int64_t c = 0; c < hidden; c++) {
            sum_cmp(residual.get(t, c), sum.get(t, c), t, c);
            out_cmp(out.get(t, c), ref[size_t(c)], t, c);
          }
        }
        CHECK_COMPARE(sum_cmp);
        CHECK_COMPARE(out_cmp);
        CHECK(residual.padding_untouched());
        CHECK(out.padding_untouched());
      }
}

// ---- rotary embedding ------------------------------------------------------------------------------------

TEST_CASE("rope_inv_freq 'default' is 1 / theta^(2i/d) with the exponent formed in float32") {
  // transformers: inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
  for (double theta : {10000.0, 500000.0, 1000000.0, 5000000.0})
    for (int64_t dim : {16, 64, 128}) {
      RopeConfig rope;
      rope.theta = theta;
      auto inv_freq = rope_inv_freq(rope, dim);
      REQUIRE(inv_freq.ok());
      REQUIRE(inv_freq->size() == size_t(dim / 2));
      Compare cmp{0, 3e-7};
      for (int64_t i = 0; i < dim / 2; i++) {
        double exponent = double(float(2 * i) / float(dim));
        cmp((*inv_freq)[size_t(i)], 1.0 / std::pow(theta, exponent), i, 0);
      }
      CHECK_COMPARE(cmp);
      CHECK((*inv_freq)[0] == 1.0f);
    }
}

TEST_CASE("rope_inv_freq 'llama3' follows transformers' _compute_llama3_parameters") {
  // modeling_rope_utils.py, _compute_llama3_parameters: with wavelen = 2*pi / inv_freq,
  //   wavelen < original / high_freq_factor: unchanged; wavelen > original / low_freq_factor: inv_freq / factor;
  //   otherwise smooth = (original / wavelen - low) / (high - low),
  //             inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq.
  struct Case { double theta, factor, low, high; int64_t original, dim; };
  const Case cases[] = {
      {500000.0, 8.0, 1.0, 4.0, 8192, 128},   // Llama-3.1-8B
      {500000.0, 32.0, 1.0, 4.0, 8192, 64},   // Llama-3.2-1B
      {500000.0, 8.0, 1.0, 4.0, 64, 16},      // tests/fixtures/models/tiny-llama3: every band at head_dim 16
      {10000.0, 4.0, 2.0, 8.0, 512, 16},
  };
  for (const Case& c : cases) {
    CAPTURE(c.factor); CAPTURE(c.dim);
    RopeConfig rope;
    rope.type = "llama3";
    rope.theta = c.theta;
    rope.factor = c.factor;
    rope.low_freq_factor = c.low;
    rope.high_freq_factor = c.high;
    rope.original_max_position_embeddings = c.original;
    auto inv_freq = rope_inv_freq(rope, c.dim);
    REQUIRE(inv_freq.ok());
    int bands[3] = {0, 0, 0};  // unchanged, smoothed, divided
    Compare cmp{0, 1e-6};
    for (int64_t i = 0; i < c.dim / 2; i++) {
      double base = 1.0 / std::pow(c.theta, double(float(2 * i) / float(c.dim)));
      double wavelen = 2 * M_PI / base, expected;
      if (wavelen < c.original / c.high) {
        expected = base;
        bands[0]++;
      } else if (wavelen > c.original / c.low) {
        expected = base / c.factor;
        bands[2]++;
      } else {
        double smooth = (c.original / wavelen - c.low) / (c.high - c.low);
        expected = (1 - smooth) * base / c.factor + smooth * base;
        bands[1]++;
      }
      cmp((*inv_freq)[size_t(i)], expected, i, 0);
    }
    CHECK_COMPARE(cmp);
    CHECK(bands[0] > 0);
    CHECK(bands[1] > 0);
    CHECK(bands[2] > 0);
  }
}

TEST_CASE("rope_inv_freq refuses rope types it does not implement") {
  RopeConfig rope;
  rope.type = "proportional";
  auto inv_freq = rope_inv_freq(rope, 64);
  REQUIRE_FALSE(inv_freq.ok());
  CHECK(inv_freq.error().code == ErrorCode::unsupported);
  CHECK(inv_freq.error().message.find("proportional") != std::string::npos);
}

TEST_CASE("rope_tables: one position row, and Qwen3-VL's interleaved M-RoPE rows") {
  Random rng(31);
  RopeConfig rope;
  rope.theta = 5000000.0;
  for (int64_t dim : {12, 128}) {
    std::vector<float> inv_freq = rope_inv_freq(rope, dim).value();
    const int64_t half = dim / 2, tokens = 9;
    // M-RoPE sections sum to half: Qwen3-VL's [24, 20, 20] at head_dim 128; [3, 2, 1] at 12, unequal so
    // that mixing up the h and w sections shows.
    std::vector<int> section = dim == 128 ? std::vector<int>{24, 20, 20} : std::vector<int>{3, 2, 1};
    // Which row each frequency reads, by the slicing transformers' apply_interleaved_mrope does:
    // freqs_t[..., offset:3*section[dim]:3] = freqs[dim, ..., same slice] for (dim, offset) = (1, 1), (2, 2).
    std::vector<int> row_of_frequency(size_t(half), 0);
    for (int row = 1; row <= 2; row++)
      for (int64_t i = row; i < std::min<int64_t>(3 * section[size_t(row)], half); i += 3) row_of_frequency[size_t(i)] = row;
    for (int64_t rows : {1, 3}) {
      CAPTURE(dim); CAPTURE(rows);
      std::vector<int32_t> positions(size_t(rows * tokens));
      for (auto& p : positions) p = int32_t(rng.below(40000));
      std::vector<float> cos(size_t(tokens * half), NAN), sin(size_t(tokens * half), NAN);
      REQUIRE(rope_tables(inv_freq, positions.data(), rows, tokens, section, cos.data(), sin.data()).ok());
      Compare cmp{1e-7, 0};
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t i = 0; i < half; i++) {
          int row = rows == 3 ? row_of_frequency[size_t(i)] : 0;
          // freqs = inv_freq.float() @ position_ids.float(): a float32 product, then cos/sin of it
          float angle = inv_freq[size_t(i)] * float(positions[size_t(row * tokens + t)]);
          cmp(cos[size_t(t * half + i)], std::cos(double(angle)), t, i);
          cmp(sin[size_t(t * half + i)], std::sin(double(angle)), t, i);
        }
      CHECK_COMPARE(cmp);
    }
    if (dim == 12) CHECK(row_of_frequency == std::vector<int>{0, 1, 2, 0, 1, 0});
    if (dim == 128) {  // the Qwen3-VL layout: THW repeated, T alone at the top 4 frequencies
      CHECK(row_of_frequency[0] == 0);
      CHECK(row_of_frequency[1] == 1);
      CHECK(row_of_frequency[2] == 2);
      CHECK(row_of_frequency[58] == 1);
      CHECK(row_of_frequency[59] == 2);
      CHECK(row_of_frequency[61] == 0);
      CHECK(row_of_frequency[62] == 0);
    }
  }
}

TEST_CASE("rope rotates each head's halves: x*cos + rotate_half(x)*sin") {
  auto backend = cpu(3);
  Random rng(32);
  RopeConfig rope;
  rope.theta = 1000000.0;
  for (int64_t head_dim : {16, 32, 64})
    for (int64_t heads : {1, 3, 8})
      for (int64_t tokens : {1, 3, 17})
        for (bool partial : {false, true}) {
          CAPTURE(head_dim); CAPTURE(heads); CAPTURE(tokens); CAPTURE(partial);
          const int64_t rotary = partial ? head_dim / 2 : head_dim, half = rotary / 2;
          std::vector<float> inv_freq = rope_inv_freq(rope, rotary).value();
          std::vector<int32_t> positions(static_cast<size_t>(tokens));
          for (auto& p : positions) p = int32_t(rng.below(5000));
          Matrix cos(DType::F32, tokens, half), sin(DType::F32, tokens, half);
          REQUIRE(rope_tables(inv_freq, positions.data(), 1, tokens, {}, reinterpret_cast<float*>(cos.bytes.data()),
                              reinterpret_cast<float*>(sin.bytes.data())).ok());
          Matrix x(DType::F32, tokens, heads * head_dim, 3), before(DType::F32, tokens, heads * head_dim, 3);
          x.randomize(rng);
          before.bytes = x.bytes;
          REQUIRE(backend->rope(x.view(), cos.view(), sin.view(), head_dim).ok());
          Compare cmp{1e-6, 1e-6};
          for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < heads; h++)
              for (int64_t i = 0; i < head_dim; i++) {
                const int64_t col = h * head_dim + i;
                double expected = before.get(t, col);
                if (i < rotary) {
                  int64_t f = i % half;
                  double a = before.get(t, h * head_dim + f), b = before.get(t, h * head_dim + f + half);
                  double c = cos.get(t, f), s = sin.get(t, f);
                  expected = i < half ? a * c - b * s : b * c + a * s;
                }
                cmp(x.get(t, col), expected, t, col);
              }
          CHECK_COMPARE(cmp);
          CHECK(x.padding_untouched());
        }
}

// ---- linear -----------------------------------------------------------------------------------------------

TEST_CASE("linear matches a double dot product for BF16/F16/F32 weights, with and without bias") {
  auto backend = cpu(3);
  Random rng(41);
  for (DType dtype : kWeightTypes)
    for (int64_t k : {7, 64, 129})
      for (int64_t n : {1, 5, 33, 70})
        for (int64_t tokens : {1, 3, 17})
          for (bool with_bias : {false, true}) {
            CAPTURE(std::string(dtype_name(dtype))); CAPTURE(k); CAPTURE(n); CAPTURE(tokens); CAPTURE(with_bias);
            Matrix x(DType::F32, tokens, k, 3), weight(dtype, n, k, 2), bias(dtype, 1, n), out(DType::F32, tokens, n, 1);
            x.randomize(rng);
            weight.randomize(rng);
            bias.randomize(rng);
            Tensor bias_view = with_bias ? bias.view() : Tensor{};
            REQUIRE(backend->linear(x.view(), weight.view(), bias_view, out.view()).ok());
            Compare cmp{0, 0};
            for (int64_t t = 0; t < tokens; t++)
              for (int64_t j = 0; j < n; j++) {
                double sum = with_bias ? bias.get(0, j) : 0.0, magnitude = std::fabs(sum);
                for (int64_t i = 0; i < k; i++) {
                  sum += double(x.get(t, i)) * weight.get(j, i);
                  magnitude += std::fabs(double(x.get(t, i)) * weight.get(j, i));
                }
                // float32 rounding bound of the kernel's sum: k / 8 additions per lane, the lane tree, the
                // tail, the products and the bias, each at most one unit roundoff (2^-24) of the magnitudes
                cmp(out.get(t, j), sum, t, j, double(k / 8 + 8) * 0x1p-24 * magnitude);
              }
            CHECK_COMPARE(cmp);
            CHECK(out.padding_untouched());
          }
}

TEST_CASE("threaded ops give the same bits as one thread") {
  auto one = cpu(1), four = cpu(4);
  Random rng(42);
  // Shapes that cut tiles and work items unevenly: tokens not a multiple of 4 or 32, rows not of 2 or 16.
  const int64_t tokens = 67, k = 129, n = 83;
  Matrix x(DType::F32, tokens, k, 1), weight(DType::BF16, n, k), bias(DType::F32, 1, n);
  x.randomize(rng);
  weight.randomize(rng);
  bias.randomize(rng);
  Matrix out_one(DType::F32, tokens, n), out_four(DType::F32, tokens, n);
  REQUIRE(one->linear(x.view(), weight.view(), bias.view(), out_one.view()).ok());
  REQUIRE(four->linear(x.view(), weight.view(), bias.view(), out_four.view()).ok());
  CHECK(same_bits(out_one, out_four));

  Matrix norm_weight(DType::F16, 1, k), normed_one(DType::F32, tokens, k), normed_four(DType::F32, tokens, k);
  norm_weight.randomize(rng);
  REQUIRE(one->rms_norm(x.view(), norm_weight.view(), 1e-6f, normed_one.view()).ok());
  REQUIRE(four->rms_norm(x.view(), norm_weight.view(), 1e-6f, normed_four.view()).ok());
  CHECK(same_bits(normed_one, normed_four));
}

// ---- elementwise ------------------------------------------------------------------------------------------

TEST_CASE("silu_mul, add and copy") {
  auto backend = cpu(3);
  Random rng(51);
  for (int64_t cols : {7, 64, 129})
    for (int64_t tokens : {1, 3, 17}) {
      CAPTURE(cols); CAPTURE(tokens);
      // gate and up as the two halves of one fused gate_up buffer, as the MLP computes them
      Matrix gate_up(DType::F32, tokens, 2 * cols, 1), out(DType::F32, tokens, cols, 2);
      gate_up.randomize(rng, 6.0f);
      Tensor gate = gate_up.view().slice_cols(0, cols), up = gate_up.view().slice_cols(cols, cols);
      REQUIRE(backend->silu_mul(gate, up, out.view()).ok());
      Compare silu_cmp{1e-6, 1e-6};
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t c = 0; c < cols; c++) {
          double g = gate_up.get(t, c), u = gate_up.get(t, cols + c);
          silu_cmp(out.get(t, c), g / (1 + std::exp(-g)) * u, t, c);
        }
      CHECK_COMPARE(silu_cmp);
      CHECK(out.padding_untouched());

      Matrix a(DType::F32, tokens, cols, 1), b(DType::F32, tokens, cols, 2), sum(DType::F32, tokens, cols, 3);
      a.randomize(rng);
      b.randomize(rng);
      REQUIRE(backend->add(a.view(), b.view(), sum.view()).ok());
      Compare add_cmp{0, 0};
      for (int64_t t = 0; t < tokens; t++)
        for (int64_t c = 0; c < cols; c++) add_cmp(sum.get(t, c), float(a.get(t, c) + b.get(t, c)), t, c);
      CHECK_COMPARE(add_cmp);
      CHECK(sum.padding_untouched());

      for (DType from : kWeightTypes)
        for (DType to : kWeightTypes) {
          CAPTURE(std::string(dtype_name(from))); CAPTURE(std::string(dtype_name(to)));
          Matrix src(from, tokens, cols, 2), dst(to, tokens, cols, 1);
          src.randomize(rng);
          REQUIRE(backend->copy(src.view(), dst.view()).ok());
          Compare copy_cmp{0, 0};  // one round to nearest even, done here by encode()
          Matrix expected(to, tokens, cols);
          for (int64_t t = 0; t < tokens; t++)
            for (int64_t c = 0; c < cols; c++) {
              expected.set(t, c, src.get(t, c));
              copy_cmp(dst.get(t, c), expected.get(t, c), t, c);
            }
          CHECK_COMPARE(copy_cmp);
          CHECK(dst.padding_untouched());
        }
    }
}

TEST_CASE("copy_from_host and copy_to_host move dense host rows in and out of a strided view") {
  auto backend = cpu(1);
  Random rng(52);
  Matrix device(DType::BF16, 5, 9, 4);
  std::vector<uint16_t> host(45), back(45, 0);
  for (auto& h : host) h = float_to_bf16(rng.value());
  REQUIRE(backend->copy_from_host(host.data(), device.view()).ok());
  CHECK(device.padding_untouched());
  for (int64_t r = 0; r < 5; r++)
    for (int64_t c = 0; c < 9; c++) CHECK(device.get(r, c) == bf16_to_float(host[size_t(r * 9 + c)]));
  REQUIRE(backend->copy_to_host(device.view(), back.data()).ok());
  CHECK(back == host);
}

// ---- paged KV and attention ---------------------------------------------------------------------------------

TEST_CASE("kv_write stores each token's K and V at its slot in the page layout and skips negative slots") {
  auto backend = cpu(2);
  Random rng(61);
  for (DType kv_dtype : kWeightTypes)
    for (int64_t page_tokens : {1, 5, 16}) {
      CAPTURE(std::string(dtype_name(kv_dtype))); CAPTURE(page_tokens);
      PagedFixture fx(4, 2, 16, page_tokens, kv_dtype, {13}, rng);
      Matrix k(DType::F32, 13, 32, 1), v(DType::F32, 13, 32, 2);
      k.randomize(rng);
      v.randomize(rng);
      std::vector<int32_t> slots(13);
      for (int64_t t = 0; t < 13; t++) slots[size_t(t)] = t == 6 ? -1 : fx.slot(0, t);  // token 6: padding
      REQUIRE(backend->kv_write(fx.cache(), 1, k.view(), v.view(), Tensor::vector(slots.data(), DType::I32, 13)).ok());
      const size_t element = dtype_bytes(kv_dtype, 1);
      int64_t written = 0, mismatched = 0;
      for (int64_t t = 0; t < 13; t++)
        for (int kv = 0; kv < 2; kv++)
          for (int64_t head = 0; head < 2; head++)
            for (int64_t d = 0; d < 16; d++) {
              int64_t page = fx.tables[0][size_t(t / page_tokens)];
              float got = decode(kv_dtype, &fx.pages[size_t(fx.layout.offset(page, 1, kv, t % page_tokens, head) + d) * element]);
              uint8_t expected[4];
              encode(kv_dtype, (kv == 0 ? k : v).get(t, head * 16 + d), expected);
              if (t == 6) mismatched += !std::isnan(got);
              else mismatched += got != decode(kv_dtype, expected);
            }
      for (size_t i = 0; i < fx.pages.size(); i += element) written += !std::isnan(decode(kv_dtype, &fx.pages[i]));
      CHECK(mismatched == 0);
      CHECK(written == 12 * 2 * 32);  // nothing else was touched: other layer, other pages, token 6
    }
}

TEST_CASE("attention matches a naive full softmax over contiguous K/V (GQA, paged, several sequences)") {
  auto backend = cpu(3);
  Random rng(62);
  struct Heads { int64_t heads, kv_heads; };
  const Heads head_configs[] = {{4, 2}, {6, 3}, {8, 1}, {16, 1}};  // 16/1: more query heads than one pass holds
  const std::vector<int64_t> contexts = {1, 23, 40};
  for (const Heads& hc : head_configs)
    for (int64_t head_dim : {16, 32, 64})
      for (int64_t page_tokens : {1, 5, 16})
        for (DType kv_dtype : kWeightTypes) {
          CAPTURE(hc.heads); CAPTURE(hc.kv_heads); CAPTURE(head_dim); CAPTURE(page_tokens); CAPTURE(std::string(dtype_name(kv_dtype)));
          PagedFixture fx(hc.heads, hc.kv_heads, head_dim, page_tokens, kv_dtype, contexts, rng);
          std::vector<Matrix> q, k, v;
          make_qkv(fx, contexts, rng, q, k, v);
          // One prefill step for all three sequences at once.
          Step step{{0, 1, 2}, {0, 0, 0}, {1, 23, 40}};
          Matrix out = run_step(*backend, fx, step, q, k, v);
          Compare cmp{2e-6, 2e-6};
          int64_t row = 0;
          for (size_t s = 0; s < contexts.size(); s++) {
            Matrix stored_k = as_stored(fx, k[s]), stored_v = as_stored(fx, v[s]);
            for (int64_t position = 0; position < contexts[s]; position++, row++) {
              std::vector<double> ref = reference_attention(fx, q[s], stored_k, stored_v, position);
              for (int64_t c = 0; c < fx.heads * head_dim; c++) cmp(out.get(row, c), ref[size_t(c)], row, c);
            }
          }
          CHECK_COMPARE(cmp);
        }
}

TEST_CASE("attention: chunked prefill (10 then 7) and decode steps give the bits of one prefill") {
  Random rng(63);
  for (int64_t page_tokens : {1, 5, 16})
    for (DType kv_dtype : {DType::BF16, DType::F32}) {
      CAPTURE(page_tokens); CAPTURE(std::string(dtype_name(kv_dtype)));
      auto backend = cpu(3);
      const std::vector<int64_t> contexts = {20};
      PagedFixture whole(6, 3, 32, page_tokens, kv_dtype, contexts, rng);
      PagedFixture chunked = whole;  // the same pages, block tables and poison
      std::vector<Matrix> q, k, v;
      make_qkv(whole, contexts, rng, q, k, v);
      Matrix all = run_step(*backend, whole, Step{{0}, {0}, {20}}, q, k, v);
      std::vector<Matrix> parts;
      parts.push_back(run_step(*backend, chunked, Step{{0}, {0}, {10}}, q, k, v));
      parts.push_back(run_step(*backend, chunked, Step{{0}, {10}, {7}}, q, k, v));
      for (int64_t position = 17; position < 20; position++)
        parts.push_back(run_step(*backend, chunked, Step{{0}, {position}, {1}}, q, k, v));
      int64_t row = 0, differing = 0;
      for (const Matrix& part : parts)
        for (int64_t r = 0; r < part.rows; r++, row++)
          for (int64_t c = 0; c < part.cols; c++) differing += memcmp(&part.bytes[size_t((r * part.stride + c) * 4)],
                                                                      &all.bytes[size_t((row * all.stride + c) * 4)], 4) != 0;
      CHECK(row == 20);
      CHECK(differing == 0);
      Compare cmp{2e-6, 2e-6};
      Matrix stored_k = as_stored(whole, k[0]), stored_v = as_stored(whole, v[0]);
      for (int64_t position = 0; position < 20; position++) {
        std::vector<double> ref = reference_attention(whole, q[0], stored_k, stored_v, position);
        for (int64_t c = 0; c < all.cols; c++) cmp(all.get(position, c), ref[size_t(c)], position, c);
      }
      CHECK_COMPARE(cmp);
    }
}

TEST_CASE("attention: a batch mixing prefill chunks and decodes matches the reference, same bits at any thread count") {
  Random rng(64);
  const std::vector<int64_t> contexts = {30, 9, 41};
  PagedFixture fx_one(8, 2, 64, 5, DType::BF16, contexts, rng);
  PagedFixture fx_four = fx_one;
  std::vector<Matrix> q, k, v;
  make_qkv(fx_one, contexts, rng, q, k, v);
  auto one = cpu(1), four = cpu(4);
  // Step 1: prefill the first 29 / 8 / 22 tokens. Step 2 (mixed): seq 0 and 1 decode their last token while
  // seq 2 prefills its next chunk of 19, listed in a different order than the fixture's.
  const Step prefill{{0, 1, 2}, {0, 0, 0}, {29, 8, 22}};
  const Step mixed{{2, 0, 1}, {22, 29, 8}, {19, 1, 1}};
  run_step(*one, fx_one, prefill, q, k, v);
  run_step(*four, fx_four, prefill, q, k, v);
  Matrix out_one = run_step(*one, fx_one, mixed, q, k, v);
  Matrix out_four = run_step(*four, fx_four, mixed, q, k, v);
  CHECK(same_bits(out_one, out_four));
  Compare cmp{2e-6, 2e-6};
  int64_t row = 0;
  for (size_t e = 0; e < mixed.seqs.size(); e++)
    for (int64_t j = 0; j < mixed.count[e]; j++, row++) {
      size_t s = mixed.seqs[e];
      std::vector<double> ref =
          reference_attention(fx_one, q[s], as_stored(fx_one, k[s]), as_stored(fx_one, v[s]), mixed.first[e] + j);
      for (int64_t c = 0; c < out_one.cols; c++) cmp(out_one.get(row, c), ref[size_t(c)], row, c);
    }
  CHECK_COMPARE(cmp);
}

// ---- the vision encoder's ops -------------------------------------------------------------------------------

TEST_CASE("embedding_bag sums weighted table rows in order (bilinear position resampling)") {
  auto backend = cpu(3);
  Random rng(81);
  for (DType dtype : kWeightTypes)
    for (int64_t hidden : {7, 32, 129})
      for (int64_t taps : {1, 4, 5})
        for (int64_t tokens : {1, 3, 17}) {
          CAPTURE(std::string(dtype_name(dtype))); CAPTURE(hidden); CAPTURE(taps); CAPTURE(tokens);
          Matrix table(dtype, 31, hidden, 2), weights(DType::F32, tokens, taps, 1), out(DType::F32, tokens, hidden, 3);
          table.randomize(rng, 4.0f);
          weights.randomize(rng);
          std::vector<int32_t> indices(size_t(tokens * (taps + 2)), -7);  // 2 padding entries per row
          for (int64_t t = 0; t < tokens; t++)
            for (int64_t j = 0; j < taps; j++) indices[size_t(t * (taps + 2) + j)] = int32_t(rng.below(31));
          Tensor index_view{indices.data(), DType::I32, tokens, taps, taps + 2};
          REQUIRE(backend->embedding_bag(table.view(), index_view, weights.view(), out.view()).ok());
          Compare cmp{0, 0};
          for (int64_t t = 0; t < tokens; t++)
            for (int64_t c = 0; c < hidden; c++) {
              double sum = 0, magnitude = 0;
              for (int64_t j = 0; j < taps; j++) {
                double term = double(table.get(indices[size_t(t * (taps + 2) + j)], c)) * weights.get(t, j);
                sum += term;
                magnitude += std::fabs(term);
              }
              // each product and each addition rounds once in float32
              cmp(out.get(t, c), sum, t, c, double(2 * taps) * 0x1p-24 * magnitude);
            }
          CHECK_COMPARE(cmp);
          CHECK(out.padding_untouched());
        }
}

TEST_CASE("embedding_bag refuses an index outside the table, naming it") {
  auto backend = cpu(1);
  Random rng(82);
  Matrix table(DType::BF16, 9, 8), weights(DType::F32, 2, 4), out(DType::F32, 2, 8);
  table.randomize(rng);
  weights.randomize(rng);
  std::vector<int32_t> indices = {0, 1, 2, 3, 4, 5, 9, 7};
  Status status = backend->embedding_bag(table.view(), Tensor::matrix(indices.data(), DType::I32, 2, 4), weights.view(),
                                         out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().code == ErrorCode::invalid_argument);
  CHECK(status.error().message.find("indices[1][2] = 9") != std::string::npos);
}

TEST_CASE("layer_norm matches nn.LayerNorm (biased variance, weight and bias), also in place") {
  auto backend = cpu(3);
  Random rng(83);
  for (DType dtype : kWeightTypes)
    for (int64_t cols : {7, 32, 129, 4 * 32})
      for (int64_t tokens : {1, 3, 17})
        for (float offset : {0.0f, 20.0f}) {  // a mean far from 0 tests the centring
          CAPTURE(std::string(dtype_name(dtype))); CAPTURE(cols); CAPTURE(tokens); CAPTURE(offset);
          Matrix x(DType::F32, tokens, cols, 3), weight(dtype, 1, cols), bias(dtype, 1, cols);
          Matrix out(DType::F32, tokens, cols, 1);
          x.randomize(rng, 2.0f);
          for (int64_t t = 0; t < tokens; t++)
            for (int64_t c = 0; c < cols; c++) x.set(t, c, x.get(t, c) + offset);
          weight.randomize(rng);
          bias.randomize(rng);
          Matrix in_place = x;
          REQUIRE(backend->layer_norm(x.view(), weight.view(), bias.view(), 1e-6f, out.view()).ok());
          REQUIRE(backend->layer_norm(in_place.view(), weight.view(), bias.view(), 1e-6f, in_place.view()).ok());
          Compare cmp{2e-6, 2e-6};
          for (int64_t t = 0; t < tokens; t++) {
            double mean = 0, var = 0;
            for (int64_t c = 0; c < cols; c++) mean += x.get(t, c);
            mean /= double(cols);
            for (int64_t c = 0; c < cols; c++) var += (x.get(t, c) - mean) * (x.get(t, c) - mean);
            var /= double(cols);
            for (int64_t c = 0; c < cols; c++) {
              double expected = (x.get(t, c) - mean) / std::sqrt(var + 1e-6) * weight.get(0, c) + bias.get(0, c);
              cmp(out.get(t, c), expected, t, c);
            }
          }
          CHECK_COMPARE(cmp);
          for (int64_t t = 0; t < tokens; t++)
            for (int64_t c = 0; c < cols; c++) CHECK(in_place.get(t, c) == out.get(t, c));
          CHECK(out.padding_untouched());
          CHECK(in_place.padding_untouched());
        }
}

TEST_CASE("gelu: exact (erf) and the tanh approximation") {
  auto backend = cpu(3);
  Random rng(84);
  for (GeluApprox approx : {GeluApprox::none, GeluApprox::tanh})
    for (int64_t cols : {7, 64, 129})
      for (int64_t tokens : {1, 3, 17}) {
        CAPTURE(int(approx)); CAPTURE(cols); CAPTURE(tokens);
        Matrix x(DType::F32, tokens, cols, 2), out(DType::F32, tokens, cols, 1);
        x.randomize(rng, 5.0f);
        REQUIRE(backend->gelu(x.view(), approx, out.view()).ok());
        Compare cmp{1e-6, 1e-6};
        for (int64_t t = 0; t < tokens; t++)
          for (int64_t c = 0; c < cols; c++) {
            double v = x.get(t, c);
            double expected = approx == GeluApprox::tanh
                                  ? 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)))
                                  : 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
            cmp(out.get(t, c), expected, t, c);
          }
        CHECK_COMPARE(cmp);
        CHECK(out.padding_untouched());
        Matrix in_place = x;
        REQUIRE(backend->gelu(in_place.view(), approx, in_place.view()).ok());
        for (int64_t t = 0; t < tokens; t++)
          for (int64_t c = 0; c < cols; c++) CHECK(in_place.get(t, c) == out.get(t, c));
      }
  // The two forms differ (by 4e-4 at x = 3), so a mix-up shows.
  Matrix x(DType::F32, 1, 1), exact(DType::F32, 1, 1), tanh_form(DType::F32, 1, 1);
  x.set(0, 0, 3.0f);
  REQUIRE(backend->gelu(x.view(), GeluApprox::none, exact.view()).ok());
  REQUIRE(backend->gelu(x.view(), GeluApprox::tanh, tanh_form.view()).ok());
  CHECK(std::fabs(exact.get(0, 0) - tanh_form.get(0, 0)) > 3e-4);
}

namespace {

// Naive non-causal attention in double over rows [begin, end) for query row t.
std::vector<double> reference_segment_attention(const Matrix& qkv, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                                double scale, int64_t t, int64_t begin, int64_t end) {
  const int64_t group = heads / kv_heads, k0 = heads * head_dim, v0 = k0 + kv_heads * head_dim;
  std::vector<double> out(size_t(heads * head_dim), 0.0), scores(size_t(end - begin));
  for (int64_t h = 0; h < heads; h++) {
    const int64_t kv = h / group;
    double max_score = -INFINITY, total = 0;
    for (int64_t r = begin; r < end; r++) {
      double dot = 0;
      for (int64_t d = 0; d < head_dim; d++) dot += double(qkv.get(t, h * head_dim + d)) * qkv.get(r, k0 + kv * head_dim + d);
      scores[size_t(r - begin)] = dot * scale;
      max_score = std::max(max_score, scores[size_t(r - begin)]);
    }
    for (double s : scores) total += std::exp(s - max_score);
    for (int64_t r = begin; r < end; r++) {
      double p = std::exp(scores[size_t(r - begin)] - max_score) / total;
      for (int64_t d = 0; d < head_dim; d++) out[size_t(h * head_dim + d)] += p * qkv.get(r, v0 + kv * head_dim + d);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("segment_attention: full attention inside each segment, none across (vision cu_seqlens)") {
  Random rng(85);
  struct Heads { int64_t heads, kv_heads; };
  for (Heads hc : {Heads{2, 2}, Heads{6, 3}, Heads{4, 1}})
    for (int64_t head_dim : {16, 64})
      for (const std::vector<int32_t>& starts : {std::vector<int32_t>{0, 1}, std::vector<int32_t>{0, 24},
                                                 std::vector<int32_t>{0, 13, 13, 50}}) {  // an empty segment too
        CAPTURE(hc.heads); CAPTURE(hc.kv_heads); CAPTURE(head_dim); CAPTURE(starts.size());
        const int64_t rows = starts.back(), segments = int64_t(starts.size()) - 1;
        const int64_t width = (hc.heads + 2 * hc.kv_heads) * head_dim;
        int64_t longest = 0;
        for (int64_t s = 0; s < segments; s++) longest = std::max<int64_t>(longest, starts[size_t(s + 1)] - starts[size_t(s)]);
        Matrix qkv(DType::F32, rows, width, 2);
        qkv.randomize(rng, 2.0f);  // peaked enough that a wrong key set changes the output
        const float scale = 1.0f / std::sqrt(float(head_dim));
        Tensor q = qkv.view().slice_cols(0, hc.heads * head_dim);
        Tensor k = qkv.view().slice_cols(hc.heads * head_dim, hc.kv_heads * head_dim);
        Tensor v = qkv.view().slice_cols((hc.heads + hc.kv_heads) * head_dim, hc.kv_heads * head_dim);
        Tensor segment_view = Tensor::vector(const_cast<int32_t*>(starts.data()), DType::I32, segments + 1);
        Matrix out_one(DType::F32, rows, hc.heads * head_dim, 1), out_four(DType::F32, rows, hc.heads * head_dim, 1);
        REQUIRE(cpu(1)->segment_attention(q, k, v, segment_view, longest, head_dim, scale, out_one.view()).ok());
        REQUIRE(cpu(4)->segment_attention(q, k, v, segment_view, longest, head_dim, scale, out_four.view()).ok());
        CHECK(same_bits(out_one, out_four));
        Compare cmp{2e-6, 2e-6};
        for (int64_t s = 0; s < segments; s++)
          for (int64_t t = starts[size_t(s)]; t < starts[size_t(s + 1)]; t++) {
            std::vector<double> ref = reference_segment_attention(qkv, hc.heads, hc.kv_heads, head_dim, scale, t,
                                                                  starts[size_t(s)], starts[size_t(s + 1)]);
            for (int64_t c = 0; c < hc.heads * head_dim; c++) cmp(out_one.get(t, c), ref[size_t(c)], t, c);
          }
        CHECK_COMPARE(cmp);
        CHECK(out_one.padding_untouched());
      }
}

TEST_CASE("segment_attention refuses segments that do not cover the rows or exceed max_segment") {
  auto backend = cpu(2);
  Random rng(86);
  Matrix qkv(DType::F32, 10, 3 * 32), out(DType::F32, 10, 32);
  qkv.randomize(rng);
  Tensor q = qkv.view().slice_cols(0, 32), k = qkv.view().slice_cols(32, 32), v = qkv.view().slice_cols(64, 32);
  std::vector<int32_t> short_of_rows = {0, 4, 9};
  Status status = backend->segment_attention(q, k, v, Tensor::vector(short_of_rows.data(), DType::I32, 3), 10, 16,
                                             0.25f, out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("from 0 to 9") != std::string::npos);
  std::vector<int32_t> starts = {0, 3, 10};
  status = backend->segment_attention(q, k, v, Tensor::vector(starts.data(), DType::I32, 3), 5, 16, 0.25f, out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("segment 1 runs from row 3 to 10") != std::string::npos);
  status = backend->segment_attention(q, k, v, Tensor::vector(starts.data(), DType::I32, 3), 7, 12, 0.25f, out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("head_dim 12") != std::string::npos);
  CHECK(backend->segment_attention(q, k, v, Tensor::vector(starts.data(), DType::I32, 3), 7, 16, 0.25f, out.view()).ok());
}

// ---- refusals and capabilities ------------------------------------------------------------------------------

TEST_CASE("ops refuse bad shapes, unsupported dtypes and impossible batches with the numbers") {
  auto backend = cpu(2);
  Random rng(71);
  Matrix x(DType::F32, 3, 64), weight(DType::BF16, 10, 65), out(DType::F32, 3, 10);
  x.randomize(rng);
  weight.randomize(rng);
  Status status = backend->linear(x.view(), weight.view(), Tensor{}, out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().code == ErrorCode::invalid_argument);
  CHECK(status.error().message.find("in_features") != std::string::npos);

  Matrix fp8_weight(DType::F32, 10, 64);
  Tensor fp8_view = fp8_weight.view();
  fp8_view.dtype = DType::F8_E4M3;
  status = backend->linear(x.view(), fp8_view, Tensor{}, out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().code == ErrorCode::unsupported);
  CHECK(status.error().message.find("F8_E4M3") != std::string::npos);

  Matrix norm_weight(DType::F32, 1, 48);
  status = backend->rms_norm(x.view(), norm_weight.view(), 1e-6f, x.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("multiple") != std::string::npos);

  // A residual that partly overlaps out.
  Matrix buffer(DType::F32, 4, 64);
  buffer.randomize(rng);
  Matrix ln(DType::F32, 1, 64);
  ln.randomize(rng);
  status = backend->add_rms_norm(x.view(), buffer.view().slice_rows(0, 3), ln.view(), 1e-6f, buffer.view().slice_rows(1, 3));
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("overlaps") != std::string::npos);

  // Column halves of one fused buffer interleave without sharing a byte: silu_mul may write over gate while up
  // sits beside it, at any width (width 1: every byte of the two halves alternates; found on a GPU, whose
  // test runs this case). A view shifted by one column into up does share bytes.
  for (int64_t width : {1, 3, 32}) {
    CAPTURE(width);
    Matrix gate_up(DType::F32, 5, 2 * width);
    gate_up.randomize(rng);
    const Tensor gate = gate_up.view().slice_cols(0, width), up = gate_up.view().slice_cols(width, width);
    CHECK(backend->silu_mul(gate, up, gate).ok());
    CHECK(backend->silu_mul(gate, up, up).ok());
    if (width == 1) continue;  // (one column on: that is up itself)
    const Tensor shifted = gate_up.view().slice_cols(1, width);
    status = backend->silu_mul(gate, up, shifted);
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().message.find("overlaps") != std::string::npos);
  }

  // Attention: a sequence whose context is shorter than its queries, a page that does not exist, a head_dim
  // larger than the backend was made for.
  std::vector<int64_t> contexts = {6};
  PagedFixture fx(4, 2, 16, 5, DType::F32, contexts, rng);
  Matrix q(DType::F32, 4, 64), attn_out(DType::F32, 4, 64);
  q.randomize(rng);
  std::vector<int32_t> starts = {0, 4}, lens = {3}, tables = fx.block_tables({0});
  AttentionBatch batch;
  batch.query_starts = Tensor::vector(starts.data(), DType::I32, 2);
  batch.context_lens = Tensor::vector(lens.data(), DType::I32, 1);
  batch.block_tables = Tensor::matrix(tables.data(), DType::I32, 1, fx.max_pages_per_seq);
  batch.max_context = 6;
  status = backend->attention(q.view(), fx.cache(), 1, batch, 0.25f, attn_out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("context_lens 3") != std::string::npos);
  lens[0] = 6;
  tables[1] = int32_t(fx.num_pages);
  status = backend->attention(q.view(), fx.cache(), 1, batch, 0.25f, attn_out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("block_tables[0][1]") != std::string::npos);
  tables = fx.block_tables({0});
  batch.block_tables.data = tables.data();
  CHECK(backend->attention(q.view(), fx.cache(), 1, batch, 0.25f, attn_out.view()).ok());

  PagedFixture wide(2, 1, 128, 4, DType::F32, contexts, rng);  // the backend was made with max_head_dim 64
  Matrix wide_q(DType::F32, 4, 256), wide_out(DType::F32, 4, 256);
  wide_q.randomize(rng);
  std::vector<int32_t> wide_tables = wide.block_tables({0});
  batch.block_tables = Tensor::matrix(wide_tables.data(), DType::I32, 1, wide.max_pages_per_seq);
  status = backend->attention(wide_q.view(), wide.cache(), 1, batch, 0.1f, wide_out.view());
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("max_head_dim") != std::string::npos);

  std::vector<int32_t> slots = {0, 1, int32_t(fx.num_pages * 5), 3};
  Matrix kv(DType::F32, 4, 32);
  kv.randomize(rng);
  status = backend->kv_write(fx.cache(), 1, kv.view(), kv.view(), Tensor::vector(slots.data(), DType::I32, 4));
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("slots[2]") != std::string::npos);
  status = backend->kv_write(fx.cache(), 2, kv.view(), kv.view(), Tensor::vector(slots.data(), DType::I32, 4));
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message.find("layer 2") != std::string::npos);
}

TEST_CASE("rope_kv_write is rope then kv_write, and refuses a k that is not qk's last columns") {
  auto backend = cpu(2);
  Random rng(62), tables_a(63), tables_b(63);
  PagedFixture fused(4, 2, 16, 5, DType::BF16, {13}, tables_a), split(4, 2, 16, 5, DType::BF16, {13}, tables_b);
  const int64_t qk_cols = 6 * 16, width = 32, tokens = 13;
  Matrix x(DType::F32, tokens, qk_cols + width, 2), cos(DType::F32, tokens, 6), sin(DType::F32, tokens, 6);
  x.randomize(rng);
  cos.randomize(rng);
  sin.randomize(rng);
  Matrix y = x;
  std::vector<int32_t> slots(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; t++) slots[size_t(t)] = t == 4 ? -1 : fused.slot(0, t);  // token 4: padding
  const Tensor slot_view = Tensor::vector(slots.data(), DType::I32, tokens);
  const Tensor xs = x.view(), ys = y.view();
  // head_dim 16 with 6 frequencies: dims 12 .. 15 of each head are left alone (partial rotary)
  REQUIRE(backend->rope_kv_write(xs.slice_cols(0, qk_cols), cos.view(), sin.view(), 16, fused.cache(), 1,
                                 xs.slice_cols(64, width), xs.slice_cols(qk_cols, width), slot_view).ok());
  REQUIRE(backend->rope(ys.slice_cols(0, qk_cols), cos.view(), sin.view(), 16).ok());
  REQUIRE(backend->kv_write(split.cache(), 1, ys.slice_cols(64, width), ys.slice_cols(qk_cols, width), slot_view).ok());
  CHECK(x.bytes == y.bytes);
  CHECK(fused.pages == split.pages);
  int64_t stored = 0;
  for (size_t i = 0; i < fused.pages.size(); i += 2) stored += !std::isnan(decode(DType::BF16, &fused.pages[i]));
  CHECK(stored == 12 * 2 * width);  // every token but the padding, K and V
  // k must be the keys the rope rotates: qk's last columns, row for row
  for (const Tensor& k : {xs.slice_cols(32, width), xs.slice_cols(64, width).slice_rows(0, 12)}) {
    const Status refused = backend->rope_kv_write(xs.slice_cols(0, qk_cols), cos.view(), sin.view(), 16, fused.cache(),
                                                  1, k, xs.slice_cols(qk_cols, width).slice_rows(0, k.rows),
                                                  slot_view);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.error().code == ErrorCode::invalid_argument);
  }
}

TEST_CASE("supports() says what the CPU backend runs") {
  auto backend = cpu(1);
  CHECK(backend->kind() == BackendKind::cpu);
  CHECK(backend->activation_dtype() == DType::F32);
  CHECK(backend->name() == "cpu (1 thread)");
  for (Op op : {Op::gather_rows, Op::rms_norm, Op::add_rms_norm, Op::linear, Op::copy, Op::kv_write, Op::attention,
                Op::embedding_bag, Op::layer_norm}) {
    CAPTURE(op_name(op));
    for (DType dtype : kWeightTypes) CHECK(backend->supports(op, dtype));
    // e4m3 is a KV cache element (with per-layer scales), nothing else's
    CHECK(backend->supports(op, DType::F8_E4M3) == (op == Op::kv_write || op == Op::attention));
    CHECK_FALSE(backend->supports(op, DType::I32));
  }
  for (Op op : {Op::rope, Op::silu_mul, Op::add, Op::gelu, Op::segment_attention}) {
    CHECK(backend->supports(op, DType::F32));
    CHECK_FALSE(backend->supports(op, DType::BF16));
  }
}

// ---- op timing ----------------------------------------------------------------------------------------------------

TEST_CASE("op timing counts each op's calls and wall time only while it is on, and changes no result") {
  auto backend = cpu(2);
  Random rng(91);
  Matrix a(DType::F32, 33, 257), b(DType::F32, 33, 257), scratch(DType::F32, 33, 257);
  Matrix timed(DType::F32, 33, 257), untimed(DType::F32, 33, 257);
  a.randomize(rng);
  b.randomize(rng);
  auto calls = [&](Op op) { return backend->op_times()[size_t(op)].calls; };
  CHECK_FALSE(backend->op_timing());
  REQUIRE(backend->add(a.view(), b.view(), untimed.view()).ok());
  CHECK(calls(Op::add) == 0);  // off: nothing counted
  backend->set_op_timing(true);
  CHECK(backend->op_timing());
  for (int i = 0; i < 3; i++) REQUIRE(backend->add(a.view(), b.view(), timed.view()).ok());
  REQUIRE(backend->silu_mul(a.view(), b.view(), scratch.view()).ok());
  CHECK(calls(Op::add) == 3);
  CHECK(calls(Op::silu_mul) == 1);
  CHECK(backend->op_times()[size_t(Op::add)].seconds > 0.0);
  CHECK(same_bits(timed, untimed));
  // a call refused by validation runs nothing and is not counted
  Matrix wrong(DType::F32, 2, 2);
  CHECK_FALSE(backend->add(a.view(), wrong.view(), timed.view()).ok());
  CHECK(calls(Op::add) == 3);
  for (int i = 0; i < kOpCount; i++) {
    CAPTURE(op_name(Op(i)));
    if (Op(i) != Op::add && Op(i) != Op::silu_mul) CHECK(backend->op_times()[size_t(i)].calls == 0);
  }
  backend->set_op_timing(false);
  REQUIRE(backend->add(a.view(), b.view(), timed.view()).ok());
  CHECK(calls(Op::add) == 3);  // off again: the totals stay as they were
}
