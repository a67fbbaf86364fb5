#!/usr/bin/env bash
# The device machine's environment, reproduced here (dev tool; run as root): in a private mount namespace
# (unshare -m, /usr overlaid with a tmpfs, the paths removed in that overlay only) the Debian -dev files kvlite
# builds against are hidden -- the headers, link libraries, static archives, pkg-config and CMake files of nlohmann-json, doctest, pcre2, libjpeg-turbo and stb, and pkg-config
# itself -- as the device machine (nvcc 13, CMake, ninja, python3, none of those packages) lacks them. Then what a
# device call does is run there, each step reported PASS or FAIL:
#   1. the hiding holds (headers, pkg-config and the CMake configs are really gone)
#   2. gpu-bundle/ (tools/build-gpu-bundle.sh), when present: tools/use-gpu-bundle.sh accepts it (and refuses it
#      with another source stamp or for another arch); every binary's
#      libraries resolve (pcre2 and libjpeg-turbo from gpu-bundle/lib, nothing "not found"); each test suite lists
#      its cases, kvlite --help and bench-* --help run; ctest sees the suites; the GPU suites run (they skip here)
#   3. the fallback, building on the device: tools/gpu-check.sh's build step from the carried .deps/
#      (tools/fetch-gpu-deps.sh is run first, outside the namespace, when .deps/ is missing), for sm_90, of
#      KVLITE_SIMULATE_TARGETS (default: test-cuda-ops, kvlite; 120 s here from nothing), into a fresh build-gpu/
#   4. tools/device-call-1.sh --dry-run: the call's steps in order, without the GPU (suites allowed to skip,
#      sanitizers not started), each bounded as on the device
#
#     sudo tools/simulate-device.sh [--skip-build] [--skip-call]      log: build-simulate/simulate.log
#
# Nothing outside the namespace changes except build-simulate/ (logs, call-1/) and build-gpu/ (the fallback's build
# tree, made afresh); what the runs write into gpu-bundle/ and .deps/root is removed at the end.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "${KVLITE_SIMULATE_INNER:-0}" != 1 ]; then
  [ "$(id -u)" = 0 ] || { echo "simulate-device: needs root (unshare -m and bind mounts)" >&2; exit 2; }
  if [ ! -d "$root/.deps" ] || ! ls "$root"/.deps/*.deb >/dev/null 2>&1; then
    echo "simulate-device: no .deps/: running tools/fetch-gpu-deps.sh first (network needed)"
    "$root/tools/fetch-gpu-deps.sh" || { echo "simulate-device: FAIL: tools/fetch-gpu-deps.sh" >&2; exit 1; }
  fi
  mkdir -p "$root/build-simulate"
  bundle_before=$(cd "$root" && find gpu-bundle -mindepth 1 2>/dev/null | sort)
  KVLITE_SIMULATE_INNER=1 unshare -m --propagation private "$0" "$@" 2>&1 | tee "$root/build-simulate/simulate.log"
  status=${PIPESTATUS[0]}
  # What the runs wrote into gpu-bundle/ (the tests' KVLITE_BINARY_DIR: test-tmp/, ctest's Testing/) and the
  # packages gpu-check.sh unpacked (.deps/root) would otherwise travel with the next device call (43 + 13 MB).
  (cd "$root" && comm -13 <(echo "$bundle_before") <(find gpu-bundle -mindepth 1 2>/dev/null | sort) | sort -r |
     while read -r path; do rm -rf "$path"; done)
  rm -rf "$root/.deps/root"
  exit "$status"
fi

# ---- inside the namespace ------------------------------------------------------------------------------------
skip_build=0 skip_call=0
for argument in "$@"; do
  case $argument in
    --skip-build) skip_build=1 ;;
    --skip-call) skip_call=1 ;;
    *) echo "simulate-device: unknown option $argument" >&2; exit 2 ;;
  esac
done
sim=/tmp/kvlite-simulate
mkdir -p "$sim"
mount -t tmpfs kvlite-simulate "$sim"
# /usr becomes an overlay whose upper layer is this tmpfs: removing a path there hides it in this namespace alone
# (a whiteout), every other path keeps its real name (a compiler finds its own prefix, and `..` works, as there).
mkdir -p "$sim/upper" "$sim/work"
mount -t overlay kvlite-usr -o lowerdir=/usr,upperdir="$sim/upper",workdir="$sim/work" /usr

# What the device machine lacks. Runtime libraries the system itself uses (libpcre2-8.so.0: grep, mount) stay;
# step 2 checks instead that the bundle brings its own.
lib=/usr/lib/x86_64-linux-gnu
hidden=(
  /usr/include/nlohmann /usr/include/doctest /usr/include/stb /usr/include/pcre2.h /usr/include/pcre2posix.h
  /usr/include/turbojpeg.h /usr/include/jpeglib.h /usr/include/jerror.h /usr/include/jmorecfg.h
  /usr/include/jpegint.h /usr/include/x86_64-linux-gnu/jconfig.h
  $lib/libpcre2-*.so $lib/libpcre2-*.a $lib/libturbojpeg.so* $lib/libturbojpeg.a $lib/libjpeg.so $lib/libjpeg.a
  $lib/pkgconfig/libpcre2-*.pc $lib/pkgconfig/libturbojpeg.pc $lib/pkgconfig/libjpeg.pc $lib/pkgconfig/stb.pc
  $lib/cmake/libjpeg-turbo /usr/lib/cmake/doctest /usr/share/cmake/nlohmann_json /usr/share/pkgconfig/nlohmann_json.pc
  /usr/bin/pkg-config /usr/bin/pkgconf /usr/bin/x86_64-linux-gnu-pkg-config /usr/bin/x86_64-linux-gnu-pkgconf
  /usr/include/httplib.h $lib/libcpp-httplib.so* $lib/pkgconfig/cpp-httplib.pc $lib/libbrotli*.so* $lib/libbrotli*.a
)
hidden_count=0
for path in "${hidden[@]}"; do
  if [ -e "$path" ] || [ -L "$path" ]; then rm -rf "$path" && hidden_count=$((hidden_count + 1)); fi
done
# /tmp/kvlite-bundle (the bundle's compiled-in paths) is made afresh in here, as on a bare device machine.
mkdir -p /tmp/kvlite-bundle
mount -t tmpfs kvlite-bundle /tmp/kvlite-bundle

failures=0
result() {  # result NAME STATUS [detail]
  if [ "$2" = 0 ]; then echo "PASS  $1${3:+: $3}"; else echo "FAIL  $1${3:+: $3}"; failures=$((failures + 1)); fi
}
step() { echo; echo "==== $* ($(date -u +%H:%M:%S))"; }

step "1. the device machine's view: the -dev files hidden"
still_there=""
for path in /usr/include/doctest/doctest.h /usr/include/nlohmann/json.hpp /usr/include/stb/stb_image.h \
            /usr/include/pcre2.h /usr/include/turbojpeg.h $lib/libpcre2-8.so $lib/libturbojpeg.so \
            $lib/libpcre2-8.a /usr/lib/cmake/doctest/doctestConfig.cmake \
            /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake $lib/pkgconfig/libpcre2-8.pc; do
  [ -e "$path" ] && still_there+=" $path"
done
command -v pkg-config >/dev/null && still_there+=" pkg-config"
result "hidden: $hidden_count paths (headers, link libraries, archives, pkg-config and CMake files, pkg-config)" \
  "$([ -z "$still_there" ] && echo 0 || echo 1)" "${still_there:+still visible:$still_there}"
printf '#include <doctest/doctest.h>\n' | c++ -x c++ -fsyntax-only - >/dev/null 2>&1
result "a program that includes <doctest/doctest.h> does not compile (as on the device)" "$([ $? != 0 ] && echo 0 || echo 1)"

cd "$root"
step "2. prebuilt binaries (gpu-bundle/)"
if [ ! -f gpu-bundle/MANIFEST ]; then
  result "gpu-bundle/" 1 "missing: run tools/build-gpu-bundle.sh (outside this namespace) first"
else
  cat gpu-bundle/MANIFEST
  extra=$(tools/use-gpu-bundle.sh 90)
  result "tools/use-gpu-bundle.sh 90 accepts it (sources and arch match, libraries resolve)" $?
  [ -n "$extra" ] && export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  build=/tmp/kvlite-bundle/build
  # A bundle from other sources, or for another arch, is refused (the call then builds on the device).
  sed 's/^stamp .*/stamp 0000000000000000/' gpu-bundle/MANIFEST > "$sim/MANIFEST.stale"
  mount --bind "$sim/MANIFEST.stale" "$root/gpu-bundle/MANIFEST"
  tools/use-gpu-bundle.sh 90 > /dev/null 2> "$sim/refused.txt"
  status=$?
  umount "$root/gpu-bundle/MANIFEST"
  result "a bundle built from other sources is refused" "$([ $status = 1 ] && echo 0 || echo 1)" "$(cat "$sim/refused.txt")"
  tools/use-gpu-bundle.sh 89 > /dev/null 2> "$sim/refused.txt"
  result "a bundle for another arch is refused" "$([ $? = 1 ] && echo 0 || echo 1)" "$(cat "$sim/refused.txt")"
  tools/use-gpu-bundle.sh 90 > /dev/null 2>&1  # the links back on the accepted bundle
  suites=$(find "$build/tests/" -maxdepth 1 -type f -name 'test-*' ! -name '*.cmake' | sort)
  for binary in "$build"/lib/libkvlite.so "$build"/kvlite "$build"/caption_image "$build"/bench-* $suites; do
    name=${binary#$build/}
    libraries=$(ldd "$binary" 2>&1)
    bad=$(echo "$libraries" | grep -E 'not found|not a dynamic|libpcre2|libturbojpeg|libcpp-httplib|libbrotli' | grep -v "=> $root/gpu-bundle/lib/\|=> $build/" | grep -v '=> /tmp/kvlite-bundle/build/')
    # Anything a device machine would not have: every library is glibc's, libstdc++/libgcc, CUDA's, or carried.
    foreign=$(echo "$libraries" | awk '$2 == "=>" { print $1 }' |
      grep -vE '^(linux-vdso|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcudart|libcublas|libcublasLt|libkvlite|libpcre2-8|libturbojpeg|libcpp-httplib|libbrotli(common|dec|enc)|libssl|libcrypto|libz)\.so')
    result "$name: libraries resolve, pcre2 and libjpeg-turbo from gpu-bundle/lib" \
      "$([ -z "$bad$foreign" ] && echo 0 || echo 1)" "$bad$foreign"
  done
  for suite in $suites; do
    listing=$(timeout 60 "$suite" --list-test-cases 2>&1)
    status=$?
    cases=$(echo "$listing" | sed -n 's/.*passing the current filters: \([0-9]*\).*/\1/p')
    result "${suite#$build/} --list-test-cases" "$([ $status = 0 ] && [ "${cases:-0}" -gt 0 ] && echo 0 || echo 1)" \
      "${cases:-no} cases$([ $status != 0 ] && echo ", exit $status: $(echo "$listing" | tail -1)")"
  done
  for program in "$build"/kvlite "$build"/caption_image "$build"/bench-*; do
    timeout 60 "$program" --help > "$sim/help.txt" 2>&1
    status=$?
    # --help prints the usage (exit 0 or the usage error's code); a loader failure is 127, a crash >= 128.
    result "${program#$build/} --help starts" "$([ $status -lt 127 ] && [ -s "$sim/help.txt" ] && echo 0 || echo 1)" \
      "exit $status, $(head -1 "$sim/help.txt" | cut -c1-80)"
  done
  tests_listed=$(cd "$build" && ctest -N 2>&1 | awk '/Total Tests:/ { print $3 }')
  result "ctest in the bundle sees the suites" "$([ "${tests_listed:-0}" -gt 0 ] && echo 0 || echo 1)" "${tests_listed:-0} tests"
  for suite in $(echo "$suites" | grep '/test-cuda-'); do
    started=$(date +%s)
    timeout 300 "$suite" > "$sim/suite.txt" 2>&1
    status=$?
    result "${suite#$build/} runs to the end (GPU cases skip here)" "$status" \
      "$(grep -E '^\[doctest\] test cases' "$sim/suite.txt" | tr -s ' '), $(( $(date +%s) - started )) s"
  done
fi

if [ $skip_build = 0 ]; then
  step "3. the fallback: tools/gpu-check.sh's build step from .deps/ (sm_90: ${KVLITE_SIMULATE_TARGETS:-test-cuda-ops kvlite})"
  rm -rf build-gpu .deps/root build-simulate/fallback  # a build from nothing, as on a bare machine
  started=$(date +%s)
  KVLITE_GPU_CHECK_ARCH=90 KVLITE_GPU_CHECK_BUILD_ONLY=1 KVLITE_GPU_CHECK_BUNDLE=0 KVLITE_NO_APT=1 \
    KVLITE_GPU_CHECK_TARGETS="${KVLITE_SIMULATE_TARGETS:-test-cuda-ops kvlite}" \
    tools/gpu-check.sh build-simulate/fallback > /dev/null 2>&1
  status=$?
  result "gpu-check.sh build from .deps/ without the -dev files" $status "$(( $(date +%s) - started )) s; log build-simulate/fallback/build.log"
  [ $status != 0 ] && tail -30 build-simulate/fallback/build.log
  if [ $status = 0 ]; then
    grep -E 'Found nlohmann|Found libpcre2|Found libturbojpeg|Found PkgConfig' build-simulate/fallback/build.log
    if [ -x build-gpu/tests/test-cuda-ops ]; then
      timeout 120 build-gpu/tests/test-cuda-ops --no-intro > "$sim/suite.txt" 2>&1
      result "build-gpu/tests/test-cuda-ops runs (GPU cases skip here)" $? "$(grep -E '^\[doctest\] test cases' "$sim/suite.txt" | tr -s ' ')"
    fi
  fi
fi

if [ $skip_call = 0 ]; then
  step "4. tools/device-call-1.sh --dry-run (the call's steps, no GPU, no sanitizers)"
  started=$(date +%s)
  OUT="$root/build-simulate/call-1" tools/device-call-1.sh --dry-run > "$sim/call.txt" 2>&1
  status=$?
  tail -25 "$sim/call.txt"
  result "device-call-1.sh --dry-run" $status "$(( $(date +%s) - started )) s; results in build-simulate/call-1/"
fi

echo
if [ $failures = 0 ]; then echo "simulate-device: ALL PASSED"; else echo "simulate-device: $failures FAILED"; fi
[ $failures = 0 ]
