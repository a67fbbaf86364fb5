// ---------------------------------------------------------------------------------------------------------
// device: what we plan for (a CUDA GPU, a planned-for card, or the CPU) and the few CUDA entry points the
// header's host code calls in kernels.cu. Without KVLITE_WITH_CUDA those entry points report "not built".
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

enum class BackendKind { cpu, cuda };
const char* backend_name(BackendKind kind);

struct DeviceSpec {
  BackendKind backend = BackendKind::cpu;
  std::string name;           // "NVIDIA GeForce RTX 4060", "planned 8.00 GiB card", "CPU"
  uint64_t total_bytes = 0;   // memory the plan divides (device memory, or --device-mem)
  uint64_t free_bytes = 0;    // free at query time (0 when unknown: a planned card)
  int sm = 0;                 // compute capability x 10 (86, 89, 90, ...); 0 when unknown
  bool wsl2 = false;          // Windows Subsystem for Linux 2: larger driver overhead, no large pinned memory
  bool queried = false;       // true when read from a real GPU
};

// True when the kernel release string names Microsoft (how WSL2 identifies itself).
bool running_under_wsl2();
// Physical memory of this machine (the CPU backend's "device").
uint64_t system_memory_bytes();

// The device to plan for. device_mem set: a CUDA card of that size (real or not), named "planned". Otherwise
// the first CUDA GPU when kvlite was built with CUDA and one is present, else the CPU with system memory.
// `wsl2` overrides detection when set.
Result<DeviceSpec> detect_device(std::optional<uint64_t> device_mem, std::optional<bool> wsl2);

// ---- CUDA entry points (kernels.cu) ---------------------------------------------------------------------
namespace cuda {
bool built_with_cuda();
// Number of CUDA devices, 0 when none or when the driver is missing (never an error: no GPU is normal).
int device_count();
Result<DeviceSpec> query_device(int index);
// One reservation for the whole arena; the only device allocation kvlite makes.
Result<void*> allocate_arena(uint64_t bytes);
Status free_arena(void* pointer);
// (free, total) bytes as the driver sees them now.
Result<std::pair<uint64_t, uint64_t>> memory_info();
}  // namespace cuda

}  // namespace kvlite
