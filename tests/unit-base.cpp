// base: sizes, dtypes, errors, and the bit-exact scalar conversions shared with the CUDA kernels.
// The conversions are checked against independent formulations: exhaustive decoding by the format's
// definition, nearest-value search in double precision for encoding, and the compiler's _Float16.
#include <doctest/doctest.h>
#include "kvlite.hpp"
#include <cmath>
#include <random>

using namespace kvlite;

TEST_CASE("parse_size reads binary and decimal units and refuses nonsense") {
  CHECK(parse_size("8GiB").value() == 8ull * GiB);
  CHECK(parse_size("8 GiB").value() == 8ull * GiB);
  CHECK(parse_size("7.5G").value() == uint64_t(7.5 * double(GiB)));
  CHECK(parse_size("512MiB").value() == 512ull * MiB);
  CHECK(parse_size("8GB").value() == 8000000000ull);
  CHECK(parse_size("1e9").value() == 1000000000ull);
  CHECK(parse_size("4096").value() == 4096ull);
  for (const char* bad : {"", "GiB", "8 parsecs", "-1GiB", "8GiB?", "1e400", "nan"}) {
    auto r = parse_size(bad);
    CHECK_FALSE(r.ok());
    CHECK(r.error().code == ErrorCode::invalid_argument);
  }
  CHECK(parse_size("8 parsecs").error().message.find("8 parsecs") != std::string::npos);
}

TEST_CASE("format_bytes picks a readable unit") {
  CHECK(format_bytes(812) == "812 B");
  CHECK(format_bytes(300 * MiB) == "300.0 MiB");
  CHECK(format_bytes(8 * GiB) == "8.00 GiB");
  CHECK(format_bytes_signed(-int64_t(GiB)) == "-1.00 GiB");
}

TEST_CASE("dtype names and sizes follow safetensors") {
  CHECK(dtype_from_name("BF16") == DType::BF16);
  CHECK(dtype_from_name("F8_E4M3") == DType::F8_E4M3);
  CHECK_FALSE(dtype_from_name("BFLOAT16").has_value());
  CHECK(std::string(dtype_name(DType::I64)) == "I64");
  CHECK(dtype_bytes(DType::BF16, 3) == 6);
  CHECK(dtype_bytes(DType::F4, 3) == 2);  // 12 bits round up to 2 bytes
  CHECK(dtype_bytes(DType::F6_E2M3, 4) == 3);
}

TEST_CASE("Result carries a value or an error and guard converts exceptions") {
  Result<int> good(7);
  CHECK(good.ok());
  CHECK(*good == 7);
  Result<int> bad(Error(ErrorCode::bad_format, "broken"));
  CHECK_FALSE(bad.ok());
  CHECK_THROWS_AS(bad.value(), Error);
  auto r = detail::guard([]() -> int { detail::fail(ErrorCode::unsupported, "nope"); });
  CHECK(r.error().code == ErrorCode::unsupported);
  auto oom = detail::guard([]() -> int { throw std::bad_alloc(); });
  CHECK(oom.error().code == ErrorCode::out_of_memory);
}

TEST_CASE("bf16 decode is the top half of an fp32, encode rounds to nearest even") {
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; i++) {
    uint32_t b = bits(rng);
    float f = bits_to_float(b);
    if (std::isnan(f)) {
      CHECK(std::isnan(bf16_to_float(float_to_bf16(f))));
      continue;
    }
    uint16_t h = float_to_bf16(f);
    // Independent: the two bf16 neighbours of f by truncation, choose the nearer in double, ties to even.
    uint16_t lo = uint16_t(b >> 16), hi = uint16_t(lo + 1);
    double dlo = std::fabs(double(bf16_to_float(lo)) - double(f));
    double dhi = std::isinf(bf16_to_float(hi)) && !std::isinf(f) ? INFINITY : std::fabs(double(bf16_to_float(hi)) - double(f));
    if ((b & 0xffffu) == 0) { CHECK(h == lo); continue; }
    // Overflow to inf when rounding up past the largest finite bf16 is what RNE does.
    uint16_t expect = dlo < dhi ? lo : (dhi < dlo ? hi : ((lo & 1) ? hi : lo));
    if (std::isinf(dhi) && (b & 0x7fffffffu) >= 0x7f7f8000u) expect = hi;
    CHECK(h == expect);
  }
}

#if defined(__FLT16_MAX__)  // the compiler has _Float16 (g++ 12; clang 15 and later on x86-64)
TEST_CASE("f16 conversions agree with the compiler's _Float16 on every half and random floats") {
  for (uint32_t h = 0; h < 65536; h++) {
    _Float16 ref;
    uint16_t hb = uint16_t(h);
    memcpy(&ref, &hb, 2);
    float expect = float(ref), got = f16_to_float(hb);
    if (std::isnan(expect)) CHECK(std::isnan(got));
    else CHECK(float_to_bits(got) == float_to_bits(expect));
  }
  std::mt19937 rng(2);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; i++) {
    float f = bits_to_float(bits(rng));
    if (i % 2) f = bits_to_float((bits(rng) & 0x807fffffu) | (uint32_t(100 + i % 50) << 23));  // half's range
    _Float16 ref = _Float16(f);
    uint16_t expect;
    memcpy(&expect, &ref, 2);
    uint16_t got = float_to_f16(f);
    if (std::isnan(f)) CHECK((got & 0x7c00u) == 0x7c00u);
    else CHECK(got == expect);
  }
}
#else  // clang 14: no _Float16 on x86-64; check against IEEE binary16 by its definition instead
static double f16_definition(uint16_t v) {
  int sign = v >> 15, e = (v >> 10) & 31, m = v & 1023;
  double mag = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? std::ldexp(m, -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return sign ? -mag : mag;
}
TEST_CASE("f16 conversions agree with binary16 by its definition on every half and random floats") {
  for (uint32_t h = 0; h < 65536; h++) {
    double expect = f16_definition(uint16_t(h));
    float got = f16_to_float(uint16_t(h));
    if (std::isnan(expect)) CHECK(std::isnan(got));
    else CHECK(double(got) == expect);
  }
  std::mt19937 rng(2);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; i++) {
    float f = bits_to_float(bits(rng));
    if (i % 2) f = bits_to_float((bits(rng) & 0x807fffffu) | (uint32_t(100 + i % 50) << 23));  // half's range
    uint16_t got = float_to_f16(f);
    if (std::isnan(f)) {
      CHECK((got & 0x7c00u) == 0x7c00u);
      continue;
    }
    // nearest of the halves of f's sign (ties to the even one; past 65520 the nearest is infinity)
    const double x = std::fabs(double(f));
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    uint16_t best = 0;
    double best_distance = INFINITY;
    uint16_t lo = 0, hi = 0x7c00;  // binary search for the largest finite half <= x, then compare neighbours
    while (lo < hi) {
      uint16_t mid = uint16_t((lo + hi + 1) / 2);
      if (f16_definition(mid) <= x) lo = mid; else hi = uint16_t(mid - 1);
    }
    for (uint16_t c : {lo, uint16_t(lo + 1)}) {
      double value = c == 0x7c00 ? (x >= 65520.0 ? x : INFINITY) : f16_definition(c);
      double distance = std::fabs(value - x);
      if (distance < best_distance || (distance == best_distance && (c & 1) == 0)) best = c, best_distance = distance;
    }
    CHECK(got == uint16_t(sign | best));
  }
}
#endif

// FP8 e4m3fn by its definition: sign x 2^(e-7) x (1 + m/8), subnormals 2^-6 x m/8, S.1111.111 NaN.
static double fp8_definition(uint8_t v) {
  int sign = v >> 7, e = (v >> 3) & 15, m = v & 7;
  if (e == 15 && m == 7) return NAN;
  double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}

TEST_CASE("fp8 e4m3 decodes all 256 codes by the format's definition") {
  for (int v = 0; v < 256; v++) {
    double expect = fp8_definition(uint8_t(v));
    float got = fp8_e4m3_to_float(uint8_t(v));
    if (std::isnan(expect)) CHECK(std::isnan(got));
    else CHECK(double(got) == expect);
  }
  CHECK(fp8_e4m3_to_float(0x7e) == 448.0f);
}

TEST_CASE("fp8 e4m3 encode saturates and rounds to the nearest code, ties to even") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exponent(-12.0f, 10.0f);
  for (int i = 0; i < 100000; i++) {
    float f = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, int(exponent(rng))) * ((rng() & 1) ? -1.0f : 1.0f);
    if (i % 97 == 0) f = float(int(rng() % 900) - 450);
    uint8_t got = float_to_fp8_e4m3(f);
    // Nearest finite code by exhaustive search; ties to the even mantissa; beyond 448 saturate.
    int best = -1;
    double best_d = INFINITY;
    for (int v = 0; v < 256; v++) {
      double d = fp8_definition(uint8_t(v));
      if (std::isnan(d) || (std::signbit(d) != std::signbit(f) && d != 0.0)) continue;
      double dist = std::fabs(d - double(f));
      if (dist < best_d || (dist == best_d && (v & 1) == 0)) { best_d = dist; best = v; }
    }
    if (std::fabs(f) >= 448.0f) best = std::signbit(f) ? 0xfe : 0x7e;
    CHECK(double(fp8_e4m3_to_float(got)) == fp8_definition(uint8_t(best)));
  }
  CHECK(float_to_fp8_e4m3(1e9f) == 0x7e);
  CHECK(float_to_fp8_e4m3(-INFINITY) == 0xfe);
  CHECK(std::isnan(fp8_e4m3_to_float(float_to_fp8_e4m3(NAN))));
}

TEST_CASE("checked_mul and checked_add refuse sizes that overflow 64 bits, naming the quantity and operands") {
  using kvlite::detail::checked_add;
  using kvlite::detail::checked_mul;
  CHECK(checked_mul(1ull << 31, 1ull << 32, "x") == (1ull << 63));
  CHECK(checked_add(~0ull - 1, 1, "x") == ~0ull);
  try {
    checked_mul(1ull << 32, 1ull << 32, "block table bytes");
    FAIL("no error");
  } catch (const kvlite::Error& e) {
    CHECK(e.code == kvlite::ErrorCode::bad_format);
    CHECK(e.message == "block table bytes overflows 64 bits (4294967296 x 4294967296)");
  }
  try {
    checked_add(~0ull, 1, "arena bytes", kvlite::ErrorCode::invalid_argument);
    FAIL("no error");
  } catch (const kvlite::Error& e) {
    CHECK(e.code == kvlite::ErrorCode::invalid_argument);
    CHECK(e.message == "arena bytes overflows 64 bits (18446744073709551615 + 1)");
  }
}
