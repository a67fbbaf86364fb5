// ---------------------------------------------------------------------------------------------------------
// device: what we plan for (a CUDA GPU, a planned-for card, or the CPU) and the few CUDA entry points the
// header's host code calls in kernels.cu. Without KVLITE_WITH_CUDA those entry points report "not built".
// ---------------------------------------------------------------------------------------------------------
#pragma once

namespace kvlite {

enum class BackendKind { cpu, cuda };
const char* backend_name(BackendKind kind);

// Where an engine computes, as asked for. cpu: the float32 reference; cuda: the GPU; auto: the GPU when kvlite
// was built with CUDA, one is present and the CUDA engine runs everything the model needs, else the CPU. The
// planner and Engine::open resolve it by one rule (plan_engine), so the plan shown is the plan that runs.
enum class BackendChoice { auto_, cpu, cuda };
const char* backend_choice_name(BackendChoice choice);
Result<BackendChoice> parse_backend_choice(const std::string& text);  // "auto" | "cpu" | "cuda"

// Which Linear kernels a CPU backend runs. reference: the plain loops every other path is checked against.
// fast (the default): SIMD GEMV/GEMM kernels that read BF16 / F16 / F32, int4 (W4A16 pack-quantized), int8
// (W8A16, W8A8) and fp8 e4m3 weights as stored and dequantize them in registers to the reference's values;
// F32 activations only (other activation dtypes, and weight formats or layouts the fast kernels do not cover,
// run the reference). Its sums run in another order than the reference's, so results differ from it by float
// rounding (tests/unit-cpu-fast.cpp bounds that); suites that compare CPU paths bit for bit pin reference.
// fast_lowp: fast, but with llama.cpp's numerics where they buy integer or bf16 dot products (cpu_lowp.inl):
// a BF16 Linear's input rounded to bf16, an int4 / int8 (not W8A8) Linear's input quantized to int8 per 32
// columns; so results differ from the reference by that activation rounding too (tests/unit-cpu-lowp.cpp).
enum class CpuKernels : uint8_t { reference, fast, fast_lowp };
const char* cpu_kernels_name(CpuKernels kernels);  // "reference", "fast", "fast-lowp" (the CLI's spelling)

// What the CPU backend multiplies the last hidden states by to get the logits. stored: the checkpoint's lm_head
// (or the tied embedding table) as it is. int8: an int8 copy made at load (quantize_int8_copy: symmetric, F32
// scales per row and 128 columns), what llama-quantize does to the output matrix: the lm_head is the largest
// matrix a decode step reads (Qwen3-0.6B's tied BF16 table is 57% of a W4A16 step's bytes) and the copy halves
// it, at a relative rms weight error of ~0.6% (tests/unit-cpu-lowp.cpp bounds the logits against transformers').
// The copy is host memory the plan's repack row counts; the embedding lookup keeps reading the stored table.
enum class CpuLmHead : uint8_t { stored, int8 };
const char* cpu_lm_head_name(CpuLmHead lm_head);  // "stored", "int8" (the CLI's spelling)

struct DeviceSpec {
  BackendKind backend = BackendKind::cpu;
  std::string name;           // "NVIDIA GeForce RTX 4060", "planned 8.00 GiB card", "CPU"
  uint64_t total_bytes = 0;   // memory the plan divides (device memory, or --device-mem)
  uint64_t free_bytes = 0;    // free at query time (0 when unknown: a planned card)
  int sm = 0;                 // compute capability x 10 (86, 89, 90, ...); 0 when unknown
  int multiprocessors = 0;    // SMs; 0 when unknown (a planned card): the CUDA context's size depends on them
  int threads_per_multiprocessor = 0;  // the most resident threads an SM holds; 0 when unknown
  bool wsl2 = false;          // Windows Subsystem for Linux 2: larger driver overhead, no large pinned memory
  bool queried = false;       // true when read from a real GPU
  int cpu_threads = 0;        // CPU backend: the worker threads it starts (EngineOptions::threads); 0: one per
                              // hardware thread. Sizes its scratch (the plan's workspace row).
  CpuKernels cpu_kernels = CpuKernels::fast;  // CPU backend: its Linear kernels (EngineOptions::cpu_kernels); fast_lowp
                                               // adds a buffer for the quantized activations (the workspace row)
  CpuLmHead cpu_lm_head = CpuLmHead::stored;  // CPU backend: EngineOptions::cpu_lm_head (int8: the repack row's copy)
  // An integrated GPU (Jetson: cudaDevAttrIntegrated) has no memory of its own: it shares the system's with the
  // CPU, the OS and every other process. It is planned against what was free when queried, not the total.
  bool integrated = false;
  uint64_t shared_total_bytes = 0;  // integrated: the system memory it shares (total_bytes is then what was free)
};

// True when the kernel release string names Microsoft (how WSL2 identifies itself).
bool running_under_wsl2();
// Physical memory of this machine (the CPU backend's "device").
uint64_t system_memory_bytes();

// The device a plan divides, by the one rule the planner and Engine::open share:
//   cpu   the CPU; its memory is this machine's, or device_mem when given.
//   cuda  GPU `device_index`; device_mem (at most its memory) makes it behave as a card of that size. With no
//         GPU (or no CUDA in this build) and device_mem given: a planned card of that size, which can be planned
//         but not opened; without device_mem that is a device_error.
//   auto  cuda when kvlite was built with CUDA and GPU `device_index` is present, else cpu.
// `wsl2` overrides detection when set. `*why`, when given, receives the reason for the backend chosen.
Result<DeviceSpec> detect_device(BackendChoice backend, int device_index, std::optional<uint64_t> device_mem,
                                 std::optional<bool> wsl2, std::string* why = nullptr);
// The pure part of detect_device for a GPU: a queried card (or none, for a planned one) with device_mem
// applied, and an integrated GPU's budget base set to its free shared memory. Unit-tested without a GPU.
Result<DeviceSpec> plan_gpu_device(const std::optional<DeviceSpec>& queried, std::optional<uint64_t> device_mem);

// ---- CUDA entry points (kernels.cu) ---------------------------------------------------------------------
namespace cuda {
bool built_with_cuda();
// Number of CUDA devices, 0 when none or when the driver is missing (never an error: no GPU is normal). `*why`,
// when given and the count is 0, receives the runtime's reason (e.g. no driver: "CUDA driver version is
// insufficient for CUDA runtime version").
int device_count(std::string* why = nullptr);
Result<DeviceSpec> query_device(int index);
// One reservation for the whole arena; the only device allocation kvlite makes.
Result<void*> allocate_arena(uint64_t bytes);
Status free_arena(void* pointer);
// (free, total) bytes as the driver sees them now.
Result<std::pair<uint64_t, uint64_t>> memory_info();
}  // namespace cuda

}  // namespace kvlite
