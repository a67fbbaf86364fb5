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
}  // namespace cuda

}  // namespace kvlite
#endif  // !KVLITE_WITH_CUDA
