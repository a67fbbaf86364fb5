// base: implementation.
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <sys/stat.h>

namespace kvlite {

const char* log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::debug: return "debug";
    case LogLevel::info: return "info";
    case LogLevel::warning: return "warning";
    case LogLevel::error: return "error";
  }
  return "unknown";
}

namespace detail {
struct LogSink {
  std::mutex mutex;
  LogCallback callback;
  std::atomic<int> min_level{int(LogLevel::error) + 1};  // nothing passes until a callback is set
};
inline LogSink& log_sink() {
  static LogSink sink;
  return sink;
}
inline const EngineLog*& current_engine_log() {
  static thread_local const EngineLog* log = nullptr;
  return log;
}
ScopedEngineLog::ScopedEngineLog(const EngineLog* log) : previous(current_engine_log()) { current_engine_log() = log; }
ScopedEngineLog::~ScopedEngineLog() { current_engine_log() = previous; }
bool log_enabled(LogLevel level) {
  const EngineLog* own = current_engine_log();
  if (own && own->callback) return int(level) >= int(own->min_level);
  return int(level) >= log_sink().min_level.load();
}
void log(LogLevel level, const std::string& message) {
  if (!log_enabled(level)) return;
  const EngineLog* own = current_engine_log();
  if (own && own->callback) {  // the engine's own: called on the thread of its call, one call at a time
    try {
      own->callback(level, own->prefix + message);
    } catch (...) {  // a host's callback must not unwind through kvlite
    }
    return;
  }
  LogSink& sink = log_sink();
  std::lock_guard<std::mutex> lock(sink.mutex);
  if (!sink.callback) return;
  try {
    sink.callback(level, own ? own->prefix + message : message);
  } catch (...) {  // a host's callback must not unwind through kvlite
  }
}
}  // namespace detail

void set_log_callback(LogCallback callback, LogLevel min_level) {
  detail::LogSink& sink = detail::log_sink();
  std::lock_guard<std::mutex> lock(sink.mutex);
  sink.callback = std::move(callback);
  sink.min_level.store(sink.callback ? int(min_level) : int(LogLevel::error) + 1);
}

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::io_error: return "io_error";
    case ErrorCode::bad_format: return "bad_format";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::missing_tensor: return "missing_tensor";
    case ErrorCode::does_not_fit: return "does_not_fit";
    case ErrorCode::out_of_memory: return "out_of_memory";
    case ErrorCode::device_error: return "device_error";
    case ErrorCode::cancelled: return "cancelled";
    case ErrorCode::internal: return "internal";
  }
  return "unknown";
}

namespace detail {
struct DTypeInfo {
  DType dtype;
  const char* name;
  int bits;
};
static const DTypeInfo kDTypes[] = {
    {DType::BOOL, "BOOL", 8},         {DType::U8, "U8", 8},
    {DType::I8, "I8", 8},             {DType::I16, "I16", 16},
    {DType::U16, "U16", 16},          {DType::F16, "F16", 16},
    {DType::BF16, "BF16", 16},        {DType::I32, "I32", 32},
    {DType::U32, "U32", 32},          {DType::F32, "F32", 32},
    {DType::F64, "F64", 64},          {DType::I64, "I64", 64},
    {DType::U64, "U64", 64},          {DType::C64, "C64", 64},
    {DType::F8_E4M3, "F8_E4M3", 8},   {DType::F8_E5M2, "F8_E5M2", 8},
    {DType::F8_E8M0, "F8_E8M0", 8},   {DType::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {DType::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8}, {DType::F4, "F4", 4},
    {DType::F6_E2M3, "F6_E2M3", 6},   {DType::F6_E3M2, "F6_E3M2", 6},
};
}  // namespace detail

const char* dtype_name(DType dtype) {
  for (const auto& info : detail::kDTypes)
    if (info.dtype == dtype) return info.name;
  return "?";
}
std::optional<DType> dtype_from_name(const std::string& name) {
  for (const auto& info : detail::kDTypes)
    if (name == info.name) return info.dtype;
  return std::nullopt;
}
int dtype_bits(DType dtype) {
  for (const auto& info : detail::kDTypes)
    if (info.dtype == dtype) return info.bits;
  return 0;
}
uint64_t dtype_bytes(DType dtype, uint64_t count) { return (count * uint64_t(dtype_bits(dtype)) + 7) / 8; }

Result<uint64_t> parse_size(const std::string& text) {
  return detail::guard([&]() -> uint64_t {
    auto bad = [&](const char* why) {
      detail::fail(ErrorCode::invalid_argument,
                   detail::format("cannot read '%s' as a size (%s); write e.g. 8GiB, 7.5GiB, 512MiB or a byte count",
                                  text.c_str(), why));
    };
    size_t i = 0;
    while (i < text.size() && isspace((unsigned char)text[i])) i++;
    size_t start = i;
    while (i < text.size() && (isdigit((unsigned char)text[i]) || text[i] == '.' || text[i] == 'e' || text[i] == 'E' ||
                               ((text[i] == '+' || text[i] == '-') && i > start && (text[i - 1] == 'e' || text[i - 1] == 'E'))))
      i++;
    if (i == start) bad("no number");
    std::string number = text.substr(start, i - start);
    char* end = nullptr;
    double value = strtod(number.c_str(), &end);
    if (!end || *end != '\0' || !std::isfinite(value)) bad("not a number");
    if (value < 0) bad("negative");
    while (i < text.size() && isspace((unsigned char)text[i])) i++;
    std::string unit = text.substr(i);
    while (!unit.empty() && isspace((unsigned char)unit.back())) unit.pop_back();
    std::string u;
    for (char c : unit) u += char(tolower((unsigned char)c));
    double mult = 1;
    if (u.empty() || u == "b") mult = 1;
    else if (u == "k" || u == "kib") mult = 1024.0;
    else if (u == "m" || u == "mib") mult = 1024.0 * 1024;
    else if (u == "g" || u == "gib") mult = 1024.0 * 1024 * 1024;
    else if (u == "t" || u == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
    else if (u == "kb") mult = 1e3;
    else if (u == "mb") mult = 1e6;
    else if (u == "gb") mult = 1e9;
    else if (u == "tb") mult = 1e12;
    else bad("unknown unit");
    double bytes = value * mult;
    if (bytes >= 1.8e19) bad("too large");
    return uint64_t(std::llround(bytes));
  });
}

std::string format_bytes(uint64_t bytes) {
  if (bytes >= GiB) return detail::format("%.2f GiB", double(bytes) / double(GiB));
  if (bytes >= MiB) return detail::format("%.1f MiB", double(bytes) / double(MiB));
  if (bytes >= KiB) return detail::format("%.1f KiB", double(bytes) / double(KiB));
  return detail::format("%llu B", (unsigned long long)bytes);
}
std::string format_bytes_signed(int64_t bytes) {
  if (bytes < 0) return "-" + format_bytes(uint64_t(-(bytes + 1)) + 1);
  return format_bytes(uint64_t(bytes));
}

namespace detail {
void fail(ErrorCode code, std::string message) { throw Error(code, std::move(message)); }

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  int n = vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out(n > 0 ? size_t(n) : 0, '\0');
  if (n > 0) vsnprintf(&out[0], size_t(n) + 1, fmt, args);
  va_end(args);
  return out;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io_error, format("cannot open %s: %s", path.c_str(), strerror(errno)));
  // Read in chunks up to the limit, so that neither a huge file nor an endless one (a FIFO, /dev/zero behind a
  // symlink) is read whole.
  std::string text;
  char chunk[64 * 1024];
  while (in) {
    in.read(chunk, sizeof chunk);
    text.append(chunk, size_t(in.gcount()));
    if (text.size() > uint64_t(limits::max_json_bytes))
      fail(ErrorCode::bad_format, format("%s is larger than kvlite's limit of %lld bytes for a JSON file "
                                         "(KVLITE_MAX_JSON_BYTES): it is not a model's configuration",
                                         path.c_str(), (long long)limits::max_json_bytes));
  }
  if (in.bad()) fail(ErrorCode::io_error, format("cannot read %s", path.c_str()));
  return text;
}
void check_json_nesting(std::string_view text, const std::string& origin) {
  int64_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); i++) {
    char c = text[i];
    if (in_string) {
      if (c == '\\') i++;  // skip the escaped character
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limits::max_json_depth)
        fail(ErrorCode::bad_format, format("%s: JSON nested more than %lld deep at byte %zu (KVLITE_MAX_JSON_DEPTH); "
                                           "real configuration files nest under 10", origin.c_str(),
                                           (long long)limits::max_json_depth, i));
    } else if (c == ']' || c == '}') {
      depth--;
    }
  }
}
}  // namespace detail

Status check_json_limits(std::string_view text, const std::string& origin) {
  return detail::guard([&] {
    if (text.size() > uint64_t(limits::max_json_bytes))
      detail::fail(ErrorCode::bad_format, detail::format("%s: %zu bytes of JSON; at most %lld (KVLITE_MAX_JSON_BYTES)",
                                                         origin.c_str(), text.size(), (long long)limits::max_json_bytes));
    detail::check_json_nesting(text, origin);
  });
}

namespace detail {
bool file_exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
std::string path_join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}
uint64_t checked_mul(uint64_t a, uint64_t b, const char* what, ErrorCode code) {
  uint64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product))
    fail(code, format("%s overflows 64 bits (%llu x %llu)", what, (unsigned long long)a, (unsigned long long)b));
  return product;
}
uint64_t checked_add(uint64_t a, uint64_t b, const char* what, ErrorCode code) {
  uint64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum))
    fail(code, format("%s overflows 64 bits (%llu + %llu)", what, (unsigned long long)a, (unsigned long long)b));
  return sum;
}
}  // namespace detail

}  // namespace kvlite
