// kvlite.hpp compiles with nothing included before it (declarations only).
#include "kvlite.hpp"
int kvlite_header_alone_probe() { return KVLITE_VERSION_MAJOR; }
