// cuda-host: the CUDA backend's index math (the __host__ __device__ functions of backend_cuda.hpp that its
// kernels run) checked on the CPU against plain references, and make_cuda_backend's option checks, which
// run before any GPU is touched. Needs no GPU and no CUDA.
#include <doctest/doctest.h>
#include "kvlite.hpp"

#include <algorithm>
#include <cmath>
#include <random>

using namespace kvlite;

namespace {

struct Random {
  std::mt19937_64 engine;
  explicit Random(uint64_t seed) : engine(seed) {}
  int64_t below(int64_t n) { return int64_t(engine() % uint64_t(n)); }
  int64_t between(int64_t lo, int64_t hi) { return lo + below(hi - lo + 1); }  // inclusive
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(engine); }
};

// Softmax-weighted average of values under scores, in double: the reference for online/merged softmax.
double softmax_average(const std::vector<float>& scores, const std::vector<float>& values) {
  double top = -INFINITY;
  for (float s : scores) top = std::max(top, double(s));
  double sum = 0, acc = 0;
  for (size_t i = 0; i < scores.size(); i++) {
    const double w = std::exp(double(scores[i]) - top);
    sum += w;
    acc += w * values[i];
  }
  return acc / sum;
}

// A softmax partial as the kernels keep it: running maximum, sum of weights, weighted sum of values.
struct Partial {
  float max = -INFINITY, sum = 0.0f, acc = 0.0f;
  void add(float score, float value) {
    const cuda::SoftmaxStep step = cuda::online_softmax_step(score, max, sum);
    acc = acc * step.rescale + step.weight * value;
  }
};
// Merges partials as the attention kernels do (warps of a block, then splits).
Partial merge(const std::vector<Partial>& parts) {
  Partial total;
  for (const Partial& p : parts) total.max = std::max(total.max, p.max);
  float sum = 0.0f, acc = 0.0f;
  for (const Partial& p : parts) {
    const float factor = cuda::softmax_partial_factor(p.max, total.max);
    sum += p.sum * factor;
    acc += p.acc * factor;
  }
  total.sum = sum;
  total.acc = acc;
  return total;
}

// argmax_kernel simulated: `threads` threads scan strides of the row, 32-lane butterflies reduce each warp,
// then the first warp reduces the warps' winners. Returns the id the kernel stores.
int32_t simulated_argmax_kernel(const std::vector<float>& row, int threads) {
  const int warps = threads / 32;
  std::vector<float> value(size_t(threads), -INFINITY);
  std::vector<int32_t> index(size_t(threads), INT_MAX);
  for (int t = 0; t < threads; t++)
    for (size_t c = size_t(t); c < row.size(); c += size_t(threads))
      if (cuda::argmax_better(row[c], int32_t(c), value[size_t(t)], index[size_t(t)])) {
        value[size_t(t)] = row[c];
        index[size_t(t)] = int32_t(c);
      }
  // One butterfly over lanes [base, base + 32): every lane ends with the warp's winner.
  auto butterfly = [&](std::vector<float>& v, std::vector<int32_t>& i, size_t base) {
    for (int offset = 16; offset > 0; offset >>= 1) {
      std::vector<float> v2(v.begin() + long(base), v.begin() + long(base) + 32);
      std::vector<int32_t> i2(i.begin() + long(base), i.begin() + long(base) + 32);
      for (int lane = 0; lane < 32; lane++) {
        const int other = lane ^ offset;
        if (cuda::argmax_better(v2[size_t(other)], i2[size_t(other)], v2[size_t(lane)], i2[size_t(lane)])) {
          v[base + size_t(lane)] = v2[size_t(other)];
          i[base + size_t(lane)] = i2[size_t(other)];
        }
      }
    }
  };
  for (int w = 0; w < warps; w++) butterfly(value, index, size_t(w) * 32);
  std::vector<float> warp_value(32, -INFINITY);
  std::vector<int32_t> warp_index(32, INT_MAX);
  for (int w = 0; w < warps; w++) {
    warp_value[size_t(w)] = value[size_t(w) * 32];
    warp_index[size_t(w)] = index[size_t(w) * 32];
  }
  butterfly(warp_value, warp_index, 0);
  return warp_index[0] == INT_MAX ? 0 : warp_index[0];
}

}  // namespace

TEST_CASE("sequence_of_row finds the sequence that owns each query row, as a linear scan does") {
  Random rng(11);
  for (int trial = 0; trial < 400; trial++) {
    const int64_t seqs = rng.between(1, 9);
    std::vector<int32_t> starts(size_t(seqs + 1));
    starts[0] = trial % 7 == 0 ? int32_t(rng.between(1, 3)) : 0;  // sometimes malformed: rows before it
    for (int64_t s = 1; s <= seqs; s++) starts[size_t(s)] = starts[size_t(s - 1)] + int32_t(rng.between(0, 4));
    for (int64_t row = 0; row < starts[size_t(seqs)] + 3; row++) {
      // the reference: the last s with starts[s] <= row < starts[s + 1]
      int64_t expected = -1;
      for (int64_t s = 0; s < seqs; s++)
        if (starts[size_t(s)] <= row && row < starts[size_t(s + 1)]) expected = s;
      INFO("trial ", trial, " row ", row);
      CHECK(cuda::sequence_of_row(starts.data(), seqs, row) == expected);
    }
  }
  const int32_t none[1] = {0};
  CHECK(cuda::sequence_of_row(none, 0, 0) == -1);
}

TEST_CASE("online softmax steps, and partials merged in any split, equal a direct softmax") {
  Random rng(12);
  for (int trial = 0; trial < 300; trial++) {
    const int64_t n = rng.between(1, 300);
    const float spread = trial % 3 == 0 ? 200.0f : 8.0f;  // large spreads would overflow a plain exp
    std::vector<float> scores(static_cast<size_t>(n)), values(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; i++) {
      scores[size_t(i)] = rng.uniform(-spread, spread);
      values[size_t(i)] = rng.uniform(-2.0f, 2.0f);
    }
    const double expected = softmax_average(scores, values);
    double value_scale = 0;
    for (float v : values) value_scale = std::max(value_scale, double(std::fabs(v)));

    Partial whole;
    for (int64_t i = 0; i < n; i++) whole.add(scores[size_t(i)], values[size_t(i)]);
    INFO("trial ", trial, " n ", n);
    CHECK(std::fabs(whole.acc / whole.sum - expected) <= 1e-5 * value_scale);

    // Splits of a random chunk size, each split's keys dealt to 4 warps as the kernel does; some of the
    // partials see no key at all (a chunk past the last key, a warp with nothing left).
    const int64_t chunk = rng.between(1, n + 5), splits = (n + chunk - 1) / chunk + rng.between(0, 2);
    std::vector<Partial> split_partials;
    for (int64_t split = 0; split < splits; split++) {
      int64_t begin, end;
      cuda::split_key_range(split, chunk, n - 1, &begin, &end);
      std::vector<Partial> warps(4);
      for (int64_t key = begin; key < end; key++) warps[size_t((key - begin) % 4)].add(scores[size_t(key)], values[size_t(key)]);
      split_partials.push_back(merge(warps));
    }
    const Partial merged = merge(split_partials);
    CHECK(std::fabs(merged.acc / merged.sum - expected) <= 1e-5 * value_scale);
  }
  // Nothing seen anywhere: factor 0 everywhere, and 0 / 0 marks the output NaN.
  const Partial nothing = merge({Partial(), Partial()});
  CHECK(nothing.sum == 0.0f);
  CHECK(std::isnan(nothing.acc / nothing.sum));
}

TEST_CASE("split_key_range deals keys 0..last to the splits exactly once") {
  Random rng(13);
  for (int trial = 0; trial < 500; trial++) {
    const int64_t last = rng.between(-1, 400), chunk = rng.between(1, 100);
    const int64_t splits = std::max<int64_t>(1, (last + 1 + chunk - 1) / chunk) + rng.between(0, 3);
    std::vector<int> seen(size_t(last + 1), 0);
    for (int64_t split = 0; split < splits; split++) {
      int64_t begin, end;
      cuda::split_key_range(split, chunk, last, &begin, &end);
      REQUIRE(begin <= end);
      CHECK(end - begin <= chunk);
      for (int64_t key = begin; key < end; key++) {
        REQUIRE(key >= 0);
        REQUIRE(key <= last);
        seen[size_t(key)]++;
      }
    }
    for (int64_t key = 0; key <= last; key++) CHECK(seen[size_t(key)] == 1);
  }
}

TEST_CASE("each query splits its own keys: every key once, chunks of kAttentionMinChunk or more, none empty") {
  Random rng(16);
  for (int trial = 0; trial < 3000; trial++) {
    const int64_t planned = rng.between(1, cuda::kAttentionMaxSplits);
    const int64_t keys = trial % 3 == 0 ? rng.between(0, 300) : rng.between(0, 40000);
    const int64_t used = cuda::attention_splits_used(planned, keys);
    const int64_t chunk = cuda::attention_chunk(planned, keys);
    INFO("planned ", planned, " keys ", keys, " -> used ", used, " chunk ", chunk);
    REQUIRE(used >= 1);
    REQUIRE(used <= planned);
    if (used > 1) CHECK(chunk >= cuda::kAttentionMinChunk);
    // as many splits as chunks of kMinChunk allow when the grid has them, less what rounding the chunk up empties:
    // chunk <= keys / wanted + 1 with keys >= kMinChunk x wanted, so used >= wanted x kMinChunk / (kMinChunk + 1)
    const int64_t wanted = std::min<int64_t>(planned, std::max<int64_t>(1, keys / cuda::kAttentionMinChunk));
    CHECK(used <= wanted);
    CHECK(used * (cuda::kAttentionMinChunk + 1) >= wanted * cuda::kAttentionMinChunk);
    std::vector<int> seen(size_t(keys), 0);
    for (int64_t split = 0; split < planned; split++) {
      int64_t begin, end;
      cuda::split_key_range(split, chunk, keys - 1, &begin, &end);
      if (split < used && keys > 0) CHECK(end > begin);  // a used split holds keys
      if (split >= used) CHECK(end == begin);            // the others are empty
      for (int64_t key = begin; key < end; key++) seen[size_t(key)]++;
    }
    for (int64_t key = 0; key < keys; key++) REQUIRE(seen[size_t(key)] == 1);
  }
  // A graph captured for a long max_model_len: a short context uses few splits, a longer one all the grid has.
  CHECK(cuda::attention_splits_used(66, 10) == 1);
  CHECK(cuda::attention_splits_used(66, 50) == 3);
  CHECK(cuda::attention_chunk(66, 50) == 17);
  CHECK(cuda::attention_splits_used(66, 3000) == 66);
  CHECK(cuda::attention_chunk(66, 3000) == 46);
}

TEST_CASE("plan_attention_split fills the GPU without empty splits, short chunks or scratch overflow") {
  Random rng(14);
  for (int trial = 0; trial < 2000; trial++) {
    const int64_t blocks = rng.between(1, 600), max_context = rng.between(0, 40000);
    const int64_t target = rng.between(32, 1000);
    const uint64_t partial_bytes = uint64_t(rng.between(0, 1) ? rng.between(1, 1 << 20) : 0);
    const uint64_t scratch = uint64_t(rng.between(0, 64 << 20));
    const cuda::AttentionSplit plan = cuda::plan_attention_split(blocks, max_context, target, partial_bytes, scratch);
    INFO("blocks ", blocks, " max_context ", max_context, " target ", target, " partial ", partial_bytes,
         " scratch ", scratch, " -> splits ", plan.splits, " chunk ", plan.chunk);
    REQUIRE(plan.splits >= 1);
    REQUIRE(plan.chunk >= 1);
    CHECK(plan.splits * plan.chunk >= max_context);  // every key has a split
    if (plan.splits == 1) {
      CHECK(plan.chunk >= max_context);
      continue;
    }
    CHECK(blocks < target);                              // split only when the rows leave the GPU idle
    CHECK((plan.splits - 1) * plan.chunk < max_context);  // the last split holds keys
    CHECK(plan.chunk >= cuda::kAttentionMinChunk);
    CHECK(plan.splits <= cuda::kAttentionMaxSplits);
    CHECK(uint64_t(plan.splits) * partial_bytes <= scratch);
    CHECK(blocks * (plan.splits - 1) < target);  // no more splits than the target asks for
  }
}

TEST_CASE("paged attention takes 8 warps a block while its grid fits one block an SM, 4 past that") {
  for (int64_t sms : {1, 28, 132}) {
    CAPTURE(sms);
    CHECK(cuda::paged_attention_warps(1, sms) == cuda::kPagedAttentionWarpsMany);
    CHECK(cuda::paged_attention_warps(sms, sms) == cuda::kPagedAttentionWarpsMany);
    CHECK(cuda::paged_attention_warps(sms + 1, sms) == cuda::kPagedAttentionWarpsFew);
  }
  // a batch-1 decode grid of Llama-3.1-8B on an H200 (1 x 8 x 8, ncu) and one of 8 rows
  CHECK(cuda::paged_attention_warps(1 * 8 * 8, 132) == 8);
  CHECK(cuda::paged_attention_warps(8 * 8 * 9, 132) == 4);
}

TEST_CASE("argmax_better in the kernel's reduction order gives the sampler's argmax: ties to the lowest id") {
  Random rng(15);
  for (int trial = 0; trial < 200; trial++) {
    const int64_t vocab = rng.between(1, 3000);
    std::vector<float> row(static_cast<size_t>(vocab));
    for (float& v : row) v = float(rng.between(-40, 40)) * 0.25f;  // coarse values: many ties
    if (trial % 5 == 0) row[size_t(rng.below(vocab))] = INFINITY;
    if (trial % 7 == 0)
      for (float& v : row) v = -INFINITY;
    const int threads = trial % 2 ? 512 : 64;
    INFO("trial ", trial, " vocab ", vocab);
    CHECK(simulated_argmax_kernel(row, threads) == kvlite::argmax(row.data(), vocab));
  }
  // NaN never wins (kvlite::argmax agrees whenever row[0] is not NaN); an all-NaN row gives 0.
  std::vector<float> row = {1.0f, NAN, 3.0f, NAN, 3.0f, 2.0f};
  CHECK(simulated_argmax_kernel(row, 64) == 2);
  CHECK(kvlite::argmax(row.data(), int64_t(row.size())) == 2);
  CHECK(simulated_argmax_kernel({NAN, NAN, NAN}, 64) == 0);
}

TEST_CASE("linear_gemm_shape drives a column-major cuBLAS GEMM to out = x @ w^T on strided views") {
  Random rng(16);
  for (int trial = 0; trial < 200; trial++) {
    const int64_t T = rng.between(1, 9), N = rng.between(1, 9), K = rng.between(1, 12);
    const int64_t x_stride = K + rng.between(0, 3), w_stride = K + rng.between(0, 3), out_stride = N + rng.between(0, 3);
    std::vector<float> x(size_t(T * x_stride)), w(size_t(N * w_stride)), out(size_t(T * out_stride), NAN);
    for (float& v : x) v = float(rng.between(-9, 9));  // small integers: sums are exact in any order
    for (float& v : w) v = float(rng.between(-9, 9));
    const Tensor xt{x.data(), DType::F32, T, K, x_stride}, wt{w.data(), DType::F32, N, K, w_stride};
    const Tensor ot{out.data(), DType::F32, T, N, out_stride};
    cuda::GemmShape s;
    REQUIRE(cuda::linear_gemm_shape(xt, wt, ot, &s));
    // cublasGemmEx(OP_T, OP_N, m, n, k, A, lda, B, ldb, C, ldc), column-major:
    //   C[i + j * ldc] = sum_l op_T(A)[i, l] * B[l, j] = sum_l A[l + i * lda] * B[l + j * ldb]
    REQUIRE(s.m == N);
    REQUIRE(s.n == T);
    REQUIRE(s.k == K);
    for (int i = 0; i < s.m; i++)
      for (int j = 0; j < s.n; j++) {
        float sum = 0;
        for (int l = 0; l < s.k; l++) sum += w[size_t(l + i * s.lda)] * x[size_t(l + j * s.ldb)];
        out[size_t(i + j * s.ldc)] = sum;
      }
    for (int64_t t = 0; t < T; t++)
      for (int64_t n = 0; n < N; n++) {
        float expected = 0;
        for (int64_t k = 0; k < K; k++) expected += x[size_t(t * x_stride + k)] * w[size_t(n * w_stride + k)];
        CHECK(out[size_t(t * out_stride + n)] == expected);
      }
    // cuBLAS requires lda >= k (op T), ldb >= k, ldc >= m
    CHECK(s.lda >= s.k);
    CHECK(s.ldb >= s.k);
    CHECK(s.ldc >= s.m);
  }
  // One-row views may carry any stride: the leading dimension is then their width.
  float dummy = 0;
  const Tensor x1{&dummy, DType::F32, 1, 5, 0}, w1{&dummy, DType::F32, 1, 5, 1}, o1{&dummy, DType::F32, 1, 1, 0};
  cuda::GemmShape s;
  REQUIRE(cuda::linear_gemm_shape(x1, w1, o1, &s));
  CHECK(s.lda == 5);
  CHECK(s.ldb == 5);
  CHECK(s.ldc == 1);
  const Tensor huge{&dummy, DType::BF16, 2, 8, int64_t(INT_MAX) + 1};
  CHECK_FALSE(cuda::linear_gemm_shape(huge, w1, o1, &s));
}

TEST_CASE("cuda_workspace_layout: cuBLAS first, then the fault record, then the scratch, all 256-aligned") {
  Random rng(17);
  for (int trial = 0; trial < 500; trial++) {
    const uint64_t cublas = uint64_t(rng.between(0, 40 << 20));
    const uint64_t total = uint64_t(rng.between(0, 80 << 20));
    cuda::CudaWorkspaceLayout l;
    const bool fits = cuda::cuda_workspace_layout(total, cublas, &l);
    INFO("total ", total, " cublas ", cublas);
    const uint64_t needed = cublas / 256 * 256 + 256 + kCudaMinScratchBytes;
    CHECK(fits == (total >= needed));
    if (!fits) continue;
    CHECK(l.cublas_offset == 0);
    CHECK(l.cublas_bytes <= cublas);
    CHECK(cublas - l.cublas_bytes < 256);
    CHECK(l.cublas_bytes % 256 == 0);
    CHECK(l.fault_offset >= l.cublas_offset + l.cublas_bytes);
    CHECK(l.fault_offset % 256 == 0);
    CHECK(l.scratch_offset >= l.fault_offset + 256);
    CHECK(l.scratch_offset % 256 == 0);
    CHECK(l.scratch_bytes >= kCudaMinScratchBytes);
    CHECK(l.scratch_offset + l.scratch_bytes == total);
  }
  cuda::CudaWorkspaceLayout l;
  CHECK(cuda::cuda_workspace_layout(kCudaWorkspaceBytes, kCudaCublasWorkspaceBytes, &l));
  CHECK(l.scratch_bytes + 256 == kCudaScratchBytes);
}

TEST_CASE("attention lanes cover every head_dim up to 256 with the compiled kernels and bounded registers") {
  for (int64_t head_dim = 1; head_dim <= kCudaMaxHeadDim; head_dim++) {
    const int dims = cuda::attention_dims_per_lane(head_dim);
    INFO("head_dim ", head_dim);
    CHECK(dims * 32 >= head_dim);
    CHECK((dims == 2 || dims == 3 || dims == 4 || dims == 8));
    // the common heads run without padding lanes: 64, 96 and 128 exactly, 80 in 3 steps, 256 exactly
    if (head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256) CHECK(dims * 32 == head_dim);
    if (head_dim > 64 && head_dim <= 128) CHECK(dims == (head_dim + 31) / 32);  // no step wider than needed
    CHECK(2 * cuda::attention_heads_per_block(dims) * dims <= 64);  // q and accumulators per lane
  }
  CHECK(cuda::attention_dims_per_lane(kCudaMaxHeadDim + 1) == 0);
  CHECK(cuda::attention_dims_per_lane(0) == 0);
}

TEST_CASE("attention pairs outside the tuned ones run the generic kernel, which covers every head_dim") {
  // tuned: KV in the activation type, or fp8; the rest, one generic shape
  CHECK(cuda::attention_pair_tuned(true, false));
  CHECK(cuda::attention_pair_tuned(false, true));
  CHECK_FALSE(cuda::attention_pair_tuned(false, false));
  for (int64_t head_dim = 1; head_dim <= kCudaMaxHeadDim; head_dim++) {
    INFO("head_dim ", head_dim);
    const int dims = cuda::attention_dims_per_lane(head_dim);
    CHECK(cuda::attention_kernel_dims(dims, true) == dims);
    const int generic = cuda::attention_kernel_dims(dims, false);
    CHECK(generic == cuda::kAttentionGenericDims);
    CHECK(generic * 32 >= head_dim);  // the generic shape's lanes cover the head
  }
  CHECK(cuda::attention_kernel_dims(0, false) == 0);  // too large a head stays refused
  CHECK(cuda::kAttentionGenericDims * 32 == kCudaMaxHeadDim);
  CHECK(2 * cuda::attention_heads_per_block(cuda::kAttentionGenericDims) * cuda::kAttentionGenericDims <= 64);
}

TEST_CASE("make_cuda_backend checks its options before touching a GPU") {
  if (!cuda::built_with_cuda()) {
    CudaBackendOptions options;
    auto backend = make_cuda_backend(options);
    REQUIRE_FALSE(backend.ok());
    CHECK(backend.error().code == ErrorCode::unsupported);
    CHECK(backend.error().message.find("without CUDA") != std::string::npos);
    return;
  }
  alignas(256) static uint8_t not_device_memory[1 << 20];
  CudaBackendOptions options;
  options.workspace = not_device_memory;
  options.workspace_bytes = sizeof(not_device_memory);
  options.cublas_workspace_bytes = 512 * KiB;

  SUBCASE("activation dtype") {
    options.activation_dtype = DType::I32;
    auto backend = make_cuda_backend(options);
    REQUIRE_FALSE(backend.ok());
    CHECK(backend.error().code == ErrorCode::invalid_argument);
    CHECK(backend.error().message.find("activation_dtype I32") != std::string::npos);
  }
  SUBCASE("null or misaligned workspace") {
    options.workspace = nullptr;
    auto null_workspace = make_cuda_backend(options);
    REQUIRE_FALSE(null_workspace.ok());
    CHECK(null_workspace.error().code == ErrorCode::invalid_argument);
    options.workspace = not_device_memory + 16;
    auto misaligned = make_cuda_backend(options);
    REQUIRE_FALSE(misaligned.ok());
    CHECK(misaligned.error().code == ErrorCode::invalid_argument);
    CHECK(misaligned.error().message.find("256-byte aligned") != std::string::npos);
  }
  SUBCASE("workspace too small for cuBLAS plus the scratch") {
    options.cublas_workspace_bytes = options.workspace_bytes;
    auto backend = make_cuda_backend(options);
    REQUIRE_FALSE(backend.ok());
    CHECK(backend.error().code == ErrorCode::invalid_argument);
    CHECK(backend.error().message.find("1.0 MiB") != std::string::npos);  // the workspace given
  }
  SUBCASE("host memory, or no GPU at all") {
    // Valid-looking options: without a GPU the device query fails cleanly; with one, the workspace is
    // found not to be device memory.
    auto backend = make_cuda_backend(options);
    REQUIRE_FALSE(backend.ok());
    if (cuda::device_count() == 0) {
      CHECK(backend.error().code == ErrorCode::device_error);
      CHECK(backend.error().message.find("no CUDA device") != std::string::npos);
    } else {
      CHECK(backend.error().code == ErrorCode::invalid_argument);
      CHECK(backend.error().message.find("not device memory") != std::string::npos);
    }
  }
}

TEST_CASE("cuda::argmax refuses a backend that is not CUDA") {
  auto cpu = make_cpu_backend({1, 64});
  REQUIRE(cpu.ok());
  std::vector<float> logits = {0.5f, 2.0f, -1.0f};
  int32_t id = -7;
  const Status status = cuda::argmax(**cpu, Tensor::matrix(logits.data(), DType::F32, 1, 3), Tensor::vector(&id, DType::I32, 1));
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().code == (cuda::built_with_cuda() ? ErrorCode::invalid_argument : ErrorCode::unsupported));
  CHECK(id == -7);  // untouched
}
