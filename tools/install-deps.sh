#!/usr/bin/env bash
# Installs kvlite's build dependencies from Debian packages, only those missing. Idempotent and quiet when
# everything is present. Uses sudo when not root.
#   cmake g++ make pkg-config   the build
#   ninja-build                 the generator make test and make demo configure with (tools/cmake-generator.sh)
#   doctest-dev                 tests
#   nlohmann-json3-dev          config.json, tokenizer.json, safetensors headers
#   libstb-dev                  image decoding (stb_image)
#   libpcre2-dev                the tokenizers' pre-tokenizer regexes (Unicode properties)
#   clang libclang-rt-dev       the sanitizer build and the libFuzzer harnesses (make test runs both)
#   libturbojpeg0-dev           JPEG decoding (libjpeg-turbo, the decoder PIL and torchvision use)
#   libcpp-httplib-dev          kvlite serve (the OpenAI-compatible server)
#   python3                     the ctypes example (examples/caption_image.py) that make test runs: the standard
#                               library only, no package from PyPI
#   g++-aarch64-linux-gnu qemu-user   the NEON kernels' suite (tests/neon_qemu.sh): cpu-fast and cpu-lowp built
#                               for AArch64 and run on emulated CPUs
#   libpcre2-dev:arm64 libturbojpeg0-dev:arm64   what that build links: Debian's arm64 packages, installed
#                               beside the native ones (arm64 is added as a foreign dpkg architecture). Failing
#                               to get these warns and leaves the NEON suite out; it never stops the rest.
#   python3-venv                the project-local .venv-test/ that tools/install-test-client.sh installs the
#                               official openai client into (tests/serve_openai_client.py)
set -euo pipefail
need=()
have_header() { [ -f "/usr/include/$1" ] || [ -f "/usr/local/include/$1" ]; }
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
command -v ninja >/dev/null || need+=(ninja-build)
command -v pkg-config >/dev/null || need+=(pkg-config)
have_header doctest/doctest.h || need+=(doctest-dev)
have_header nlohmann/json.hpp || need+=(nlohmann-json3-dev)
have_header stb/stb_image.h || need+=(libstb-dev)
have_header pcre2.h || need+=(libpcre2-dev)
have_header turbojpeg.h || need+=(libturbojpeg0-dev)
have_header httplib.h || need+=(libcpp-httplib-dev)
command -v python3 >/dev/null || need+=(python3)
python3 -c "import ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
command -v clang++ >/dev/null || need+=(clang)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || need+=(libclang-rt-dev)
cross=()
command -v aarch64-linux-gnu-g++ >/dev/null || cross+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || cross+=(qemu-user)
[ -f /usr/lib/aarch64-linux-gnu/libpcre2-8.a ] || cross+=(libpcre2-dev:arm64)
[ -f /usr/lib/aarch64-linux-gnu/libturbojpeg.a ] || cross+=(libturbojpeg0-dev:arm64)
[ ${#need[@]} -eq 0 ] && [ ${#cross[@]} -eq 0 ] && exit 0
sudo=""
if [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null; then
  # the cross packages are optional: without root they are only warned about
  [ ${#need[@]} -gt 0 ] && { echo "kvlite: need root or sudo to install: ${need[*]}" >&2; exit 1; }
  echo "kvlite: WARNING: no root or sudo to install ${cross[*]}; the NEON suite (tests/neon_qemu.sh) will not run" >&2
  exit 0
fi
[ "$(id -u)" != 0 ] && sudo=sudo
export DEBIAN_FRONTEND=noninteractive
if [ ${#need[@]} -gt 0 ]; then
  echo "kvlite: installing missing Debian packages: ${need[*]}"
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if [ ${#cross[@]} -gt 0 ]; then
  echo "kvlite: installing the AArch64 cross toolchain and emulator for the NEON suite: ${cross[*]}"
  if ! { { dpkg --print-foreign-architectures | grep -qx arm64 || $sudo dpkg --add-architecture arm64; } &&
         $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends "${cross[@]}" >/dev/null; }; then
    echo "kvlite: WARNING: could not install ${cross[*]}; the NEON suite (tests/neon_qemu.sh) will not run" >&2
  fi
fi
