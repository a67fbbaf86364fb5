// kvlite: the command-line tool. Uses the public API only.
#include "kvlite.hpp"
#include <cstdio>
int main() { printf("kvlite %s\n", KVLITE_VERSION_STRING); return 0; }
