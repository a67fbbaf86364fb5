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
Status set_quant_kernel(Backend&, QuantKernel) {
  return Error(ErrorCode::unsupported, "cuda::set_quant_kernel: kvlite was built without CUDA");
}
}  // namespace cuda

}  // namespace kvlite
#endif  // !KVLITE_WITH_CUDA

namespace kvlite {
namespace cuda {
uint64_t quant_device_bytes(const QuantWeight& host) { return quant_gpu_layout(host).total_bytes; }
uint64_t quant_device_bytes(const LinearDesc& linear) { return quant_gpu_layout(linear).total_bytes; }
}  // namespace cuda
}  // namespace kvlite
