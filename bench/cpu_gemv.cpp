// bench-cpu_gemv: the CPU backend's decode-shaped Linears, reference kernels against the fast ones
// (CpuKernels::fast, or fast_lowp with --kernels fast-lowp), in llm.c's manner: validate (against reference on the
// same inputs; it stops on a difference beyond float rounding, or for fast-lowp beyond 5% of the outputs' rms,
// the activation rounding's order), then time, then print the achieved weight bandwidth against this machine's
// measured copy bandwidth (the memory roofline of a GEMV, which reads every weight byte once).
//
//   build/bench-cpu_gemv [--repeats N] [--tokens T] [--threads-max N] [--kernels fast|fast-lowp]
//                        [--formats bf16,w4,w8] [--shape NAME] [--bf16-stream-rows 0|1|8]
//
// Shapes are Qwen3-0.6B's (out x in): gate/up 3072 x 1024, down 1024 x 3072, o_proj 1024 x 2048, lm_head
// 151936 x 1024 (--shape: only those whose name contains NAME); formats BF16, W4A16 (int4 pack-quantized, BF16
// scales per group of 128, symmetric) and W8A16 (int8, a BF16 scale per row); 1 and 2 threads; T tokens
// (default 1: the decode step). Every weight is held in enough copies, used in turn, that they
// span at least 256 MiB (8x this machine's 32 MiB L3), so each call reads its weight from DRAM as a decode step
// does. Each figure is the median of --repeats timings (default 7) of one pass over all copies: the machine may be
// shared, and medians are what bench/RESULTS.md records.
//
// Copy bandwidth: memcpy of a 512 MiB buffer into another, bytes read + written per second, 1 and 2 threads
// (each copies half), median of 7.
//
// --bf16-stream-rows: fast-lowp's BF16 kernel on AVX-512 BF16, rows a one-token GEMV reads side by side
// (CpuBackendOptions::bf16_stream_rows; 0, the default, is the CPU's choice): to compare 1 and 8 on a new CPU.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvlite.hpp"

using namespace kvlite;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// GB/s (1e9 bytes) of memcpy, bytes read + written.
double copy_bandwidth(int threads, int repeats) {
  const size_t bytes = size_t(512) << 20;
  std::vector<uint8_t> src(bytes, 1), dst(bytes, 2);
  std::vector<double> rates;
  for (int r = 0; r < repeats; r++) {
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> helpers;
    const size_t part = bytes / size_t(threads);
    for (int i = 1; i < threads; i++)
      helpers.emplace_back([&, i] { memcpy(dst.data() + size_t(i) * part, src.data() + size_t(i) * part, part); });
    memcpy(dst.data(), src.data(), part);
    for (auto& helper : helpers) helper.join();
    rates.push_back(2.0 * double(bytes) / seconds_since(start) / 1e9);
  }
  return median(rates);
}

uint16_t random_bf16(std::mt19937& rng, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  float v = 0;
  while (v == 0) v = u(rng);
  return float_to_bf16(v);
}

enum class Format { bf16, w4, w8 };
const char* format_name(Format f) { return f == Format::bf16 ? "BF16" : f == Format::w4 ? "W4A16 g128" : "W8A16 channel"; }

// One weight in `copies` copies: dense BF16 [N, K], int4 words [N, K/8] + BF16 scales [N, K/128], or int8 bytes
// [N, K] + BF16 scales [N].
struct Weights {
  int64_t n, k;
  bool int4;  // quantized (int4 or int8): through quant_linear
  size_t bytes_per_copy;
  std::vector<std::vector<uint8_t>> packed, scales;
  std::vector<QuantWeight> views;
  std::vector<Tensor> dense;
};

Weights make_weights(int64_t n, int64_t k, Format format, std::mt19937& rng) {
  const bool int4 = format != Format::bf16, int8 = format == Format::w8;
  Weights w{n, k, int4, 0, {}, {}, {}, {}};
  const int64_t group = int8 ? k : 128;
  w.bytes_per_copy = int8 ? size_t(n * k + n * 2) : int4 ? size_t(n * k / 2 + n * (k / group) * 2) : size_t(n * k * 2);
  const size_t copies = std::max<size_t>(1, ((size_t(256) << 20) + w.bytes_per_copy - 1) / w.bytes_per_copy);
  for (size_t c = 0; c < copies; c++) {
    if (int4) {
      std::vector<uint8_t> packed(size_t(int8 ? n * k : n * k / 2)), scales(size_t(n * (k / group) * 2));
      for (auto& byte : packed) byte = uint8_t(rng());
      for (size_t i = 0; i < scales.size() / 2; i++) {
        const uint16_t s = random_bf16(rng, 0.02f);
        memcpy(&scales[2 * i], &s, 2);
      }
      w.packed.push_back(std::move(packed));
      w.scales.push_back(std::move(scales));
    } else {
      std::vector<uint8_t> values(size_t(n * k * 2));
      for (size_t i = 0; i < values.size() / 2; i++) {
        const uint16_t v = random_bf16(rng, 0.05f);
        memcpy(&values[2 * i], &v, 2);
      }
      w.packed.push_back(std::move(values));
    }
  }
  for (size_t c = 0; c < copies; c++) {
    if (int4) {
      QuantWeight q;
      q.name = int8 ? "bench.int8" : "bench.int4";
      q.out_features = n;
      q.in_features = k;
      q.format = int8 ? WeightFormat::int8 : WeightFormat::int4;
      q.granularity = int8 ? ScaleGranularity::channel : ScaleGranularity::group;
      if (int8) q.int8 = w.packed[c].data();
      else q.packed = w.packed[c].data();
      q.packed_cols = int8 ? 0 : k / 8;
      q.group_size = group;
      q.scales = w.scales[c].data();
      q.scale_dtype = DType::BF16;
      q.scale_rows = n;
      q.scale_cols = k / group;
      w.views.push_back(q);
    } else {
      w.dense.push_back(Tensor::matrix(w.packed[c].data(), DType::BF16, n, k));
    }
  }
  return w;
}

void run_linear(Backend& backend, const Weights& w, size_t copy, const Tensor& x, const Tensor& out) {
  const Status status = w.int4 ? backend.quant_linear(x, w.views[copy], out)
                               : backend.linear(x, w.dense[copy], Tensor{}, out);
  if (!status.ok()) {
    fprintf(stderr, "linear failed: %s\n", status.error().message.c_str());
    exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 7, threads_max = 2;
  int64_t tokens = 1;
  CpuKernels kernels = CpuKernels::fast;
  std::vector<Format> formats = {Format::bf16, Format::w4};
  std::string only_shape;
  int bf16_stream_rows = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--repeats") repeats = std::max(1, atoi(argv[i + 1]));
    else if (flag == "--tokens") tokens = std::max(1, atoi(argv[i + 1]));
    else if (flag == "--threads-max") threads_max = std::max(1, atoi(argv[i + 1]));
    else if (flag == "--kernels" && std::string(argv[i + 1]) == "fast") kernels = CpuKernels::fast;
    else if (flag == "--kernels" && std::string(argv[i + 1]) == "fast-lowp") kernels = CpuKernels::fast_lowp;
    else if (flag == "--shape") only_shape = argv[i + 1];
    else if (flag == "--bf16-stream-rows") bf16_stream_rows = atoi(argv[i + 1]);
    else if (flag == "--formats") {
      formats.clear();
      const std::string list = std::string(argv[i + 1]) + ",";
      for (size_t at = 0, comma; (comma = list.find(',', at)) != std::string::npos; at = comma + 1) {
        const std::string name = list.substr(at, comma - at);
        if (name == "bf16") formats.push_back(Format::bf16);
        else if (name == "w4") formats.push_back(Format::w4);
        else if (name == "w8") formats.push_back(Format::w8);
        else { fprintf(stderr, "--formats: unknown '%s' (bf16, w4, w8)\n", name.c_str()); return 2; }
      }
    } else {
      fprintf(stderr, "usage: %s [--repeats N] [--tokens T] [--threads-max N] [--kernels fast|fast-lowp] "
                      "[--formats bf16,w4,w8] [--shape NAME] [--bf16-stream-rows 0|1|8]\n", argv[0]);
      return 2;
    }
  }
  printf("%s kernels here: %s; tokens %lld; medians of %d\n", cpu_kernels_name(kernels), cpu_isa_name(best_cpu_isa()),
         (long long)tokens, repeats);
  std::vector<double> copy_rate(size_t(threads_max + 1));
  for (int threads = 1; threads <= threads_max; threads++) {
    copy_rate[size_t(threads)] = copy_bandwidth(threads, repeats);
    printf("copy bandwidth, %d thread%s: %.2f GB/s (read + written)\n", threads, threads > 1 ? "s" : "",
           copy_rate[size_t(threads)]);
  }
  struct Shape { const char* name; int64_t n, k; };
  const Shape shapes[] = {{"gate/up 3072x1024", 3072, 1024}, {"down 1024x3072", 1024, 3072},
                          {"o_proj 1024x2048", 1024, 2048}, {"lm_head 151936x1024", 151936, 1024}};
  std::mt19937 rng(45);
  printf("\n| shape (out x in) | format | threads | reference us | fast us | reference GB/s (%% copy) | fast GB/s "
         "(%% copy) | speedup |\n|---|---|---|---|---|---|---|---|\n");
  for (const Shape& shape : shapes)
    for (Format format : formats) {
      if (std::string(shape.name).find(only_shape) == std::string::npos) continue;
      const bool int4 = format != Format::bf16;
      const Weights w = make_weights(shape.n, shape.k, format, rng);
      std::vector<float> x(size_t(tokens * shape.k));
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (float& v : x) v = u(rng);
      std::vector<float> want(size_t(tokens * shape.n)), got(size_t(tokens * shape.n));
      const Tensor xt = Tensor::matrix(x.data(), DType::F32, tokens, shape.k);
      const Tensor want_t = Tensor::matrix(want.data(), DType::F32, tokens, shape.n);
      const Tensor got_t = Tensor::matrix(got.data(), DType::F32, tokens, shape.n);
      for (int threads = 1; threads <= threads_max; threads++) {
        CpuBackendOptions options;
        options.threads = threads;
        options.max_quant_in_features = shape.k;
        std::unique_ptr<Backend> reference = make_cpu_backend(options).value();
        options.kernels = kernels;
        options.bf16_stream_rows = bf16_stream_rows;
        Result<std::unique_ptr<Backend>> made = make_cpu_backend(options);
        if (!made.ok()) {
          fprintf(stderr, "%s\n", made.error().message.c_str());
          return 2;
        }
        std::unique_ptr<Backend> fast = std::move(made).value();
        // validate: every 7th copy's output against reference, within float rounding of sum |w x| (fast), or 5%
        // of the outputs' rms (fast-lowp: the activations' int8 / bf16 rounding)
        for (size_t c = 0; c < (int4 ? w.views.size() : w.dense.size()); c += 7) {
          std::fill(got.begin(), got.end(), NAN);
          run_linear(*reference, w, c, xt, want_t);
          run_linear(*fast, w, c, xt, got_t);
          double rms = 0;
          for (float v : want) rms += double(v) * v;
          rms = std::sqrt(rms / double(want.size()));
          for (size_t i = 0; i < got.size(); i++) {
            const double allowed = kernels == CpuKernels::fast ? 1e-4 * (1.0 + std::fabs(want[i])) : 0.05 * rms;
            if (!(std::fabs(double(got[i]) - want[i]) <= allowed)) {
              fprintf(stderr, "VALIDATION FAILED: %s %s copy %zu element %zu: %s %.9g, reference %.9g\n", shape.name,
                      format_name(format), c, i, cpu_kernels_name(kernels), double(got[i]), double(want[i]));
              return 1;
            }
          }
        }
        double us[2];
        for (int which = 0; which < 2; which++) {
          Backend& backend = which == 0 ? *reference : *fast;
          const size_t copies = int4 ? w.views.size() : w.dense.size();
          std::vector<double> per_call;
          for (int r = 0; r < repeats; r++) {
            const Clock::time_point start = Clock::now();
            for (size_t c = 0; c < copies; c++) run_linear(backend, w, c, xt, which == 0 ? want_t : got_t);
            per_call.push_back(seconds_since(start) / double(copies));
          }
          us[which] = median(per_call) * 1e6;
        }
        const double bytes = double(w.bytes_per_copy), copy = copy_rate[size_t(threads)];
        const double ref_rate = bytes / us[0] / 1e3, fast_rate = bytes / us[1] / 1e3;
        printf("| %s | %s | %d | %.1f | %.1f | %.2f (%.0f%%) | %.2f (%.0f%%) | %.2fx |\n", shape.name,
               format_name(format), threads, us[0], us[1], ref_rate, 100 * ref_rate / copy, fast_rate,
               100 * fast_rate / copy, us[0] / us[1]);
        fflush(stdout);
      }
    }
  return 0;
}
