// test-threads-tsan: unit-threads.cpp under ThreadSanitizer, the library's implementation in the same TU, so
// that only this one file is built with -fsanitize=thread (a TSan build of every suite would cost CI minutes it
// does not have; tests/CMakeLists.txt). A data race TSan sees in any engine call the suite makes fails the run.
#define KVLITE_IMPLEMENTATION
#include "kvlite.hpp"
#include "unit-threads.cpp"
