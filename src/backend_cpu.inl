// backend_cpu: the reference implementation of Backend, on host memory with a fixed pool of threads.
//
// Activations are F32 by default (the float32 reference), or BF16 / F16 (CpuBackendOptions::activation_dtype) to
// run the GPU's numerics: every op computes in f32 exactly as in F32 mode and rounds (to nearest even) where the
// CUDA kernels round: on every store of an activation (the residual included: add_rms_norm stores the sum and
// normalises what it stored); a Linear's weight (dense or dequantized) is rounded to the activation dtype as
// the GPU's upload converts it, and its bias too before it is added (cuBLAS's C = bias, beta = 1).
//
// Determinism: every output element is computed by exactly one thread, by the same code in the same order
// whichever thread it is and however many there are (work is split into items at fixed boundaries and the
// items' results never depend on each other), so results are identical for any thread count.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace kvlite {
namespace detail {

// ---- a fixed pool of threads ------------------------------------------------------------------------------
// run(items, body) calls body(item, worker) once for every item in [0, items), spread over the pool; the
// caller is worker 0 and works too. Items are handed out one at a time (an atomic counter), which balances
// load without affecting results. No allocation per run: the body is passed as a pointer to the caller's
// callable. Bodies must not throw (ops validate everything before they run).
//
// Waiting spins first, then sleeps. A decode step is a few hundred runs a few microseconds apart; sleeping on a
// condition variable between them costs a futex wake and a reschedule each (tens of microseconds in a VM, where a
// wake-up IPI is a VM exit), which measured ~10% of a 2-thread decode step. So a worker that finishes a run spins
// on the generation counter for up to kSpin before it sleeps, and the caller spins on the busy count likewise:
// back-to-back runs never touch the kernel, and an idle pool still sleeps (a library must not burn a core
// between calls). The spin is bounded in time, not iterations, so an oversubscribed machine loses at most kSpin
// a run to it.
class ThreadPool {
 public:
  static constexpr std::chrono::microseconds kSpin{200};

  explicit ThreadPool(int threads) {
    workers_.reserve(size_t(std::max(threads - 1, 0)));
    try {
      for (int worker = 1; worker < threads; worker++) workers_.emplace_back([this, worker] { worker_loop(worker); });
    } catch (...) {  // the system refused a thread: stop the ones started (no destructor runs for us)
      stop_and_join();
      throw;
    }
  }
  ~ThreadPool() { stop_and_join(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return int(workers_.size()) + 1; }

  template <class Body>
  void run(int64_t items, Body& body) {
    if (items <= 0) return;
    if (workers_.empty() || items == 1) {  // not worth waking anyone
      for (int64_t item = 0; item < items; item++) body(item, 0);
      return;
    }
    {
      // Under the mutex, so a worker that checks the generation under it before sleeping cannot miss the bump;
      // the release store publishes the run's fields to the workers still spinning (their acquire load).
      std::lock_guard<std::mutex> lock(mutex_);
      call_ = [](void* callable, int64_t item, int worker) { (*static_cast<Body*>(callable))(item, worker); };
      body_ = &body;
      items_ = items;
      next_.store(0, std::memory_order_relaxed);
      busy_.store(int(workers_.size()), std::memory_order_relaxed);
      generation_.store(generation_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    }
    start_.notify_all();  // no system call when every worker is spinning (nobody waits on the variable)
    work(0);
    if (spin_until([&] { return busy_.load(std::memory_order_acquire) == 0; })) return;
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return busy_.load(std::memory_order_acquire) == 0; });
  }

 private:
  // Spins until done() or kSpin has passed; whether done() became true.
  template <class Done>
  static bool spin_until(Done done) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (;;) {
      for (int i = 0; i < 64; i++) {
        if (done()) return true;
        cpu_relax();
      }
      if (std::chrono::steady_clock::now() >= deadline) return done();
    }
  }
  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true, std::memory_order_release);
    }
    start_.notify_all();
    for (auto& thread : workers_) thread.join();
  }
  void work(int worker) {
    for (int64_t item = next_.fetch_add(1); item < items_; item = next_.fetch_add(1)) call_(body_, item, worker);
  }
  void worker_loop(int worker) {
    uint64_t seen = 0;
    for (;;) {
      auto started = [&] {
        return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
      };
      if (!spin_until(started)) {
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, started);
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = generation_.load(std::memory_order_acquire);
      work(worker);
      if (busy_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        // The last one out: the caller may be asleep already (it checks busy_ under the mutex before it sleeps).
        std::lock_guard<std::mutex> lock(mutex_);
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::atomic<uint64_t> generation_{0};  // bumped once per run; workers start on a change
  std::atomic<bool> stop_{false};
  std::atomic<int> busy_{0};             // workers that have not finished the current run
  void (*call_)(void*, int64_t, int) = nullptr;
  void* body_ = nullptr;
  int64_t items_ = 0;
  std::atomic<int64_t> next_{0};  // the next item to hand out
};

// ---- element types ----------------------------------------------------------------------------------------
// Storage types for the 16-bit floats, so templates can tell them apart.
struct Bf16 { uint16_t bits; };
struct Half { uint16_t bits; };
inline float to_float(float v) { return v; }
inline float to_float(Bf16 v) { return bf16_to_float(v.bits); }
inline float to_float(Half v) { return f16_to_float(v.bits); }
template <class T> T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline Bf16 from_float<Bf16>(float v) { return Bf16{float_to_bf16(v)}; }
template <> inline Half from_float<Half>(float v) { return Half{float_to_f16(v)}; }

inline bool is_cpu_float(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16; }

// KV cache elements: the float types, and e4m3 bytes holding value / scale (the scale is 1 for the others).
struct Fp8 { uint8_t bits; };
template <class E> inline E kv_store(float v, float scale) { (void)scale; return from_float<E>(v); }
template <> inline Fp8 kv_store<Fp8>(float v, float scale) { return Fp8{float_to_fp8_e4m3(v / scale)}; }
template <class E> inline float kv_load(E v, float scale) { (void)scale; return to_float(v); }
template <> inline float kv_load<Fp8>(Fp8 v, float scale) { return fp8_e4m3_to_float(v.bits) * scale; }
inline bool is_kv_dtype(DType dtype) { return is_cpu_float(dtype) || dtype == DType::F8_E4M3; }
template <class F>
void with_kv_type(DType dtype, F&& f) {
  if (dtype == DType::F8_E4M3) return f(Fp8{});
  with_float_type(dtype, std::forward<F>(f));
}
inline float layer_scale(const float* scales, int64_t layer) { return scales ? scales[layer] : 1.0f; }

// Calls f(T{}) with T the storage type of `dtype` (F32, BF16 or F16; supports() guarantees one of them).
template <class F>
void with_float_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: f(float{}); return;
    case DType::BF16: f(Bf16{}); return;
    case DType::F16: f(Half{}); return;
    default: fail(ErrorCode::internal, format("CPU backend: no float storage for %s", dtype_name(dtype)));
  }
}

template <class T>
T* row_of(const Tensor& t, int64_t row) {
  return static_cast<T*>(t.data) + row * t.row_stride;
}
inline uint8_t* row_bytes_of(const Tensor& t, int64_t row) {
  return static_cast<uint8_t*>(t.data) + row * t.row_stride * t.element_bytes();
}
inline const int32_t* ints(const Tensor& t) { return static_cast<const int32_t*>(t.data); }

// ---- dot products -----------------------------------------------------------------------------------------
// Every dot product keeps kLanes partial sums (element k goes to lane k % kLanes) over the largest multiple
// of kLanes, reduces them in a fixed tree, then adds the tail in order. Fixed, so results do not depend on
// which tile or thread computes them; several sums, so the compiler can vectorise without reassociating.
constexpr int kLanes = 8;
inline float reduce_lanes(const float* acc) {
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// a and b are float or stored activations (widened as read: exact, so the sum is the F32 one of those values).
template <class X, class Y>
inline float dot(const X* a, const Y* b, int64_t n) {
  float acc[kLanes] = {};
  const int64_t main = n - n % kLanes;
  for (int64_t k = 0; k < main; k += kLanes)
    for (int l = 0; l < kLanes; l++) acc[l] += to_float(a[k + l]) * to_float(b[k + l]);
  float sum = reduce_lanes(acc);
  for (int64_t k = main; k < n; k++) sum += to_float(a[k]) * to_float(b[k]);
  return sum;
}

// A weight element as a Linear multiplies it with activations of type A: as stored when A is float (the
// reference) or already A; otherwise rounded to A, as the CUDA backend converts Linears to the activation dtype
// when it uploads them (its GEMMs take one element type).
template <class A, class W>
inline float weight_as(W w) {
  if constexpr (std::is_same<A, float>::value || std::is_same<A, W>::value) return to_float(w);
  else return to_float(from_float<A>(to_float(w)));
}

// Element n of a float vector of any storage dtype (a bias; read once per output element).
inline float float_at(const Tensor& t, int64_t n) {
  switch (t.dtype) {
    case DType::BF16: return bf16_to_float(static_cast<const uint16_t*>(t.data)[n]);
    case DType::F16: return f16_to_float(static_cast<const uint16_t*>(t.data)[n]);
    default: return static_cast<const float*>(t.data)[n];
  }
}

// out[i][j] = x row i . w row j for a TOKENS x ROWS tile, each weight element converted once per tile.
//   A: activation type (x's); W: weight type (see weight_as).
template <int TOKENS, int ROWS, class A, class W>
inline void linear_tile(const A* x, int64_t x_stride, const W* w, int64_t w_stride, int64_t k_size,
                        float (&out)[TOKENS][ROWS]) {
  float acc[TOKENS][ROWS][kLanes] = {};
  const int64_t main = k_size - k_size % kLanes;
  for (int64_t k = 0; k < main; k += kLanes) {
    float wk[ROWS][kLanes];
    for (int j = 0; j < ROWS; j++)
      for (int l = 0; l < kLanes; l++) wk[j][l] = weight_as<A>(w[j * w_stride + k + l]);
    for (int i = 0; i < TOKENS; i++)
      for (int j = 0; j < ROWS; j++)
        for (int l = 0; l < kLanes; l++) acc[i][j][l] += to_float(x[i * x_stride + k + l]) * wk[j][l];
  }
  for (int i = 0; i < TOKENS; i++)
    for (int j = 0; j < ROWS; j++) {
      float sum = reduce_lanes(acc[i][j]);
      for (int64_t k = main; k < k_size; k++)
        sum += to_float(x[i * x_stride + k]) * weight_as<A>(w[j * w_stride + k]);
      out[i][j] = sum;
    }
}

}  // namespace detail
}  // namespace kvlite
#include "cpu_fast.inl"  // the fast kernels (CpuKernels::fast), built on the element types above
#include "cpu_lowp.inl"  // and their low-precision-activation kernels (CpuKernels::fast_lowp)
#include "cpu_attention.inl"  // and their paged attention
namespace kvlite {
namespace detail {

// ---- the backend ------------------------------------------------------------------------------------------
constexpr int64_t kCpuHeadsPerPass = 8;       // attention: query heads summed together
constexpr int64_t kCpuQuantTokenChunk = 64;  // quant_linear: tokens per pass over the weight

// The backend's scratch, in floats (cpu_backend_scratch_bytes and the constructor both take it from here).
struct CpuScratchSizes {
  int threads = 1;
  int64_t attention_per_thread = 0;  // key and value rows, then kCpuHeadsPerPass accumulators
  int64_t dequant_per_thread = 0;    // kQuantRowBlock weight rows of max_quant_in_features
  int64_t widened = 0;               // 16-bit activations: one token chunk widened to f32
  int64_t requantized = 0;           // fp8 / int8 activations: one token chunk through fp8 / int8 and back
  int64_t lowp = 0;                  // fast_lowp: one token chunk's quantized (or bf16-rounded) activations
};
// fast_lowp's buffer, floats a token: K for the rounded f32 row (the widest use; bf16 rows take K / 2 and int8
// rows cpu_lowp::q8_row_floats(K)), plus a 64-byte line so that rows start on whole lines.
inline int64_t lowp_row_floats(int64_t K) { return int64_t(align_up(uint64_t(std::max(K, cpu_lowp::q8_row_floats(K))), 16)) + 16; }
CpuScratchSizes cpu_scratch_sizes(const CpuBackendOptions& o) {
  CpuScratchSizes s;
  s.threads = cpu_threads_or_all(o.threads);
  // whole 64-byte lines per thread, so two threads never write the same cache line
  s.attention_per_thread = int64_t(align_up(uint64_t((2 + kCpuHeadsPerPass) * o.max_head_dim), 16));
  s.dequant_per_thread = kQuantRowBlock * o.max_quant_in_features;
  if (o.activation_dtype != DType::F32) s.widened = kCpuQuantTokenChunk * o.max_quant_in_features;
  if (o.fp8_activations || o.int8_activations) s.requantized = kCpuQuantTokenChunk * o.max_quant_in_features;
  if (o.kernels == CpuKernels::fast_lowp) s.lowp = kCpuQuantTokenChunk * lowp_row_floats(o.max_quant_in_features);
  return s;
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options)
      : act_(options.activation_dtype),
        // kernels == fast resolves the ISA once here (make_cpu_backend refused one the CPU lacks)
        fast_isa_(options.kernels == CpuKernels::reference ? CpuIsa::automatic
                  : options.isa == CpuIsa::automatic        ? best_cpu_isa()
                                                            : options.isa),
        lowp_(options.kernels == CpuKernels::fast_lowp),
        bf16_dot_(lowp_ && fast_isa_ == CpuIsa::avx512 && cpu_lowp::cpu_has_bf16_dot()),
        bf16_stream_rows_(options.bf16_stream_rows != 0 ? options.bf16_stream_rows : cpu_lowp::bf16_stream_rows_for_cpu()),
        int_kernels_(lowp_ ? cpu_lowp::int_kernels_for(fast_isa_) : cpu_lowp::IntKernels::portable),
        max_head_dim_(options.max_head_dim),
        scratch_per_thread_(cpu_scratch_sizes(options).attention_per_thread),
        max_quant_in_features_(options.max_quant_in_features),
        fp8_activations_(options.fp8_activations),
        int8_activations_(options.int8_activations),
        pool_(cpu_scratch_sizes(options).threads) {
    // quant_linear multiplies f32 rows: 16-bit activations are widened into `widened_` (f32 activations are read
    // in place), and W8A8's fake-quantized rows go to `requantized_`. Sizes: cpu_scratch_sizes, which the plan
    // counts (cpu_backend_scratch_bytes).
    const CpuScratchSizes sizes = cpu_scratch_sizes(options);
    scratch_.assign(size_t(pool_.threads() * sizes.attention_per_thread), 0.0f);
    dequant_scratch_.assign(size_t(pool_.threads() * sizes.dequant_per_thread), 0.0f);
    requantized_.assign(size_t(sizes.requantized), 0.0f);
    widened_.assign(size_t(sizes.widened), 0.0f);
    lowp_rows_.assign(size_t(sizes.lowp), 0.0f);
  }

  BackendKind kind() const override { return BackendKind::cpu; }
  std::string name() const override {
    std::string kernels = fast_isa_ == CpuIsa::automatic ? ""
                          : lowp_ ? format(", fast-lowp %s%s%s kernels", cpu_isa_name(fast_isa_),
                                           int_kernels_ == cpu_lowp::IntKernels::vnni       ? " vnni"
                                           : int_kernels_ == cpu_lowp::IntKernels::neon_dot ? " dotprod"
                                                                                            : "",
                                           !bf16_dot_ ? "" : bf16_stream_rows_ > 1 ? " bf16 (8-row streams)" : " bf16")
                                  : format(", fast %s kernels", cpu_isa_name(fast_isa_));
    return format("cpu (%d thread%s%s)", pool_.threads(), pool_.threads() == 1 ? "" : "s", kernels.c_str());
  }
  DType activation_dtype() const override { return act_; }
  bool supports(Op op, DType dtype) const override {
    switch (op) {
      case Op::rope: case Op::silu_mul: case Op::add: case Op::gelu: case Op::segment_attention:
      case Op::gelu_mul: case Op::scale: case Op::soft_cap:
        return dtype == act_;
      case Op::gather_rows: case Op::rms_norm: case Op::add_rms_norm: case Op::linear: case Op::copy:
      case Op::embedding_bag: case Op::layer_norm:
        return is_cpu_float(dtype);
      case Op::kv_write: case Op::attention: case Op::rope_kv_write:
        return is_kv_dtype(dtype);
      case Op::quant_linear: return dtype == DType::I32 || dtype == DType::I8 || dtype == DType::F8_E4M3;
    }
    return false;
  }

 protected:
  void impl_copy_from_host(const void* src, const Tensor& dst) override {
    const int64_t row_bytes = dst.cols * dst.element_bytes();
    for (int64_t r = 0; r < dst.rows; r++)
      memcpy(row_bytes_of(dst, r), static_cast<const uint8_t*>(src) + r * row_bytes, size_t(row_bytes));
  }
  void impl_copy_to_host(const Tensor& src, void* dst) override {
    const int64_t row_bytes = src.cols * src.element_bytes();
    for (int64_t r = 0; r < src.rows; r++)
      memcpy(static_cast<uint8_t*>(dst) + r * row_bytes, row_bytes_of(src, r), size_t(row_bytes));
  }
  void impl_synchronize() override {}  // every op has finished when it returns

  void impl_gather_rows(const Tensor& table, const Tensor& ids, const Tensor& out) override {
    const int32_t* id = ints(ids);
    for (int64_t t = 0; t < out.rows; t++)
      if (id[t] < 0 || id[t] >= table.rows)
        fail(ErrorCode::invalid_argument, format("gather_rows: ids[%lld] = %d is outside the table's %lld rows",
                                                 (long long)t, id[t], (long long)table.rows));
    with_float_and_activation_types(table.dtype, [&](auto tag, auto act_tag) {
      using T = decltype(tag);
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const T* src = row_of<const T>(table, id[t]);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) dst[c] = from_float<A>(to_float(src[c]));
      };
      pool_.run(out.rows, body);
    });
  }

  // The CPU's memory is the host's: the lookup is gather_rows over the host ids.
  void impl_gather_host_rows(const Tensor& table, const int32_t* ids, const Tensor& out) override {
    impl_gather_rows(table, Tensor::vector(const_cast<int32_t*>(ids), DType::I32, out.rows), out);
  }

  void impl_rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) override {
    with_float_and_activation_types(weight.dtype, [&](auto tag, auto act_tag) {
      using W = decltype(tag);
      using A = decltype(act_tag);
      const W* w = static_cast<const W*>(weight.data);
      const int64_t group = weight.elements();
      auto body = [&](int64_t t, int) {
        const A* in = row_of<const A>(x, t);
        A* dst = row_of<A>(out, t);
        for (int64_t g = 0; g < x.cols; g += group) normalize(in + g, w, group, eps, dst + g);
      };
      pool_.run(x.rows, body);
    });
  }

  void impl_add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, float eps,
                         const Tensor& out) override {
    with_float_and_activation_types(weight.dtype, [&](auto tag, auto act_tag) {
      using W = decltype(tag);
      using A = decltype(act_tag);
      const W* w = static_cast<const W*>(weight.data);
      auto body = [&](int64_t t, int) {
        const A* in = row_of<const A>(x, t);
        A* res = row_of<A>(residual, t);
        // hidden = residual + hidden, stored in the activation dtype; the norm reads what was stored
        for (int64_t c = 0; c < x.cols; c++) res[c] = from_float<A>(to_float(res[c]) + to_float(in[c]));
        normalize(res, w, x.cols, eps, row_of<A>(out, t));
      };
      pool_.run(x.rows, body);
    });
  }

  void impl_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim) override {
    const int64_t half = cos.cols, heads = x.cols / head_dim;
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const float* c = row_of<const float>(cos, t);
        const float* s = row_of<const float>(sin, t);
        for (int64_t h = 0; h < heads; h++) {
          A* v = row_of<A>(x, t) + h * head_dim;
          for (int64_t i = 0; i < half; i++) {
            const float a = to_float(v[i]), b = to_float(v[i + half]);
            // q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1)
            v[i] = from_float<A>(a * c[i] - b * s[i]);
            v[i + half] = from_float<A>(b * c[i] + a * s[i]);
          }
        }
      };
      pool_.run(x.rows, body);
    });
  }

  void impl_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out) override {
    if (lowp_ && act_ == DType::F32 && weight.dtype == DType::BF16 && x.cols <= max_quant_in_features_) {
      lowp_bf16_linear(x, weight, bias, out);
      return;
    }
    if (fast_isa_ != CpuIsa::automatic && act_ == DType::F32) {  // the fast kernels: work items are row blocks
      const int64_t row_blocks = int64_t(ceil_div(uint64_t(weight.rows), uint64_t(cpu_fast::kRowBlock)));
      auto body = [&](int64_t b, int) {
        const int64_t n0 = b * cpu_fast::kRowBlock;
        cpu_fast::dense_linear_rows(fast_isa_, x, weight, bias, out, n0,
                                    std::min<int64_t>(n0 + cpu_fast::kRowBlock, weight.rows));
      };
      pool_.run(row_blocks, body);
      return;
    }
    with_float_and_activation_types(weight.dtype, [&](auto tag, auto act_tag) {
      using W = decltype(tag);
      using A = decltype(act_tag);
      // Work items are blocks of kTokenBlock tokens x kRowBlock weight rows; inside one, tiles of kTileTokens
      // x kTileRows reuse each converted weight element kTileTokens times. Block edges are multiples of the
      // tile sizes, so which tile shape computes an output depends only on its position.
      const int64_t T = x.rows, N = weight.rows, K = x.cols;
      const int64_t token_blocks = int64_t(ceil_div(uint64_t(T), kTokenBlock));
      const int64_t row_blocks = int64_t(ceil_div(uint64_t(N), kRowBlock));
      auto body = [&](int64_t item, int) {
        const int64_t t0 = (item / row_blocks) * kTokenBlock, n0 = (item % row_blocks) * kRowBlock;
        const int64_t t1 = std::min<int64_t>(t0 + kTokenBlock, T), n1 = std::min<int64_t>(n0 + kRowBlock, N);
        int64_t t = t0;
        for (; t + kTileTokens <= t1; t += kTileTokens)
          linear_rows<kTileTokens, A, W>(x, weight, bias, out, t, n0, n1, K);
        for (; t < t1; t++) linear_rows<1, A, W>(x, weight, bias, out, t, n0, n1, K);
      };
      pool_.run(token_blocks * row_blocks, body);
    });
  }

  // fast_lowp, BF16 weights: each chunk of tokens rounded to bf16 into lowp_rows_ (bf16 bits for vdpbf16ps, else
  // the rounded values as f32 for the fast kernels), then row blocks over the pool as impl_linear's fast path.
  void lowp_bf16_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out) {
    const int64_t K = x.cols, N = weight.rows, stride = lowp_row_floats(max_quant_in_features_);
    const int64_t row_blocks = int64_t(ceil_div(uint64_t(N), uint64_t(cpu_fast::kRowBlock)));
    for (int64_t t0 = 0; t0 < x.rows; t0 += kCpuQuantTokenChunk) {
      const int64_t tokens = std::min(kCpuQuantTokenChunk, x.rows - t0);
      auto round = [&](int64_t t, int) {
        const float* row = row_of<const float>(x, t0 + t);
        float* dst = lowp_rows_.data() + t * stride;
        if (bf16_dot_) {
          uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
          for (int64_t k = 0; k < K; k++) bits[k] = float_to_bf16(row[k]);
        } else {
          for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_float(float_to_bf16(row[k]));
        }
      };
      pool_.run(tokens, round);
      float* o = row_of<float>(out, t0);
      auto body = [&](int64_t b, int) {
        const int64_t n0 = b * cpu_fast::kRowBlock, n1 = std::min<int64_t>(n0 + cpu_fast::kRowBlock, N);
        if (bf16_dot_) {
          cpu_lowp::bf16_dot_linear_rows(reinterpret_cast<const uint16_t*>(lowp_rows_.data()), 2 * stride, tokens,
                                         weight, bias, o, out.row_stride, n0, n1, bf16_stream_rows_);
        } else {
          const Tensor rounded{lowp_rows_.data(), DType::F32, tokens, K, stride};
          const Tensor chunk_out{o, DType::F32, tokens, out.cols, out.row_stride};
          cpu_fast::dense_linear_rows(fast_isa_, rounded, weight, bias, chunk_out, n0, n1);
        }
      };
      pool_.run(row_blocks, body);
    }
  }

  // fast_lowp, int4 / int8 weights (cpu_lowp's int4_covered / int8_covered): each chunk of tokens quantized to
  // int8 per 32 columns into lowp_rows_, then row blocks over the pool.
  void lowp_int_linear(const Tensor& x, const QuantWeight& weight, const Tensor& out) {
    const int64_t K = weight.in_features, N = weight.out_features;
    const int64_t row_blocks = int64_t(ceil_div(uint64_t(N), uint64_t(cpu_fast::kRowBlock)));
    cpu_lowp::Q8Rows rows{lowp_rows_.data(), K, lowp_row_floats(max_quant_in_features_)};
    const bool int4 = weight.format == WeightFormat::int4;
    for (int64_t t0 = 0; t0 < x.rows; t0 += kCpuQuantTokenChunk) {
      const int64_t tokens = std::min(kCpuQuantTokenChunk, x.rows - t0);
      auto quantize = [&](int64_t t, int) {
        cpu_lowp::quantize_q8_row(row_of<const float>(x, t0 + t), int4, weight.group_size, rows, t);
      };
      pool_.run(tokens, quantize);
      float* o = row_of<float>(out, t0);
      auto body = [&](int64_t b, int thread) {
        const int64_t n0 = b * cpu_fast::kRowBlock, n1 = std::min<int64_t>(n0 + cpu_fast::kRowBlock, N);
        // the block's scales and offsets: 2 x 16 x K / 128 floats of the thread's 16 x K (block_table_floats)
        static_assert(cpu_fast::kRowBlock <= kQuantRowBlock, "the lowp block tables must fit the scratch");
        float* tables = dequant_scratch_.data() + thread * kQuantRowBlock * max_quant_in_features_;
        cpu_lowp::int_linear_rows(int_kernels_, rows, tokens, weight, o, out.row_stride, n0, n1, tables);
      };
      pool_.run(row_blocks, body);
    }
  }

  // W8A8 as its checkpoint (int8, per token) or the GPU's fp8 tensor cores (fp8_activations, per `group` columns)
  // see it: each of `tokens` f32 rows [K] of `chunk` through int8 / fp8 and back, into requantized_ [tokens, K].
  void requantize_chunk(const float* chunk, int64_t stride, int64_t tokens, int64_t K, bool int8, int64_t group) {
    auto body = [&](int64_t t, int) {
      if (int8) fake_quantize_int8_row(chunk + t * stride, K, requantized_.data() + t * K);
      else fake_quantize_fp8_row(chunk + t * stride, K, group, requantized_.data() + t * K);
    };
    pool_.run(tokens, body);
  }

  // Tokens go in chunks of kQuantTokenChunk; for each chunk, work item b dequantizes weight rows
  // [16 b, 16 b + 16) into its thread's scratch and multiplies the chunk by them. Every output element is one
  // dot product in quant_linear's fixed order, so chunking and threads change no bit.
  void impl_quant_linear(const Tensor& x, const QuantWeight& weight, const Tensor& out) override {
    const int64_t K = weight.in_features, N = weight.out_features;
    if (K > max_quant_in_features_)
      fail(ErrorCode::invalid_argument,
           format("quant_linear: %s has %lld in_features but this CPU backend's dequantization scratch holds rows of "
                  "%lld (raise CpuBackendOptions::max_quant_in_features)",
                  weight.name.c_str(), (long long)K, (long long)max_quant_in_features_));
    const bool requantize = fp8_activations_ && weight.format == WeightFormat::fp8;
    const bool int8_activations = weight.format == WeightFormat::int8 && weight.int8_activations;  // W8A8
    if (int8_activations && !int8_activations_)
      fail(ErrorCode::invalid_argument,
           format("quant_linear: %s is W8A8 (int8 activations per token) but this CPU backend was made without "
                  "CpuBackendOptions::int8_activations, which reserves their buffer", weight.name.c_str()));
    const int64_t group = fp8_activation_group(weight);
    if (lowp_ && act_ == DType::F32 && K <= max_quant_in_features_ &&
        (cpu_lowp::int4_covered(weight) || cpu_lowp::int8_covered(weight))) {
      lowp_int_linear(x, weight, out);
      return;
    }
    const bool fast_int4 = cpu_fast::int4_supported(weight);
    if (fast_isa_ != CpuIsa::automatic && act_ == DType::F32 && (fast_int4 || cpu_fast::bytes_supported(weight))) {
      // The fast kernels read the weights in place: no dequantized rows; work items are row blocks for all
      // tokens. Their tables (int4 groups, act-order int8 scales) go to the thread's dequantization scratch,
      // which holds them (int4_supported, bytes_supported: at most K floats a row).
      static_assert(cpu_fast::kRowBlock <= kQuantRowBlock, "a fast row block's tables must fit the scratch");
      const int64_t fast_blocks = int64_t(ceil_div(uint64_t(N), uint64_t(cpu_fast::kRowBlock)));
      auto rows = [&](const float* xs, int64_t x_stride, int64_t tokens, float* o) {
        auto body = [&](int64_t b, int thread) {
          const int64_t n0 = b * cpu_fast::kRowBlock, n1 = std::min<int64_t>(n0 + cpu_fast::kRowBlock, N);
          float* tables = dequant_scratch_.data() + thread * kQuantRowBlock * max_quant_in_features_;
          if (fast_int4) cpu_fast::int4_linear_rows(fast_isa_, xs, x_stride, tokens, weight, o, out.row_stride, n0, n1, tables);
          else cpu_fast::bytes_linear_rows(fast_isa_, xs, x_stride, tokens, weight, o, out.row_stride, n0, n1, tables);
        };
        pool_.run(fast_blocks, body);
      };
      if (!requantize && !int8_activations) {
        rows(row_of<const float>(x, 0), x.row_stride, x.rows, row_of<float>(out, 0));
        return;
      }
      // W8A8: each activation row through fp8 / int8 and back first, as the reference below
      for (int64_t t0 = 0; t0 < x.rows; t0 += kQuantTokenChunk) {
        const int64_t tokens = std::min(kQuantTokenChunk, x.rows - t0);
        requantize_chunk(row_of<const float>(x, t0), x.row_stride, tokens, K, int8_activations, group);
        rows(requantized_.data(), K, tokens, row_of<float>(out, t0));
      }
      return;
    }
    const int64_t row_blocks = int64_t(ceil_div(uint64_t(N), uint64_t(kQuantRowBlock)));
    for (int64_t t0 = 0; t0 < x.rows; t0 += kQuantTokenChunk) {
      const int64_t tokens = std::min(kQuantTokenChunk, x.rows - t0);
      const float* chunk = nullptr;
      int64_t chunk_stride = x.row_stride;
      if (act_ == DType::F32) {
        chunk = row_of<const float>(x, t0);
      } else {  // [tokens, K] widened (exactly) to f32
        with_activation_type([&](auto act_tag) {
          using A = decltype(act_tag);
          auto body = [&](int64_t t, int) {
            const A* src = row_of<const A>(x, t0 + t);
            float* dst = widened_.data() + t * K;
            for (int64_t k = 0; k < K; k++) dst[k] = to_float(src[k]);
          };
          pool_.run(tokens, body);
        });
        chunk = widened_.data();
        chunk_stride = K;
      }
      if (requantize || int8_activations) {
        requantize_chunk(chunk, chunk_stride, tokens, K, int8_activations, group);
        chunk = requantized_.data();
        chunk_stride = K;
      }
      void* out_chunk = row_bytes_of(out, t0);
      // The GPU's W4A16 / fp8 GEMMs multiply weights in the activation dtype; W8A8 multiplies fp8 by fp8.
      const DType weight_rounding = requantize || int8_activations ? DType::F32 : act_;
      auto body = [&](int64_t b, int thread) {
        const int64_t n0 = b * kQuantRowBlock;
        quant_linear_block(chunk, chunk_stride, tokens, weight, n0, std::min(kQuantRowBlock, N - n0),
                           dequant_scratch_.data() + thread * kQuantRowBlock * max_quant_in_features_, out_chunk,
                           out.row_stride, act_, weight_rounding);
      };
      pool_.run(row_blocks, body);
    }
  }

  void impl_silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out) override {
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const A* g = row_of<const A>(gate, t);
        const A* u = row_of<const A>(up, t);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) {
          const float gv = to_float(g[c]);
          dst[c] = from_float<A>(gv / (1.0f + std::exp(-gv)) * to_float(u[c]));
        }
      };
      pool_.run(out.rows, body);
    });
  }

  void impl_gelu_mul(const Tensor& gate, const Tensor& up, GeluApprox approx, const Tensor& out) override {
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const A* g = row_of<const A>(gate, t);
        const A* u = row_of<const A>(up, t);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) {
          // act_fn(gate) is a tensor of the activation dtype before the product
          const float activated = to_float(from_float<A>(gelu_of(to_float(g[c]), approx)));
          dst[c] = from_float<A>(activated * to_float(u[c]));
        }
      };
      pool_.run(out.rows, body);
    });
  }

  void impl_scale(const Tensor& x, float factor, const Tensor& out) override {
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const A* in = row_of<const A>(x, t);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) dst[c] = from_float<A>(to_float(in[c]) * factor);
      };
      pool_.run(out.rows, body);
    });
  }

  void impl_soft_cap(const Tensor& x, float cap, const Tensor& out) override {
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const A* in = row_of<const A>(x, t);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) {
          // logits = logits / cap; logits = torch.tanh(logits); logits = logits * cap (each one a stored tensor)
          const float divided = to_float(from_float<A>(to_float(in[c]) / cap));
          const float squashed = to_float(from_float<A>(std::tanh(divided)));
          dst[c] = from_float<A>(squashed * cap);
        }
      };
      pool_.run(out.rows, body);
    });
  }

  void impl_add(const Tensor& a, const Tensor& b, const Tensor& out) override {
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const A* pa = row_of<const A>(a, t);
        const A* pb = row_of<const A>(b, t);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) dst[c] = from_float<A>(to_float(pa[c]) + to_float(pb[c]));
      };
      pool_.run(out.rows, body);
    });
  }

  void impl_copy(const Tensor& src, const Tensor& dst) override {
    with_float_type(src.dtype, [&](auto src_tag) {
      with_float_type(dst.dtype, [&](auto dst_tag) {
        using S = decltype(src_tag);
        using D = decltype(dst_tag);
        auto body = [&](int64_t r, int) {
          const S* from = row_of<const S>(src, r);
          D* to = row_of<D>(dst, r);
          for (int64_t c = 0; c < src.cols; c++) to[c] = from_float<D>(to_float(from[c]));
        };
        pool_.run(src.rows, body);
      });
    });
  }

  void impl_embedding_bag(const Tensor& table, const Tensor& indices, const Tensor& weights,
                          const Tensor& out) override {
    for (int64_t t = 0; t < indices.rows; t++)
      for (int64_t j = 0; j < indices.cols; j++) {
        const int32_t index = row_of<const int32_t>(indices, t)[j];
        if (index < 0 || index >= table.rows)
          fail(ErrorCode::invalid_argument,
               format("embedding_bag: indices[%lld][%lld] = %d is outside the table's %lld rows", (long long)t,
                      (long long)j, index, (long long)table.rows));
      }
    with_float_and_activation_types(table.dtype, [&](auto tag, auto act_tag) {
      using T = decltype(tag);
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const int32_t* index = row_of<const int32_t>(indices, t);
        const float* weight = row_of<const float>(weights, t);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) {
          // (embedding(indices) * weights[..., None]).sum(1): products rounded, then summed in order
          float sum = 0.0f;
          for (int64_t j = 0; j < indices.cols; j++) {
            const float product = to_float(row_of<const T>(table, index[j])[c]) * weight[j];
            sum += product;
          }
          dst[c] = from_float<A>(sum);
        }
      };
      pool_.run(out.rows, body);
    });
  }

  void impl_layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                       const Tensor& out) override {
    with_float_and_activation_types(weight.dtype, [&](auto tag, auto act_tag) {
      using W = decltype(tag);
      using A = decltype(act_tag);
      const W* w = static_cast<const W*>(weight.data);
      const W* b = static_cast<const W*>(bias.data);
      const int64_t n = x.cols;
      auto body = [&](int64_t t, int) {
        const A* in = row_of<const A>(x, t);
        A* dst = row_of<A>(out, t);
        // The moments in double (two passes), so mean and biased variance are the correctly rounded values.
        double sum = 0;
        for (int64_t i = 0; i < n; i++) sum += double(to_float(in[i]));
        const double mean = sum / double(n);
        double squares = 0;
        for (int64_t i = 0; i < n; i++)
          squares += (double(to_float(in[i])) - mean) * (double(to_float(in[i])) - mean);
        const float mean_f = float(mean);
        const float inv_std = 1.0f / std::sqrt(float(squares / double(n)) + eps);
        for (int64_t i = 0; i < n; i++)
          dst[i] = from_float<A>((to_float(in[i]) - mean_f) * inv_std * to_float(w[i]) + to_float(b[i]));
      };
      pool_.run(x.rows, body);
    });
  }

  void impl_gelu(const Tensor& x, GeluApprox approx, const Tensor& out) override {
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        const A* in = row_of<const A>(x, t);
        A* dst = row_of<A>(out, t);
        for (int64_t c = 0; c < out.cols; c++) dst[c] = from_float<A>(gelu_of(to_float(in[c]), approx));
      };
      pool_.run(out.rows, body);
    });
  }

  void impl_segment_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_starts,
                              int64_t max_segment, int64_t head_dim, float scale, const Tensor& out) override {
    if (head_dim > max_head_dim_)
      fail(ErrorCode::invalid_argument,
           format("segment_attention: head_dim %lld is larger than the CPU backend's max_head_dim %lld; make the "
                  "backend with CpuBackendOptions::max_head_dim >= %lld", (long long)head_dim,
                  (long long)max_head_dim_, (long long)head_dim));
    const int64_t segments = segment_starts.elements() - 1;
    const int32_t* starts = ints(segment_starts);
    if (starts[0] != 0 || starts[segments] != q.rows)
      fail(ErrorCode::invalid_argument,
           format("segment_attention: segment_starts must run from 0 to q's %lld rows; it runs from %d to %d",
                  (long long)q.rows, starts[0], starts[segments]));
    for (int64_t s = 0; s < segments; s++)
      if (starts[s + 1] < starts[s] || starts[s + 1] - starts[s] > max_segment)
        fail(ErrorCode::invalid_argument,
             format("segment_attention: segment %lld runs from row %d to %d; segments must not run backwards nor "
                    "be longer than max_segment %lld", (long long)s, starts[s], starts[s + 1],
                    (long long)max_segment));
    const int64_t heads = q.cols / head_dim, group = heads / (k.cols / head_dim);
    with_activation_type([&](auto act_tag) {
      using A = decltype(act_tag);
      // Item = (query row, query head); the KV rows are activations, read in place.
      auto body = [&](int64_t item, int worker) {
        const int64_t t = item / heads, head = item % heads, kv_head = head / group;
        const int64_t s = int64_t(std::upper_bound(starts, starts + segments + 1, int32_t(t)) - starts) - 1;
        const A* query = row_of<const A>(q, t) + head * head_dim;
        float* acc = scratch_.data() + worker * scratch_per_thread_;  // [head_dim]
        std::fill(acc, acc + head_dim, 0.0f);
        float running_max = -INFINITY, running_sum = 0.0f;
        for (int64_t r = starts[s]; r < starts[s + 1]; r++) {
          const A* key = row_of<const A>(k, r) + kv_head * head_dim;
          const A* value = row_of<const A>(v, r) + kv_head * head_dim;
          const float score = dot(query, key, head_dim) * scale;  // (q @ k^T) * scaling
          if (score > running_max) {  // online softmax: rescale only when the maximum grows
            const float correction = std::exp(running_max - score);
            running_sum *= correction;
            for (int64_t d = 0; d < head_dim; d++) acc[d] *= correction;
            running_max = score;
          }
          const float p = std::exp(score - running_max);
          running_sum += p;
          for (int64_t d = 0; d < head_dim; d++) acc[d] += p * to_float(value[d]);
        }
        A* dst = row_of<A>(out, t) + head * head_dim;
        // a row's segment holds at least the row itself, so running_sum >= 1
        for (int64_t d = 0; d < head_dim; d++) dst[d] = from_float<A>(acc[d] / running_sum);
      };
      pool_.run(q.rows * heads, body);
    });
  }

  void impl_kv_write(const KVCacheView& cache, int64_t layer, const Tensor& k, const Tensor& v,
                     const Tensor& slots) override {
    const KVPageLayout& layout = cache.layout;
    const int32_t* slot = ints(slots);
    for (int64_t t = 0; t < k.rows; t++)
      if (slot[t] >= 0 && slot[t] / layout.page_tokens >= cache.num_pages)
        fail(ErrorCode::invalid_argument,
             format("kv_write: slots[%lld] = %d is page %lld, past the cache's %lld pages of %lld tokens",
                    (long long)t, slot[t], (long long)(slot[t] / layout.page_tokens), (long long)cache.num_pages,
                    (long long)layout.page_tokens));
    const float scales[2] = {layer_scale(cache.k_scales, layer), layer_scale(cache.v_scales, layer)};
    with_kv_and_activation_types(cache.dtype, [&](auto tag, auto act_tag) {
      using E = decltype(tag);
      using A = decltype(act_tag);
      auto body = [&](int64_t t, int) {
        if (slot[t] < 0) return;
        const int64_t page = slot[t] / layout.page_tokens, offset = slot[t] % layout.page_tokens;
        for (int kv = 0; kv < 2; kv++) {
          const A* src = row_of<const A>(kv == 0 ? k : v, t);
          // kv_heads consecutive heads of head_dim: one run of kv_heads * head_dim elements
          E* dst = static_cast<E*>(cache.pages) + layout.offset(page, layer, kv, offset, 0);
          for (int64_t c = 0; c < k.cols; c++) dst[c] = kv_store<E>(to_float(src[c]), scales[kv]);
        }
      };
      pool_.run(k.rows, body);
    });
  }

  void impl_attention(const Tensor& q, const KVCacheView& cache, int64_t layer, const AttentionBatch& batch,
                      float scale, const Tensor& out, const AttentionOptions& options) override {
    const KVPageLayout& layout = cache.layout;
    const int64_t head_dim = layout.head_dim, kv_heads = layout.kv_heads;
    if (head_dim > max_head_dim_)
      fail(ErrorCode::invalid_argument,
           format("attention: head_dim %lld is larger than the CPU backend's max_head_dim %lld; make the backend "
                  "with CpuBackendOptions::max_head_dim >= %lld", (long long)head_dim, (long long)max_head_dim_,
                  (long long)head_dim));
    check_attention_batch(q, cache, batch, options.window);

    if (fast_isa_ != CpuIsa::automatic && act_ == DType::F32 && is_cpu_float(cache.dtype))
      return fast_attention(q, cache, layer, batch, scale, out, options);
    const float k_scale = layer_scale(cache.k_scales, layer), v_scale = layer_scale(cache.v_scales, layer);
    with_kv_and_activation_types(cache.dtype, [&](auto tag, auto act_tag) {
      using E = decltype(tag);
      using A = decltype(act_tag);
      const int64_t group = q.cols / head_dim / kv_heads;  // query heads per KV head
      // Item = (query token, KV head): the KV head's rows are converted once and used by its whole group.
      auto body = [&](int64_t item, int worker) {
        const ItemSpan span = item_span(batch, kv_heads, item, options.window);
        const int64_t t = span.t, kv_head = span.kv_head, first = span.first, last = span.last;
        const float cap = options.logit_softcap;
        const int32_t* pages = row_of<const int32_t>(batch.block_tables, span.seq);
        float* key = scratch_.data() + worker * scratch_per_thread_;  // [head_dim]
        float* value = key + max_head_dim_;                           // [head_dim]
        float* acc = value + max_head_dim_;                           // [kHeadsPerPass, max_head_dim]
        for (int64_t h0 = 0; h0 < group; h0 += kHeadsPerPass) {
          const int64_t pass = std::min<int64_t>(kHeadsPerPass, group - h0);
          const int64_t first_head = kv_head * group + h0;
          float running_max[kHeadsPerPass], running_sum[kHeadsPerPass];
          for (int64_t h = 0; h < pass; h++) {
            running_max[h] = -INFINITY;
            running_sum[h] = 0.0f;
            std::fill(acc + h * max_head_dim_, acc + h * max_head_dim_ + head_dim, 0.0f);
          }
          for (int64_t c = first; c <= last; c++) {
            const int64_t page = pages[c / layout.page_tokens], offset = c % layout.page_tokens;
            const E* k_src = static_cast<const E*>(cache.pages) + layout.offset(page, layer, 0, offset, kv_head);
            const E* v_src = static_cast<const E*>(cache.pages) + layout.offset(page, layer, 1, offset, kv_head);
            for (int64_t d = 0; d < head_dim; d++) key[d] = kv_load(k_src[d], k_scale);
            for (int64_t d = 0; d < head_dim; d++) value[d] = kv_load(v_src[d], v_scale);
            for (int64_t h = 0; h < pass; h++) {
              const A* query = row_of<const A>(q, t) + (first_head + h) * head_dim;
              float* a = acc + h * max_head_dim_;
              float score = dot(query, key, head_dim) * scale;  // (q @ k^T) * scaling
              // gemma2: attn_weights = attn_weights / softcap; tanh(attn_weights); attn_weights * softcap
              if (cap > 0.0f) score = std::tanh(score / cap) * cap;
              // Online softmax: rescale what is summed only when the maximum grows.
              if (score > running_max[h]) {
                const float correction = std::exp(running_max[h] - score);  // exp(-inf) = 0 at the start
                running_sum[h] *= correction;
                for (int64_t d = 0; d < head_dim; d++) a[d] *= correction;
                running_max[h] = score;
              }
              const float p = std::exp(score - running_max[h]);
              running_sum[h] += p;
              for (int64_t d = 0; d < head_dim; d++) a[d] += p * value[d];
            }
          }
          for (int64_t h = 0; h < pass; h++) {
            A* dst = row_of<A>(out, t) + (first_head + h) * head_dim;
            const float* a = acc + h * max_head_dim_;
            // a query sees at least its own token, so running_sum >= 1
            for (int64_t d = 0; d < head_dim; d++) dst[d] = from_float<A>(a[d] / running_sum[h]);
          }
        }
      };
      pool_.run(q.rows * kv_heads, body);
    });
  }

 private:
  // Attention's work item (query token t, KV head) and what it sees: cache positions [first, last] of sequence
  // seq, last its own position and first 0 or past the sliding window (kv_idx > q_idx - window).
  struct ItemSpan {
    int64_t t, kv_head, seq, first, last;
  };
  static ItemSpan item_span(const AttentionBatch& batch, int64_t kv_heads, int64_t item, int64_t window) {
    const int32_t* starts = ints(batch.query_starts);
    const int32_t* context = ints(batch.context_lens);
    const int64_t seqs = batch.context_lens.elements();
    const int64_t t = item / kv_heads;
    const int64_t s = int64_t(std::upper_bound(starts, starts + seqs + 1, int32_t(t)) - starts) - 1;
    const int64_t last = context[s] - (starts[s + 1] - starts[s]) + (t - starts[s]);
    return {t, item % kv_heads, s, window > 0 ? std::max<int64_t>(0, last - window + 1) : 0, last};
  }

  // The fast kernels' attention (cpu_attention.inl) for F32 activations and F32 / BF16 / F16 KV: the same items
  // (query token, KV head) and spans as the reference above, checked by it already.
  void fast_attention(const Tensor& q, const KVCacheView& cache, int64_t layer, const AttentionBatch& batch,
                      float scale, const Tensor& out, const AttentionOptions& options) {
    const KVPageLayout& layout = cache.layout;
    const int64_t head_dim = layout.head_dim, kv_heads = layout.kv_heads;
    const int64_t group = q.cols / head_dim / kv_heads;  // query heads per KV head
    static_assert(kHeadsPerPass <= cpu_fast::kAttentionMaxHeads, "an item's heads fit the scores on its stack");
    with_float_type(cache.dtype, [&](auto tag) {
      using E = decltype(tag);
      auto body = [&](int64_t item, int worker) {
        const ItemSpan item_at = item_span(batch, kv_heads, item, options.window);
        const int64_t t = item_at.t, kv_head = item_at.kv_head;
        const cpu_fast::AttentionSpan span{row_of<const int32_t>(batch.block_tables, item_at.seq), item_at.first,
                                           item_at.last};
        float* acc = scratch_.data() + worker * scratch_per_thread_ + 2 * max_head_dim_;  // [kHeadsPerPass, max_head_dim]
        for (int64_t h0 = 0; h0 < group; h0 += kHeadsPerPass) {
          const int64_t first_head = kv_head * group + h0;
          cpu_fast::attention_item(fast_isa_, row_of<const float>(q, t) + first_head * head_dim,
                                   std::min<int64_t>(kHeadsPerPass, group - h0), static_cast<const E*>(cache.pages),
                                   layout, layer, kv_head, span, scale, options.logit_softcap, acc, max_head_dim_,
                                   row_of<float>(out, t) + first_head * head_dim);
        }
      };
      pool_.run(q.rows * kv_heads, body);
    });
  }

  // ATen's GeluType::Tanh: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))); GeluType::None:
  // x * 0.5 (1 + erf(x / sqrt 2)).
  static float gelu_of(float v, GeluApprox approx) {
    if (approx == GeluApprox::tanh) {
      const float beta = float(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
      return 0.5f * v * (1.0f + std::tanh(beta * (v + kappa * v * v * v)));
    }
    return v * 0.5f * (1.0f + std::erf(v * float(M_SQRT1_2)));
  }

  static constexpr uint64_t kTokenBlock = 32, kRowBlock = 16;  // linear work item
  static constexpr int kTileTokens = 4, kTileRows = 2;          // linear register tile
  static constexpr int64_t kHeadsPerPass = kCpuHeadsPerPass;
  static constexpr int64_t kQuantTokenChunk = kCpuQuantTokenChunk;
  static_assert(kTokenBlock % kTileTokens == 0 && kRowBlock % kTileRows == 0, "blocks must hold whole tiles");

  // LlamaRMSNorm in float32: variance = mean(x^2); x * rsqrt(variance + eps); weight * that.
  // The sum of squares is taken in double, so the variance is the correctly rounded mean.
  // x and out are activations of type A (out may be x).
  template <class A, class W>
  static void normalize(const A* x, const W* weight, int64_t n, float eps, A* out) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += double(to_float(x[i])) * double(to_float(x[i]));
    const float variance = float(sum / double(n));
    const float inv_rms = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < n; i++) out[i] = from_float<A>(to_float(weight[i]) * (to_float(x[i]) * inv_rms));
  }

  // Output rows [n0, n1) for tokens [t, t + TOKENS): the dot product, plus the bias (rounded to A first, as the
  // GPU's GEMM adds a C filled with the bias in A), rounded once to A when stored.
  template <int TOKENS, class A, class W>
  static void linear_rows(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out, int64_t t,
                          int64_t n0, int64_t n1, int64_t k_size) {
    const A* xs = row_of<const A>(x, t);
    auto store = [&](int64_t token, int64_t n, float value) {
      if (bias.data != nullptr) value = value + to_float(from_float<A>(float_at(bias, n)));
      row_of<A>(out, token)[n] = from_float<A>(value);
    };
    int64_t n = n0;
    for (; n + kTileRows <= n1; n += kTileRows) {
      float tile[TOKENS][kTileRows];
      linear_tile<TOKENS, kTileRows>(xs, x.row_stride, row_of<const W>(weight, n), weight.row_stride, k_size, tile);
      for (int i = 0; i < TOKENS; i++)
        for (int j = 0; j < kTileRows; j++) store(t + i, n + j, tile[i][j]);
    }
    for (; n < n1; n++) {
      float tile[TOKENS][1];
      linear_tile<TOKENS, 1>(xs, x.row_stride, row_of<const W>(weight, n), weight.row_stride, k_size, tile);
      for (int i = 0; i < TOKENS; i++) store(t + i, n, tile[i][0]);
    }
  }

  // Calls f(A{}) with A the storage type of the activations; the others f(T{}, A{}) with T that of `dtype` too
  // (a float operand: weight or table; or a KV cache element).
  template <class F>
  void with_activation_type(F&& f) const { with_float_type(act_, std::forward<F>(f)); }
  template <class F>
  void with_float_and_activation_types(DType dtype, F&& f) const {
    with_float_type(dtype, [&](auto tag) { with_activation_type([&](auto act_tag) { f(tag, act_tag); }); });
  }
  template <class F>
  void with_kv_and_activation_types(DType dtype, F&& f) const {
    with_kv_type(dtype, [&](auto tag) { with_activation_type([&](auto act_tag) { f(tag, act_tag); }); });
  }

  // What only the CPU can check cheaply: the values of the index vectors.
  // The pages a sequence's queries read must be the cache's: from the first query's window on (a sliding layer's
  // earlier pages may have gone back to the pool: -1), through its context.
  static void check_attention_batch(const Tensor& q, const KVCacheView& cache, const AttentionBatch& batch,
                                    int64_t window) {
    const int64_t seqs = batch.context_lens.elements(), page_tokens = cache.layout.page_tokens;
    const int32_t* starts = ints(batch.query_starts);
    const int32_t* context = ints(batch.context_lens);
    if (starts[0] != 0 || starts[seqs] != q.rows)
      fail(ErrorCode::invalid_argument,
           format("attention: query_starts must run from 0 to q's %lld rows; it runs from %d to %d",
                  (long long)q.rows, starts[0], starts[seqs]));
    for (int64_t s = 0; s < seqs; s++) {
      const int64_t queries = int64_t(starts[s + 1]) - starts[s];
      if (queries < 0)
        fail(ErrorCode::invalid_argument, format("attention: query_starts decreases at sequence %lld (%d then %d)",
                                                 (long long)s, starts[s], starts[s + 1]));
      if (context[s] < queries || context[s] > batch.max_context)
        fail(ErrorCode::invalid_argument,
             format("attention: sequence %lld has context_lens %d; it must be at least its %lld queries (they are "
                    "the last tokens of its context) and at most max_context %lld",
                    (long long)s, context[s], (long long)queries, (long long)batch.max_context));
      const int32_t* pages = row_of<const int32_t>(batch.block_tables, s);
      const int64_t first_query = int64_t(context[s]) - queries;
      const int64_t first_page = (window > 0 && first_query - window + 1 > 0 ? first_query - window + 1 : 0) / page_tokens;
      for (int64_t p = first_page; p < int64_t(ceil_div(uint64_t(context[s]), uint64_t(page_tokens))); p++)
        if (pages[p] < 0 || pages[p] >= cache.num_pages)
          fail(ErrorCode::invalid_argument,
               format("attention: block_tables[%lld][%lld] = %d is not a page of the cache (%lld pages) but "
                      "sequence %lld's context of %d tokens needs it",
                      (long long)s, (long long)p, pages[p], (long long)cache.num_pages, (long long)s, context[s]));
    }
  }

  DType act_;  // activation dtype: F32, BF16 or F16
  CpuIsa fast_isa_;  // the fast kernels' instruction set; automatic: the reference kernels (CpuKernels::reference)
  bool lowp_;        // CpuKernels::fast_lowp
  bool bf16_dot_;    // fast_lowp on a CPU with AVX-512 BF16: BF16 Linears through vdpbf16ps
  int bf16_stream_rows_;  // rows a one-token BF16 GEMV reads side by side (cpu_lowp::bf16_stream_rows_for_cpu)
  cpu_lowp::IntKernels int_kernels_;  // fast_lowp: the int4 / int8 kernels fast_isa_ runs (VNNI checked once)
  int64_t max_head_dim_;
  int64_t scratch_per_thread_;  // floats: key and value rows, then kHeadsPerPass accumulators
  std::vector<float> scratch_;  // [threads, scratch_per_thread_]
  int64_t max_quant_in_features_;
  bool fp8_activations_;
  bool int8_activations_;
  std::vector<float> dequant_scratch_;  // [threads, kQuantRowBlock, max_quant_in_features_] dequantized rows
  std::vector<float> requantized_;      // [kQuantTokenChunk, max_quant_in_features_] (fp8 / int8 activations only)
  std::vector<float> widened_;          // [kQuantTokenChunk, max_quant_in_features_] (16-bit activations only)
  std::vector<float> lowp_rows_;        // [kQuantTokenChunk, lowp_row_floats(max_quant_in_features_)] (fast_lowp only)
  ThreadPool pool_;
};

}  // namespace detail

const char* cpu_kernels_name(CpuKernels kernels) {
  switch (kernels) {
    case CpuKernels::reference: return "reference";
    case CpuKernels::fast: return "fast";
    case CpuKernels::fast_lowp: return "fast-lowp";
  }
  return "?";
}

const char* cpu_lm_head_name(CpuLmHead lm_head) {
  switch (lm_head) {
    case CpuLmHead::stored: return "stored";
    case CpuLmHead::int8: return "int8";
  }
  return "?";
}

namespace detail {
int cpu_threads_or_all(int threads) {
  return threads > 0 ? threads : int(std::max(1u, std::thread::hardware_concurrency()));
}
}  // namespace detail

int max_cpu_threads() {
  return int(std::max(1u, std::thread::hardware_concurrency())) * limits::max_threads_per_hardware_thread;
}

namespace detail {
void check_cpu_threads(int64_t threads, const char* what) {
  if (threads < 0 || threads > max_cpu_threads())
    fail(ErrorCode::invalid_argument,
         format("%s is %lld; it must be in 0..%d (0: one per hardware thread; at most the %u hardware threads x %d, "
                "KVLITE_MAX_THREADS_PER_HARDWARE_THREAD)", what, (long long)threads, max_cpu_threads(),
                std::max(1u, std::thread::hardware_concurrency()), limits::max_threads_per_hardware_thread));
}
}  // namespace detail

uint64_t cpu_backend_scratch_bytes(const CpuBackendOptions& options) {
  const detail::CpuScratchSizes s = detail::cpu_scratch_sizes(options);
  const uint64_t floats = uint64_t(s.threads) * uint64_t(s.attention_per_thread + s.dequant_per_thread) +
                          uint64_t(s.widened + s.requantized + s.lowp);
  return floats * sizeof(float);
}

Result<std::unique_ptr<Backend>> make_cpu_backend(const CpuBackendOptions& options) {
  return detail::guard([&]() -> std::unique_ptr<Backend> {
    detail::check_cpu_threads(options.threads, "make_cpu_backend: threads");
    // Scratch is threads x max_head_dim and threads x 16 x max_quant_in_features floats: both bounded.
    if (options.max_head_dim <= 0 || options.max_head_dim > limits::max_model_width ||
        options.max_quant_in_features <= 0 || options.max_quant_in_features > limits::max_model_width)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cpu_backend: max_head_dim %lld and max_quant_in_features %lld must be in "
                                  "1..%lld (KVLITE_MAX_MODEL_WIDTH)", (long long)options.max_head_dim,
                                  (long long)options.max_quant_in_features, (long long)limits::max_model_width));
    if (options.kernels != CpuKernels::reference && !cpu_isa_supported(options.isa))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cpu_backend: %s kernels for %s, which this CPU lacks (best here: %s)",
                                  cpu_kernels_name(options.kernels), cpu_isa_name(options.isa),
                                  cpu_isa_name(best_cpu_isa())));
    if (options.bf16_stream_rows != 0 && options.bf16_stream_rows != 1 &&
        options.bf16_stream_rows != detail::cpu_lowp::kBf16StreamRowsInterleaved)
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cpu_backend: bf16_stream_rows %d; it is 0 (the CPU's choice), 1 or %d",
                                  options.bf16_stream_rows, detail::cpu_lowp::kBf16StreamRowsInterleaved));
    if (!detail::is_cpu_float(options.activation_dtype))
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("make_cpu_backend: activation dtype %s; the CPU stores activations as F32 (the "
                                  "reference), BF16 or F16", dtype_name(options.activation_dtype)));
    return std::make_unique<detail::CpuBackend>(options);
  });
}

}  // namespace kvlite
