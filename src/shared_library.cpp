// libkvlite.so (CMake option KVLITE_BUILD_SHARED): the static library's objects, linked whole into a shared
// library, so that languages that load C libraries at run time (Python's ctypes, C#'s DllImport, Go's cgo, Rust)
// reach the C API without compiling anything. This file only gives the target a source of its own.
