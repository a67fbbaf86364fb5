// kernels.cu - kvlite's CUDA backend: the one CUDA file an app compiles next to kvlite.hpp.
//
// Device code and the thin host entry points declared in kvlite.hpp (namespace kvlite::cuda). Every CUDA call's
// status is checked and turned into a kvlite::Error naming the call; nothing here aborts or exits.
// Targets: sm_80, sm_86, sm_87 (Jetson Orin), sm_89, sm_90, sm_120, plus PTX for newer GPUs.
#include "kvlite.hpp"

#include <cuda_runtime.h>

namespace kvlite {
namespace cuda {
namespace {
// Turns a failed CUDA call into an Error that names the call and the driver's words.
Error cuda_error(cudaError_t status, const char* call) {
  return Error(ErrorCode::device_error,
               detail::format("%s failed: %s (%s)", call, cudaGetErrorString(status), cudaGetErrorName(status)));
}
#define KVLITE_CUDA_TRY(call)                                      \
  do {                                                             \
    cudaError_t kvlite_status_ = (call);                           \
    if (kvlite_status_ != cudaSuccess) return cuda_error(kvlite_status_, #call); \
  } while (0)
}  // namespace

bool built_with_cuda() { return true; }

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky status, report none
    return 0;
  }
  return count;
}

Result<DeviceSpec> query_device(int index) {
  cudaDeviceProp prop;
  KVLITE_CUDA_TRY(cudaGetDeviceProperties(&prop, index));
  KVLITE_CUDA_TRY(cudaSetDevice(index));
  size_t free_bytes = 0, total_bytes = 0;
  KVLITE_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  DeviceSpec spec;
  spec.backend = BackendKind::cuda;
  spec.name = prop.name;
  spec.total_bytes = total_bytes;
  spec.free_bytes = free_bytes;
  spec.sm = prop.major * 10 + prop.minor;
  spec.queried = true;
  return spec;
}

Result<void*> allocate_arena(uint64_t bytes) {
  void* pointer = nullptr;
  cudaError_t status = cudaMalloc(&pointer, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    return Error(ErrorCode::out_of_memory,
                 detail::format("cudaMalloc of the %s arena failed (%s): the device has %s free of %s; lower "
                                "--utilization or free the GPU",
                                format_bytes(bytes).c_str(), cudaGetErrorString(status),
                                format_bytes(free_bytes).c_str(), format_bytes(total_bytes).c_str()));
  }
  return pointer;
}

Status free_arena(void* pointer) {
  KVLITE_CUDA_TRY(cudaFree(pointer));
  return Status();
}

Result<std::pair<uint64_t, uint64_t>> memory_info() {
  size_t free_bytes = 0, total_bytes = 0;
  KVLITE_CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
  return std::pair<uint64_t, uint64_t>(free_bytes, total_bytes);
}

}  // namespace cuda
}  // namespace kvlite
