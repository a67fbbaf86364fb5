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

const char* backend_choice_name(BackendChoice choice) {
  switch (choice) {
    case BackendChoice::auto_: return "auto";
    case BackendChoice::cpu: return "cpu";
    case BackendChoice::cuda: return "cuda";
  }
  return "?";
}

Result<BackendChoice> parse_backend_choice(const std::string& text) {
  return detail::guard([&]() -> BackendChoice {
    if (text == "auto") return BackendChoice::auto_;
    if (text == "cpu") return BackendChoice::cpu;
    if (text == "cuda" || text == "gpu") return BackendChoice::cuda;
    detail::fail(ErrorCode::invalid_argument, detail::format("unknown backend '%s': use auto, cpu or cuda", text.c_str()));
  });
}

Result<DeviceSpec> plan_gpu_device(const std::optional<DeviceSpec>& queried, std::optional<uint64_t> device_mem) {
  return detail::guard([&]() -> DeviceSpec {
    using detail::fail;
    using detail::format;
    if (device_mem && *device_mem == 0) fail(ErrorCode::invalid_argument, "--device-mem must be greater than 0");
    DeviceSpec spec;
    if (queried) {
      spec = *queried;
      if (spec.integrated && spec.shared_total_bytes == 0) {
        // The card reports the system's memory: plan against what the OS and other processes left free.
        spec.shared_total_bytes = spec.total_bytes;
        spec.total_bytes = spec.free_bytes;
        spec.name += format(" (integrated: planned against the %s free of the %s it shares with the CPU)",
                            format_bytes(spec.total_bytes).c_str(), format_bytes(spec.shared_total_bytes).c_str());
      }
    } else if (!device_mem) {
      fail(ErrorCode::device_error, "backend cuda: no CUDA device is visible (no GPU, no driver, or kvlite built "
                                    "without CUDA); --device-mem SIZE plans for a card of that size, --backend cpu "
                                    "runs on the CPU");
    }
    spec.backend = BackendKind::cuda;
    if (device_mem) {
      if (queried && *device_mem > spec.total_bytes)
        fail(ErrorCode::invalid_argument,
             format("--device-mem %s is more than the %s %s: plan for at most the memory present",
                    format_bytes(*device_mem).c_str(), format_bytes(spec.total_bytes).c_str(),
                    (spec.integrated ? "free shared memory of " + queried->name : "of " + queried->name).c_str()));
      // A real GPU then behaves as a card of this size.
      spec.name = "planned " + format_bytes(*device_mem) + " card" + (queried ? " (on " + queried->name + ")" : "");
      spec.total_bytes = *device_mem;
      spec.free_bytes = 0;  // unknown for a planned card
    }
    return spec;
  });
}

Result<DeviceSpec> detect_device(BackendChoice backend, int device_index, std::optional<uint64_t> device_mem,
                                 std::optional<bool> wsl2, std::string* why) {
  return detail::guard([&]() -> DeviceSpec {
    using detail::format;
    if (device_mem && *device_mem == 0) detail::fail(ErrorCode::invalid_argument, "--device-mem must be greater than 0");
    if (device_index < 0) detail::fail(ErrorCode::invalid_argument, format("device %d does not exist", device_index));
    const bool built = cuda::built_with_cuda();
    std::string no_device_why;
    const int devices = built ? cuda::device_count(&no_device_why) : 0;
    const bool present = device_index < devices;
    std::string reason;
    DeviceSpec spec;
    if (backend == BackendChoice::cpu || (backend == BackendChoice::auto_ && !present)) {
      reason = backend == BackendChoice::cpu ? "--backend cpu"
               : !built                      ? "auto: kvlite was built without CUDA"
               : devices == 0                ? format("auto: no CUDA device is visible (%s)", no_device_why.c_str())
                                             : format("auto: CUDA device %d does not exist", device_index);
      spec.backend = BackendKind::cpu;
      spec.name = "CPU";
      spec.total_bytes = device_mem ? *device_mem : system_memory_bytes();
    } else {
      std::optional<DeviceSpec> queried;
      if (present) {
        Result<DeviceSpec> gpu = cuda::query_device(device_index);
        if (!gpu) throw gpu.error();
        queried = *gpu;
      } else if (!device_mem) {
        detail::fail(built ? ErrorCode::device_error : ErrorCode::unsupported,
                     built ? std::string("backend cuda: no CUDA device is visible (no GPU, or no driver); --backend "
                                         "cpu runs on the CPU, --device-mem SIZE plans for a card of that size")
                           : std::string("backend cuda: kvlite was built without CUDA (no nvcc at build time); rebuild "
                                         "with the CUDA toolkit, or use --backend cpu (--device-mem SIZE plans for a "
                                         "card of that size)"));
      } else if (built && devices > 0) {
        detail::fail(ErrorCode::invalid_argument, format("backend cuda: device %d does not exist; there %s %d CUDA "
                                                         "device%s", device_index, devices == 1 ? "is" : "are",
                                                         devices, devices == 1 ? "" : "s"));
      }
      Result<DeviceSpec> gpu = plan_gpu_device(queried, device_mem);
      if (!gpu) throw gpu.error();
      spec = *gpu;
      reason = backend == BackendChoice::cuda
                   ? (present ? "--backend cuda" : "--backend cuda; a planned card, no GPU here")
                   : format("auto: %s is present", queried->name.c_str());
    }
    spec.wsl2 = wsl2 ? *wsl2 : running_under_wsl2();
    if (why) *why = reason;
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
int device_count(std::string* why) {
  if (why) *why = "built without CUDA";
  return 0;
}
Result<DeviceSpec> query_device(int) { return not_built(); }
Result<void*> allocate_arena(uint64_t) { return not_built(); }
Status free_arena(void*) { return not_built(); }
Result<std::pair<uint64_t, uint64_t>> memory_info() { return not_built(); }
}  // namespace cuda
#endif

}  // namespace kvlite
