// libFuzzer harness: config.json text, then the planner over it (weights estimated from the config) on a
// planned card whose size and options also come from the input.
#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in{data, size};
  kvlite::PlanOptions options;
  const uint8_t knobs = in.byte();
  options.max_model_len = (knobs & 1) ? int64_t(in.u32() % 300000) : 0;
  options.kv_dtype = (knobs & 2) ? kvlite::KVDType::fp8 : kvlite::KVDType::auto_;
  options.utilization = 0.05 + double(in.byte()) / 256.0 * 0.95;
  kvlite::DeviceSpec device;
  device.backend = (knobs & 4) ? kvlite::BackendKind::cuda : kvlite::BackendKind::cpu;
  device.name = "fuzzed card";
  device.total_bytes = uint64_t(in.u32()) << (in.byte() % 24);
  device.wsl2 = knobs & 8;
  auto config = kvlite::parse_config(in.rest(), "fuzz config.json");
  fuzz::expect_typed(config, "parse_config");
  if (!config.ok()) return 0;
  auto weights = kvlite::detail::guard([&] { return kvlite::detail::estimate_weights(*config); });
  fuzz::expect_typed(weights, "estimate_weights");
  if (!weights.ok()) return 0;
  auto plan = kvlite::make_plan(*config, *weights, device, options);
  fuzz::expect_typed(plan, "make_plan");
  if (plan.ok()) {
    (void)plan->table();
    (void)plan->json();
  }
  return 0;
}
