// defaults: one set of defaults (issue 43). The header's manual (src/manual.txt, DEFAULTS) states what an
// EngineOptions{} and kvlite_options_init give; this suite reads those lines and compares each with the C++
// struct's and the C API's values, so that the manual, C++ and C cannot drift apart again (C++ once defaulted
// to the CPU while C and the manual said auto).
#include <doctest/doctest.h>
#include <fstream>
#include <map>
#include <sstream>
#include "kvlite.hpp"
using namespace kvlite;

namespace {

// "      backend                   auto     the GPU ..." lines between DEFAULTS and the next section: name -> value.
std::map<std::string, std::string> manual_defaults() {
  std::ifstream in(std::string(KVLITE_SOURCE_DIR) + "/src/manual.txt");
  REQUIRE(in);
  std::map<std::string, std::string> values;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("   DEFAULTS", 0) == 0) {
      inside = true;
      continue;
    }
    if (!inside) continue;
    if (line.size() > 3 && line[3] != ' ') break;  // the next section's title
    std::istringstream fields(line);
    std::string name, value;
    if (fields >> name >> value && line.rfind("      ", 0) == 0 && line[6] != ' ') values[name] = value;
  }
  return values;
}

std::string choice_name(BackendChoice choice) {
  switch (choice) {
    case BackendChoice::auto_: return "auto";
    case BackendChoice::cpu: return "cpu";
    case BackendChoice::cuda: return "cuda";
  }
  return "?";
}

std::string c_backend_name(int32_t backend) {
  if (backend == KVLITE_BACKEND_AUTO) return "auto";
  if (backend == KVLITE_BACKEND_CPU) return "cpu";
  if (backend == KVLITE_BACKEND_CUDA) return "cuda";
  return "?";
}

std::string on_off(bool on) { return on ? "on" : "off"; }

std::string number(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

}  // namespace

TEST_CASE("the manual's DEFAULTS are what EngineOptions{} and kvlite_options_init give") {
  const std::map<std::string, std::string> manual = manual_defaults();
  REQUIRE(manual.size() == 7);
  const EngineOptions cpp;
  kvlite_options c;
  kvlite_options_init(&c);

  CHECK(manual.at("backend") == choice_name(cpp.backend));
  CHECK(manual.at("backend") == c_backend_name(c.backend));
  CHECK(manual.at("device") == std::to_string(cpp.device));
  CHECK(manual.at("device") == std::to_string(c.device));
  CHECK(manual.at("threads") == std::to_string(cpp.threads));
  CHECK(manual.at("threads") == std::to_string(c.threads));
  CHECK(manual.at("plan.utilization") == number(cpp.plan.utilization));
  CHECK(manual.at("plan.utilization") == number(c.utilization));
  CHECK(manual.at("plan.max_images") == std::to_string(cpp.plan.max_images));
  CHECK(manual.at("plan.max_images") == std::to_string(c.max_images));
  CHECK(manual.at("cuda_graphs") == on_off(cpp.cuda_graphs));
  CHECK(manual.at("fp8_activations") == on_off(cpp.fp8_activations));
}

TEST_CASE("an engine opened with EngineOptions{} picks the backend auto picks, saying why") {
  EngineOptions options;
  options.plan.device_mem = 64 * MiB;
  auto plan = plan_engine(std::string(KVLITE_SOURCE_DIR) + "/tests/fixtures/models/tiny-qwen2", options);
  REQUIRE_MESSAGE(plan, plan.error().message);
  // The rule names auto's reason: a GPU found, or why the CPU ("no CUDA device is visible", a build without CUDA).
  CHECK(plan->backend_rule.find("auto") != std::string::npos);
}
