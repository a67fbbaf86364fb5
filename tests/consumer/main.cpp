// Plans Llama-3.1-8B W4A16 for an 8 GiB card through the installed library: prints kv_bytes_per_token.
#include <kvlite.hpp>
#include <cstdio>
int main(int argc, char** argv) {
  if (argc < 2) return 2;
  kvlite::EngineOptions options;
  options.backend = kvlite::BackendChoice::cuda;  // a CUDA card, planned whether or not one is here
  options.plan.device_mem = 8ull << 30;
  options.plan.max_model_len = 2048;
  auto plan = kvlite::plan_engine(argv[1], options);
  if (!plan) { fprintf(stderr, "%s\n", plan.error().message.c_str()); return 1; }
  printf("kv_bytes_per_token=%llu fits=%d\n", (unsigned long long)plan->kv_bytes_per_token, int(plan->fits));
  return 0;
}
