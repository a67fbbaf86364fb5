#!/usr/bin/env bash
# Downloads kvlite's build dependencies as Debian packages into .deps/ (git-ignored), for a machine that has a
# GPU but no network: tools/gpu-check.sh unpacks them there (dpkg -x into .deps/root, never into /) when the
# machine lacks them. Run here once, then send .deps along with the working tree (the device tool's `carry`).
#   tools/fetch-gpu-deps.sh && ls .deps
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/.deps"
cd "$root/.deps"
rm -rf ./*.deb root  # root/: what gpu-check.sh unpacked from older packages
# Headers and the pkg-config / CMake files of the libraries kvlite builds against, pcre2's runtime library, and
# pkg-config itself (pkgconf), which CMake needs to find pcre2.
apt-get update -qq || echo "fetch-gpu-deps: apt-get update failed; trying the lists already here" >&2
apt-get download doctest-dev nlohmann-json3-dev libstb-dev libpcre2-dev libpcre2-8-0 libturbojpeg0-dev libturbojpeg0 \
  pkgconf pkgconf-bin libpkgconf3
ls -1 ./*.deb
