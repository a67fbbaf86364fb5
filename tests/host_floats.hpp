// Float data on the host for the tests: values of a float dtype (F32, BF16, F16) read from and written to bytes;
// seeded random values (never near zero); matrices of any float dtype poisoned with NaN and padded with NaN
// between rows (so a missed or stray write shows up); and a tolerance comparison that reports the worst element.
#pragma once
#include <doctest/doctest.h>
#include "kvlite.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace host_floats {

using namespace kvlite;

// The value at `p`, stored as `dtype` (F32 for any dtype but BF16, F16 and F8_E4M3).
inline float decode(DType dtype, const uint8_t* p) {
  uint16_t h;
  float f;
  switch (dtype) {
    case DType::BF16: memcpy(&h, p, 2); return bf16_to_float(h);
    case DType::F16: memcpy(&h, p, 2); return f16_to_float(h);
    case DType::F8_E4M3: return fp8_e4m3_to_float(*p);
    default: memcpy(&f, p, 4); return f;
  }
}
// Stores `value` at `p` as `dtype`, rounded to nearest even (F32 for any dtype but BF16, F16 and F8_E4M3, which
// saturates to +-448).
inline void encode(DType dtype, float value, uint8_t* p) {
  uint16_t h;
  switch (dtype) {
    case DType::BF16: h = float_to_bf16(value); memcpy(p, &h, 2); return;
    case DType::F16: h = float_to_f16(value); memcpy(p, &h, 2); return;
    case DType::F8_E4M3: *p = float_to_fp8_e4m3(value); return;
    default: memcpy(p, &value, 4); return;
  }
}

struct Random {
  std::mt19937_64 engine;
  explicit Random(uint64_t seed) : engine(seed) {}
  // Uniform in [-scale, scale], never within scale/1000 of zero.
  float value(float scale = 1.0f) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (;;) {
      const float v = u(engine);
      if (std::fabs(v) > 1e-3f) return v * scale;
    }
  }
  int64_t below(int64_t n) { return int64_t(engine() % uint64_t(n)); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(engine); }
};

// rows x cols elements with `pad` NaN elements after each row; starts as NaN.
struct Matrix {
  DType dtype;
  int64_t rows, cols, stride;
  std::vector<uint8_t> bytes;
  Matrix(DType dtype_, int64_t rows_, int64_t cols_, int64_t pad = 0)
      : dtype(dtype_), rows(rows_), cols(cols_), stride(cols_ + pad),
        bytes(size_t(std::max<int64_t>(rows_ * (cols_ + pad), 1)) * dtype_bytes(dtype_, 1)) {
    poison();
  }
  int64_t element_bytes() const { return int64_t(dtype_bytes(dtype, 1)); }
  int64_t elements() const { return int64_t(bytes.size()) / element_bytes(); }
  Tensor view() { return Tensor{bytes.data(), dtype, rows, cols, stride}; }
  float get(int64_t r, int64_t c) const { return decode(dtype, &bytes[size_t((r * stride + c) * element_bytes())]); }
  void set(int64_t r, int64_t c, float v) { encode(dtype, v, &bytes[size_t((r * stride + c) * element_bytes())]); }
  void poison() {
    for (size_t i = 0; i < bytes.size(); i += size_t(element_bytes())) encode(dtype, NAN, &bytes[i]);
  }
  void randomize(Random& rng, float scale = 1.0f) {
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = 0; c < cols; c++) set(r, c, rng.value(scale));
  }
  // True when every padding element is still NaN (nothing wrote outside the view).
  bool padding_untouched() const {
    for (int64_t r = 0; r < rows; r++)
      for (int64_t c = cols; c < stride; c++)
        if (!std::isnan(get(r, c))) return false;
    return true;
  }
};

// Compares got against a reference within abs_tol + rel_tol * |ref| (+ an element's own allowance), keeping the
// worst element. Fails when nothing was compared, or when got is not finite where the reference is.
struct Compare {
  Compare(double abs_tolerance, double rel_tolerance) : abs_tol(abs_tolerance), rel_tol(rel_tolerance) {}
  double abs_tol, rel_tol;
  double worst_excess = -1;  // max(|got - ref| - tolerance); <= 0 passes
  std::string worst;
  int64_t nonfinite = 0, count = 0;
  // `extra`: an element's own allowance on top (e.g. a bound on rounding in a sum)
  void operator()(double got, double ref, int64_t r, int64_t c, double extra = 0) {
    count++;
    if (std::isfinite(ref) && !std::isfinite(got)) {
      if (nonfinite++ == 0) worst = at(got, ref, r, c);
      return;
    }
    const double excess = std::fabs(got - ref) - (abs_tol + rel_tol * std::fabs(ref) + extra);
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = at(got, ref, r, c);
    }
  }
  static std::string at(double got, double ref, int64_t r, int64_t c) {
    char text[160];
    snprintf(text, sizeof text, "at [%lld, %lld]: got %.9g, expected %.9g", (long long)r, (long long)c, got, ref);
    return text;
  }
  bool ok() const { return count > 0 && nonfinite == 0 && worst_excess <= 0; }
};

}  // namespace host_floats

#define CHECK_COMPARE(cmp) \
  do {                     \
    INFO((cmp).worst);     \
    CHECK((cmp).ok());     \
  } while (0)
