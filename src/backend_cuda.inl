// backend_cuda: without KVLITE_WITH_CUDA the CUDA backend's entry points say it was not built (kernels.cu
// defines them otherwise).
#if !defined(KVLITE_WITH_CUDA)
namespace kvlite {

Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendOptions&) {
  return Error(ErrorCode::unsupported, "make_cuda_backend: kvlite was built without CUDA (no nvcc found at build "
                                       "time); rebuild with the CUDA toolkit to use a GPU");
}

namespace cuda {
Status argmax(Backend&, const Tensor&, const Tensor&) {
  return Error(ErrorCode::unsupported, "cuda::argmax: kvlite was built without CUDA");
}
Result<void*> backend_stream(Backend&) {
  return Error(ErrorCode::unsupported, "cuda::backend_stream: kvlite was built without CUDA");
}
uint64_t device_allocations() { return 0; }
Result<QuantWeight> upload_quant_weight(Backend&, const QuantWeight& host, void*, uint64_t) {
  return Error(ErrorCode::unsupported,
               detail::format("cuda::upload_quant_weight(%s): kvlite was built without CUDA", host.name.c_str()));
}
Result<QuantWeight> upload_quant_weight(Backend&, const std::vector<const QuantWeight*>& parts, void*, uint64_t) {
  return Error(ErrorCode::unsupported,
               detail::format("cuda::upload_quant_weight(%s, ...): kvlite was built without CUDA",
                              parts.empty() ? "" : parts[0]->name.c_str()));
}
Status set_quant_kernel(Backend&, QuantKernel) {
  return Error(ErrorCode::unsupported, "cuda::set_quant_kernel: kvlite was built without CUDA");
}
Status sample(Backend&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  return Error(ErrorCode::unsupported, "cuda::sample: kvlite was built without CUDA");
}
Result<double> copy_bandwidth(Backend&, void*, const void*, uint64_t, int) {
  return Error(ErrorCode::unsupported, "cuda::copy_bandwidth: kvlite was built without CUDA");
}
Result<CudaGraph> capture_graph(Backend&, const std::function<void()>&) {
  return Error(ErrorCode::unsupported, "cuda::capture_graph: kvlite was built without CUDA");
}
Status launch_graph(Backend&, const CudaGraph&) {
  return Error(ErrorCode::unsupported, "cuda::launch_graph: kvlite was built without CUDA");
}
}  // namespace cuda

// Without CUDA no graph is ever captured: there is nothing to release.
CudaGraph::~CudaGraph() = default;
CudaGraph& CudaGraph::operator=(CudaGraph&& other) noexcept {
  std::swap(exec_, other.exec_);
  return *this;
}

}  // namespace kvlite
#endif  // !KVLITE_WITH_CUDA

namespace kvlite {
namespace cuda {
uint64_t quant_device_bytes(const QuantWeight& host) { return quant_gpu_layout(host).total_bytes; }
uint64_t quant_device_bytes(const LinearDesc& linear) { return quant_gpu_layout(linear).total_bytes; }
uint64_t quant_device_bytes(const std::vector<const QuantWeight*>& parts) { return quant_gpu_layout(parts).total_bytes; }
uint64_t quant_device_bytes(const std::vector<const LinearDesc*>& parts) { return quant_gpu_layout(parts).total_bytes; }

// The host twin of kernels.cu's sample_kernel: the same phases, each a loop where the kernel has a block-wide
// reduction or histogram (integer sums: the same totals in any order; the double sum of the softmax is taken in
// id order here and in a fixed tree there).
int32_t sample_row_reference(const float* logits, int64_t vocab, const DeviceSamplingParams& p, float* scratch) {
  // ---- phase 1: the argmax (greedy's answer; the largest key's token), the largest logit
  int32_t first = -1;
  float max_logit = -INFINITY;
  for (int64_t i = 0; i < vocab; i++)
    if (argmax_better(logits[i], int32_t(i), max_logit, first < 0 ? INT32_MAX : first)) {
      max_logit = logits[i];
      first = int32_t(i);
    }
  if (first < 0) return 0;  // every logit NaN
  if (p.temperature == 0.0f) return first;
  auto key_of = [&](int64_t i) { return sampling_key((logits[i] - max_logit) / p.temperature, int32_t(i)); };
  // The key of the first candidate (in order) at which the running weight reaches `target`; false if none.
  auto select = [&](auto weight, auto candidate, uint64_t target, uint64_t* key) {
    uint64_t prefix = 0, before = 0;
    for (int pass = 0; pass < kSamplingPasses; pass++) {
      unsigned long long bins[kSamplingBins] = {};
      const uint64_t decided = sampling_decided_mask(pass);
      for (int64_t i = 0; i < vocab; i++) {
        const uint64_t k = key_of(i);
        if ((k & decided) == prefix && candidate(i, k)) bins[sampling_digit(k, pass)] += weight(i);
      }
      const int bin = sampling_select_bin(bins, target, &before);
      if (bin < 0) return false;
      prefix |= uint64_t(bin) << (56 - kSamplingDigitBits * pass);
    }
    *key = prefix;
    return true;
  };
  auto one = [](int64_t) { return 1ull; };
  auto mass = [&](int64_t i) { return (unsigned long long)sampling_mass(scratch[i]); };

  // ---- phase 2: top-k: the candidates are the keys from the top_k-th on up
  uint64_t cutoff = 0;
  if (p.top_k > 0 && p.top_k < vocab) select(one, [](int64_t, uint64_t) { return true; }, uint64_t(p.top_k), &cutoff);
  // ---- phase 3: softmax over the candidates (the others get probability 0)
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; i++)
    if (key_of(i) >= cutoff) sum += std::exp(double((logits[i] - max_logit) / p.temperature));
  for (int64_t i = 0; i < vocab; i++)
    scratch[i] = key_of(i) >= cutoff ? float(std::exp(double((logits[i] - max_logit) / p.temperature)) / sum) : 0.0f;
  // ---- phase 4: top-p: the shortest prefix whose mass reaches top_p (all candidates when none does)
  if (p.top_p < 1.0f) {
    uint64_t key;
    if (select(mass, [&](int64_t, uint64_t k) { return k >= cutoff; }, top_p_target(p.top_p), &key)) cutoff = key;
  }
  // ---- phase 5: min-p: of those, the tokens at least min_p x the first one's probability (a prefix too)
  const float threshold = p.min_p > 0.0f ? p.min_p * scratch[first] : 0.0f;
  auto kept = [&](int64_t i, uint64_t k) { return k >= cutoff && scratch[i] >= threshold; };
  // ---- phase 6: the draw
  uint64_t total = 0;
  for (int64_t i = 0; i < vocab; i++)
    if (kept(i, key_of(i))) total += sampling_mass(scratch[i]);
  uint64_t key;
  if (total == 0 || !select(mass, kept, draw_target(p.draw, total), &key)) return first;
  return sampling_key_id(key);
}

}  // namespace cuda
}  // namespace kvlite
