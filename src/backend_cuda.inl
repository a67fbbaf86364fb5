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
uint64_t device_allocations() { return 0; }
Result<QuantWeight> upload_quant_weight(Backend&, const QuantWeight& host, void*, uint64_t) {
  return Error(ErrorCode::unsupported,
               detail::format("cuda::upload_quant_weight(%s): kvlite was built without CUDA", host.name.c_str()));
}
}  // namespace cuda

}  // namespace kvlite
#endif  // !KVLITE_WITH_CUDA

namespace kvlite {
namespace cuda {
// Until the GPU kernels choose their layouts (issue 6): the checkpoint's own bytes.
uint64_t quant_device_bytes(const QuantWeight& host) {
  const uint64_t n = uint64_t(host.out_features), k = uint64_t(host.in_features);
  uint64_t bytes = host.format == WeightFormat::int4 ? n * uint64_t(host.packed_cols) * 4 : n * k;
  bytes += dtype_bytes(host.scale_dtype, uint64_t(host.scale_rows * host.scale_cols));
  if (host.zero_points) bytes += ((n + 7) / 8) * uint64_t(host.scale_cols) * 4;
  if (host.g_idx) bytes += k * 4;
  if (host.bias) bytes += dtype_bytes(host.bias_dtype, n);
  return bytes;
}
}  // namespace cuda
}  // namespace kvlite
