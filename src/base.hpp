// ---------------------------------------------------------------------------------------------------------
// base: errors and results, dtypes and their bit-exact conversions, byte sizes, small utilities.
// ---------------------------------------------------------------------------------------------------------
#pragma once
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#define KVLITE_HD __host__ __device__ __forceinline__
#else
#define KVLITE_HD inline
#endif

#define KVLITE_VERSION_MAJOR 0
#define KVLITE_VERSION_MINOR 1
#define KVLITE_VERSION_PATCH 0
#define KVLITE_VERSION_STRING "0.1.0"

namespace kvlite {

// ---- errors ---------------------------------------------------------------------------------------------
// Stable codes: programs may switch on them; the message is for people and carries the numbers.
enum class ErrorCode : int {
  ok = 0,
  invalid_argument = 1,  // a bad option or parameter (utilization 1.5, "8GB?")
  io_error = 2,          // a file could not be opened, read or mapped
  bad_format = 3,        // a file is malformed (truncated safetensors, bad JSON, wrong shapes)
  unsupported = 4,       // well-formed but not supported (unknown architecture, dtype, quantization)
  missing_tensor = 5,    // a tensor the model needs is absent
  does_not_fit = 6,      // the plan does not fit the memory budget
  out_of_memory = 7,     // an allocation failed (arena, pages)
  device_error = 8,      // a CUDA call failed
  cancelled = 9,         // the caller cancelled the work
  internal = 10,         // a bug in kvlite
};
const char* error_code_name(ErrorCode code);

// kvlite never prints: its diagnostics (an engine opened and on what, preemptions, cancels) go to the log
// callback, process-wide, when one is set (an engine's own messages start with its name, and go to
// EngineOptions::log instead when that engine has one). The callback may run on any thread that calls kvlite (one at a time:
// calls are serialized); it must not call kvlite. An exception it throws is dropped.
enum class LogLevel : int { debug = 0, info = 1, warning = 2, error = 3 };
const char* log_level_name(LogLevel level);  // "debug", "info", "warning", "error"
using LogCallback = std::function<void(LogLevel level, const std::string& message)>;
// nullptr (the default) drops everything; messages below min_level are not even formatted.
void set_log_callback(LogCallback callback, LogLevel min_level = LogLevel::info);

struct Error : std::exception {
  ErrorCode code = ErrorCode::internal;
  std::string message;
  Error() = default;
  Error(ErrorCode c, std::string m) : code(c), message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

// Result<T>: a value or an Error. Every fallible public call returns one; the library never throws past its
// boundary, never aborts and never exits. value() on an error throws the Error (the caller asked for it).
template <class T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit on purpose, `return value;`
  Result(Error error) : error_(std::move(error)) {}  // NOLINT
  bool ok() const { return value_.has_value(); }
  explicit operator bool() const { return ok(); }
  const Error& error() const { return error_; }
  T& value() & { check(); return *value_; }
  const T& value() const& { check(); return *value_; }
  T&& value() && { check(); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }
  const T& operator*() const { return value(); }

 private:
  void check() const { if (!value_) throw error_; }
  std::optional<T> value_;
  Error error_;
};

template <>
class Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  const Error& error() const { return error_; }
  void value() const { if (!ok_) throw error_; }

 private:
  Error error_;
  bool ok_ = true;
};
using Status = Result<void>;

// ---- dtypes ---------------------------------------------------------------------------------------------
// The safetensors dtype set, in the reference reader's names.
enum class DType : uint8_t {
  BOOL, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64, C64,
  F8_E4M3, F8_E5M2, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, F4, F6_E2M3, F6_E3M2,
};
const char* dtype_name(DType dtype);
std::optional<DType> dtype_from_name(const std::string& name);  // "BF16" -> DType::BF16
int dtype_bits(DType dtype);                                     // bits per element (F4: 4, F6_*: 6)
// Bytes for `count` elements, rounded up to whole bytes (sub-byte types pack densely).
uint64_t dtype_bytes(DType dtype, uint64_t count);

// ---- bit-exact scalar conversions (host and device; unit-tested on the CPU) ----------------------------
KVLITE_HD float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
KVLITE_HD uint32_t float_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return bits;
}
// bf16 is the top half of an fp32.
KVLITE_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
// Round to nearest even, as torch's .to(bfloat16) does; NaN stays a (quiet) NaN.
KVLITE_HD uint16_t float_to_bf16(float f) {
  uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t((bits + rounding) >> 16);
}
// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa.
KVLITE_HD float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * (1.0f / 16777216.0f);
    return (sign ? -v : v);
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}
// Round to nearest even with overflow to inf, as a C cast to _Float16 does.
KVLITE_HD uint16_t float_to_f16(float f) {
  uint32_t bits = float_to_bits(f);
  uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);          // nan
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);         // >= 65520 rounds to inf
  if (abs < 0x38800000u) {                                         // below 2^-14: subnormal or zero
    // value / 2^-24, rounded to nearest even
    float v = bits_to_float(abs) * 16777216.0f;
    uint32_t q = uint32_t(v);
    float rem = v - float(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
    return uint16_t(sign | q);
  }
  uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
  abs += rounding;
  return uint16_t(sign | (((abs >> 23) - 112u) << 10) | ((abs >> 13) & 0x3ffu));
}
// FP8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinity; S.1111.111 is NaN; max 448.
KVLITE_HD float fp8_e4m3_to_float(uint8_t v) {
  uint32_t sign = uint32_t(v & 0x80u) << 24, exp = (v >> 3) & 0xfu, man = v & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_to_float(sign | 0x7fc00000u);
  if (exp == 0) {
    float m = float(man) * (1.0f / 512.0f);  // subnormal: man * 2^-9
    return sign ? -m : m;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}
// Saturating round-to-nearest-even conversion (a plain cast does not saturate: clamp first, as
// torch's scaled_fp8 paths do). NaN maps to NaN.
KVLITE_HD uint8_t float_to_fp8_e4m3(float f) {
  uint32_t bits = float_to_bits(f);
  uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint8_t(sign | 0x7fu);
  if (abs >= 0x43e00000u) return uint8_t(sign | 0x7eu);  // >= 448 (and inf) saturates to 448
  if (abs < 0x3c800000u) {                               // below 2^-6: subnormal, step 2^-9
    float v = bits_to_float(abs) * 512.0f;
    uint32_t q = uint32_t(v);
    float rem = v - float(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
    return uint8_t(sign | q);  // q == 8 is exactly the smallest normal, encoded 0x08
  }
  uint32_t rounding = 0x7ffffu + ((abs >> 20) & 1u);
  abs += rounding;
  uint32_t e = (abs >> 23) - 120u, m = (abs >> 20) & 0x7u;
  if (e > 15 || (e == 15 && m == 7)) return uint8_t(sign | 0x7eu);
  return uint8_t(sign | (e << 3) | m);
}

// ---- sizes and text ---------------------------------------------------------------------------------------
// "8GiB", "8 GiB", "7.5G", "512MiB", "1e9", "8192" -> bytes. GB/MB are decimal, GiB/G/MiB/M binary.
Result<uint64_t> parse_size(const std::string& text);
std::string format_bytes(uint64_t bytes);        // "5.21 GiB", "300.0 MiB", "812 B"
std::string format_bytes_signed(int64_t bytes);  // "-1.05 GiB"

constexpr uint64_t KiB = 1024ull, MiB = 1024ull * KiB, GiB = 1024ull * MiB;

// Files kvlite reads whole (config.json, tokenizer.json, tokenizer_config.json, preprocessor_config.json, the
// safetensors index) are refused past this size: the largest real tokenizer.json is about 35 MB.
#ifndef KVLITE_MAX_JSON_BYTES
#define KVLITE_MAX_JSON_BYTES 268435456
#endif
// ... and nested deeper than this (real files nest under 10): deep nesting overflows the stack of a recursive
// reader or of nlohmann's dump().
#ifndef KVLITE_MAX_JSON_DEPTH
#define KVLITE_MAX_JSON_DEPTH 64
#endif
namespace limits {
constexpr int64_t max_json_bytes = KVLITE_MAX_JSON_BYTES;
constexpr int64_t max_json_depth = KVLITE_MAX_JSON_DEPTH;
}  // namespace limits
inline uint64_t align_up(uint64_t value, uint64_t alignment) { return (value + alignment - 1) / alignment * alignment; }
inline uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// JSON text checked against the library's limits before it is parsed: at most KVLITE_MAX_JSON_BYTES bytes and
// KVLITE_MAX_JSON_DEPTH levels of nesting (bad_format naming `origin`). Every file kvlite parses goes through
// this; applications that parse JSON from outside with the same limits call it too (kvlite serve's bodies).
Status check_json_limits(std::string_view text, const std::string& origin);

namespace detail {
// Internal code reports failure by throwing kvlite::Error; public entry points catch it with guard().
[[noreturn]] void fail(ErrorCode code, std::string message);
// An engine's own log (EngineOptions::name, log, log_level), in effect on the thread running one of its calls
// (or its open): its messages start with "<name>: " and go to its callback when it has one, else to the
// process-wide one. ScopedEngineLog sets it for a scope and puts the previous one back.
struct EngineLog {
  std::string prefix;  // "<name>: "
  LogCallback callback;
  LogLevel min_level = LogLevel::info;
};
struct ScopedEngineLog {
  explicit ScopedEngineLog(const EngineLog* log);
  ~ScopedEngineLog();
  ScopedEngineLog(const ScopedEngineLog&) = delete;
  ScopedEngineLog& operator=(const ScopedEngineLog&) = delete;
  const EngineLog* previous;
};
// To the running engine's log callback, else the process-wide one (set_log_callback), if `level` passes its minimum.
bool log_enabled(LogLevel level);
void log(LogLevel level, const std::string& message);
std::string format(const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
// Runs f and turns any exception into a Result: kvlite::Error as is, bad_alloc as out_of_memory,
// anything else as internal.
template <class F>
auto guard(F&& f) -> Result<decltype(f())> {
  using T = decltype(f());
  try {
    if constexpr (std::is_void_v<T>) {
      f();
      return Result<void>();
    } else {
      return Result<T>(f());
    }
  } catch (const Error& e) {
    return e;
  } catch (const std::bad_alloc&) {
    return Error(ErrorCode::out_of_memory, "out of host memory");
  } catch (const std::exception& e) {
    return Error(ErrorCode::internal, std::string("internal error: ") + e.what());
  }
}
// Overflow-checked size arithmetic: every product or sum that sizes memory or bounds a loop over untrusted
// sizes goes through these. `what` names the quantity in the error ("KV page pool bytes"); the error carries
// both operands so the user sees which number was absurd.
uint64_t checked_mul(uint64_t a, uint64_t b, const char* what, ErrorCode code = ErrorCode::bad_format);
uint64_t checked_add(uint64_t a, uint64_t b, const char* what, ErrorCode code = ErrorCode::bad_format);
// Refuses (bad_format, naming `origin`) JSON text nested deeper than limits::max_json_depth; run before parsing.
void check_json_nesting(std::string_view text, const std::string& origin);
std::string read_text_file(const std::string& path);  // throws io_error naming the path
bool file_exists(const std::string& path);
std::string path_join(const std::string& dir, const std::string& name);
}  // namespace detail

}  // namespace kvlite
