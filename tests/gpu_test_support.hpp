// What the CUDA tests (unit-cuda-*.cpp) share: GPU_OR_SKIP, so that a case without a usable CUDA GPU (or in a
// build without CUDA) says "no CUDA GPU: skipped" and passes, unless KVLITE_REQUIRE_GPU=1 (tools/gpu-check.sh
// sets it), when it fails; REQUIRE_OK for a Status or Result; DeviceMemory, one device reservation per test.
#pragma once
#include <doctest/doctest.h>
#include "kvlite.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

namespace gpu_test {

// True under KVLITE_REQUIRE_GPU=1: a missing GPU is then a failure, not a skip.
inline bool gpu_required() {
  const char* value = std::getenv("KVLITE_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}
inline bool gpu_present() { return kvlite::cuda::built_with_cuda() && kvlite::cuda::device_count() > 0; }

// One reservation per test (cuda::allocate_arena, the library's one cudaMalloc), handed out in 256-byte aligned
// pieces.
class DeviceMemory {
 public:
  explicit DeviceMemory(uint64_t bytes) : size_(bytes) {
    auto reserved = kvlite::cuda::allocate_arena(bytes);
    if (!reserved.ok()) FAIL(reserved.error().message);
    base_ = static_cast<uint8_t*>(*reserved);
  }
  ~DeviceMemory() {
    if (base_ != nullptr) (void)kvlite::cuda::free_arena(base_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* take(uint64_t bytes) {
    const uint64_t offset = kvlite::align_up(used_, 256);
    REQUIRE(offset + bytes <= size_);
    used_ = offset + std::max<uint64_t>(bytes, 1);
    return base_ + offset;
  }
  // `skew` bytes past a 256-byte boundary, to test misaligned operands.
  void* take_unaligned(uint64_t bytes, uint64_t skew) { return static_cast<uint8_t*>(take(bytes + skew)) + skew; }

 private:
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0, used_ = 0;
};

}  // namespace gpu_test

// Ends the test case (passing, with a message) without a usable CUDA GPU, or fails under KVLITE_REQUIRE_GPU=1.
#define GPU_OR_SKIP()                                                                                         \
  do {                                                                                                        \
    if (!gpu_test::gpu_present()) {                                                                           \
      if (gpu_test::gpu_required())                                                                           \
        FAIL("KVLITE_REQUIRE_GPU=1 but no CUDA GPU is usable (built with CUDA: "                              \
             << std::string(kvlite::cuda::built_with_cuda() ? "yes" : "no")                                   \
             << ", devices: " << kvlite::cuda::device_count() << ")");                                        \
      MESSAGE("no CUDA GPU: skipped");                                                                        \
      return;                                                                                                 \
    }                                                                                                         \
  } while (0)

// Fails the test case with the library's message when a Status or Result is not ok.
#define REQUIRE_OK(expr)                                            \
  do {                                                              \
    const auto& kvlite_status_ = (expr);                            \
    if (!kvlite_status_.ok()) FAIL(kvlite_status_.error().message); \
  } while (0)
