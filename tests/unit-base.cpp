// base: sizes, dtypes and the bit-exact scalar conversions (shared with the CUDA kernels).
#include <doctest/doctest.h>
#include "kvlite.hpp"
using namespace kvlite;
TEST_CASE("parse_size reads binary and decimal units") {
  CHECK(parse_size("8GiB").value() == 8ull * GiB);
}
