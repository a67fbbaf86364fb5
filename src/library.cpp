// The one translation unit that holds kvlite's implementation in the kvlite::kvlite library. An app that
// does not use CMake can do the same: define KVLITE_IMPLEMENTATION in one .cpp before including kvlite.hpp.
#define KVLITE_IMPLEMENTATION
#include "../kvlite.hpp"  // the generated single header, not src/kvlite.hpp beside this file
