// footprint: what a process pays for kvlite before it asks for a GPU. cuBLAS (with cuBLASLt, ~200 MB resident
// when linked: `kvlite --version` peaked at 210 MB in a CUDA build that linked it; 8.4 MB now, 8.1 MB in a CPU
// build) is opened only when a CUDA backend is made, so the CLI's --version and plan, and the CPU engine, cost a
// CUDA build no more than a CPU build.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvlite.hpp"

namespace {

const std::string kCli = std::string(KVLITE_BINARY_DIR) + "/kvlite";
const std::string kCaptioner = std::string(KVLITE_SOURCE_DIR) + "/models/kvlite-captioner-bf16";

// Runs the CLI with its output discarded; returns its peak resident set in KiB (-1 when it failed to run or
// exited non-zero).
long peak_rss_kib(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::vector<std::string> storage = args;
  storage.insert(storage.begin(), kCli);
  for (std::string& a : storage) argv.push_back(&a[0]);
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr)) _exit(126);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  rusage usage{};
  if (wait4(pid, &status, 0, &usage) != pid) return -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return usage.ru_maxrss;  // KiB on Linux
}

bool mapped(const std::string& library_name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(library_name) != std::string::npos) return true;
  return false;
}

}  // namespace

// 24 MiB: measured 8.1 MB (--version) and 9.4 MB (plan) in a CPU build, 8.4 and 10.0 MB in a CUDA build.
// A build that loads cuBLAS at start is at ~210 MB.
constexpr long kCliRssLimitKiB = 24 * 1024;

#if defined(__SANITIZE_ADDRESS__)
#define KVLITE_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVLITE_TEST_UNDER_ASAN 1
#endif
#endif

TEST_CASE("kvlite --version and kvlite plan (CPU) stay small: cuBLAS is not loaded at start") {
#ifdef KVLITE_TEST_UNDER_ASAN
  MESSAGE("skipped: AddressSanitizer's shadow memory is most of an instrumented process's resident set");
  return;
#endif
  const long version = peak_rss_kib({"--version"});
  const long plan = peak_rss_kib({"plan", kCaptioner, "--backend", "cpu"});
  const long planned_card =
      peak_rss_kib({"plan", std::string(KVLITE_SOURCE_DIR) + "/models/llama-3.1-8b-instruct-w4a16", "--backend",
                    "cuda", "--device-mem", "8GiB", "--no-wsl2", "--max-model-len", "2048"});
  MESSAGE("peak RSS (" << std::string(kvlite::cuda::built_with_cuda() ? "CUDA" : "CPU") << " build): --version " << version
                       << " KiB, plan (cpu) " << plan << " KiB, plan (8 GiB CUDA card) "
                       << planned_card << " KiB");
  REQUIRE(version > 0);
  REQUIRE(plan > 0);
  REQUIRE(planned_card > 0);
  CHECK(version <= kCliRssLimitKiB);
  CHECK(plan <= kCliRssLimitKiB);
  if (kvlite::cuda::device_count() > 0)  // --backend cuda then plans for the GPU here, which it queries (the driver
    MESSAGE("a GPU is present: the 8 GiB plan read its properties, loading the CUDA driver; not bounded");
  else
    CHECK(planned_card <= kCliRssLimitKiB);
}

TEST_CASE("a CPU engine and a planned CUDA card never load cuBLAS") {
  kvlite::EngineOptions planned;
  planned.backend = kvlite::BackendChoice::cuda;
  planned.plan.device_mem = 8 * kvlite::GiB;
  planned.plan.wsl2 = false;
  planned.plan.max_model_len = 2048;
  auto plan = kvlite::plan_engine(std::string(KVLITE_SOURCE_DIR) + "/models/llama-3.1-8b-instruct-w4a16", planned);
  REQUIRE_MESSAGE(plan.ok(), plan.error().message);

  kvlite::EngineOptions options;
  options.backend = kvlite::BackendChoice::cpu;
  options.threads = 1;
  auto engine = kvlite::Engine::open(kCaptioner, options);
  REQUIRE_MESSAGE(engine.ok(), engine.error().message);
  auto out = (*engine)->generate("a small", kvlite::SamplingParams{});
  REQUIRE_MESSAGE(out.ok(), out.error().message);
  if (!kvlite::cuda::built_with_cuda()) {
    MESSAGE("skipped: a CPU build has no cuBLAS to keep out");
    return;
  }
  CHECK_FALSE(mapped("libcublas"));
}
