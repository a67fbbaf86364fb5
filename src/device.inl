// device: implementation (the CUDA entry points live in kernels.cu when built with CUDA).
#include <unistd.h>

namespace kvlite {

const char* backend_name(BackendKind kind) { return kind == BackendKind::cuda ? "cuda" : "cpu"; }

bool running_under_wsl2() {
  // WSL2 kernels carry "microsoft" (WSL2: "...-microsoft-standard-WSL2") in their release string.
  std::string release;
  try {
    release = detail::read_text_file("/proc/sys/kernel/osrelease");
  } catch (const Error&) {
    return false;
  }
  for (char& c : release) c = char(tolower((unsigned char)c));
  return release.find("microsoft") != std::string::npos;
}

uint64_t system_memory_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? uint64_t(pages) * uint64_t(page_size) : 0;
}

Result<DeviceSpec> detect_device(std::optional<uint64_t> device_mem, std::optional<bool> wsl2) {
  return detail::guard([&]() -> DeviceSpec {
    bool is_wsl2 = wsl2 ? *wsl2 : running_under_wsl2();
    DeviceSpec spec;
    if (cuda::built_with_cuda() && cuda::device_count() > 0) {
      auto queried = cuda::query_device(0);
      if (!queried) throw queried.error();
      spec = *queried;
    }
    if (device_mem) {
      if (*device_mem == 0) detail::fail(ErrorCode::invalid_argument, "--device-mem must be greater than 0");
      // Plan for a card of this size: the real GPU (if any) then behaves as that card.
      std::string real = spec.queried ? " (on " + spec.name + ")" : "";
      spec.backend = BackendKind::cuda;
      spec.name = "planned " + format_bytes(*device_mem) + " card" + real;
      spec.total_bytes = *device_mem;
      spec.free_bytes = 0;
    } else if (!spec.queried) {
      spec.backend = BackendKind::cpu;
      spec.name = "CPU";
      spec.total_bytes = system_memory_bytes();
    }
    spec.wsl2 = is_wsl2;
    return spec;
  });
}

#if !defined(KVLITE_WITH_CUDA)
// Built without CUDA: the entry points say so instead of failing to link.
namespace cuda {
static Error not_built() {
  return Error(ErrorCode::unsupported, "kvlite was built without CUDA (no nvcc found at build time); rebuild with "
                                       "the CUDA toolkit to use a GPU");
}
bool built_with_cuda() { return false; }
int device_count() { return 0; }
Result<DeviceSpec> query_device(int) { return not_built(); }
Result<void*> allocate_arena(uint64_t) { return not_built(); }
Status free_arena(void*) { return not_built(); }
Result<std::pair<uint64_t, uint64_t>> memory_info() { return not_built(); }
}  // namespace cuda
#endif

}  // namespace kvlite
