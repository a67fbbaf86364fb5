// kvlite.hpp with its implementation compiles with nothing included before it (in its own namespace of
// symbols: this object is never linked, it only has to compile).
#define KVLITE_IMPLEMENTATION
#include "kvlite.hpp"
#include "kvlite.hpp"  // a second include is harmless
