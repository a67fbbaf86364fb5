# kvlite's front door. Two commands on a fresh Debian machine:
#   make demo   builds kvlite and runs the main job on the bundled models
#   make test   builds everything and runs every suite through ctest
# Everything builds into build/ (the CLI at build/kvlite, each example at build/<name>).
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

# make demo, on a fresh build directory, builds only what the demo runs (the CLI and caption_image), with CUDA
# for this machine's GPUs (KVLITE_CUDA_ARCHITECTURES=native) where nvidia-smi sees one and nvcc is installed,
# else CPU-only: a few minutes on 2 cores instead of kernels.cu for every architecture. make test configures
# the defaults again (-U: CUDA when nvcc is found, every supported architecture) and builds everything.
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && command -v nvcc >/dev/null 2>&1 && echo 1)
DEMO_CMAKE_FLAGS := $(if $(HAVE_GPU),-DKVLITE_CUDA=AUTO -DKVLITE_CUDA_ARCHITECTURES=native,-DKVLITE_CUDA=OFF)
TEST_CMAKE_FLAGS := -UKVLITE_CUDA -UKVLITE_CUDA_ARCHITECTURES

SANITIZE_BUILD ?= build-sanitize
FUZZ_SECONDS ?= 600
FUZZ_JOBS ?= 1

.PHONY: all build configure deps amalgamate check-amalgamation test sanitize-test fuzz demo gpu-check clean lib

# make lib: libkvlite.so alone (the C API for C, Python, C#, Go, Rust) in build-lib/, CPU-only unless asked
# (make lib LIB_CMAKE_FLAGS=-DKVLITE_CUDA=ON): no tests, no examples, no kernels for seven architectures.
LIB_BUILD ?= build-lib
LIB_CMAKE_FLAGS ?= -DKVLITE_CUDA=OFF

all: deps amalgamate build

deps:
	@tools/install-deps.sh
	@tools/install-test-client.sh

amalgamate:
	@tools/amalgamate.sh

check-amalgamation:
	@tools/amalgamate.sh --check

# CONFIGURE_FLAGS: what a target adds (make test: the defaults again); CMAKE_FLAGS, the caller's, come last and win.
# A new build directory gets Ninja (tools/install-deps.sh installs it): unlike Makefiles, it compiles the test
# suites while kernels.cu compiles, instead of after the whole library (a third of CI's build time). A directory
# configured already keeps its generator.
configure: deps
	@cmake -S . -B $(BUILD) $$(tools/cmake-generator.sh $(BUILD)) $(CONFIGURE_FLAGS) $(CMAKE_FLAGS) > $(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@grep -E 'kvlite:' $(BUILD).configure.log || true
	@rm -f $(BUILD).configure.log

build: configure
	@MAKEFLAGS= MAKELEVEL= cmake --build $(BUILD) -j $(JOBS)

# The test command: the header must match its parts, everything must build, every suite runs under ctest,
# twice: the g++ build (CUDA included when nvcc is present), then the clang++ build with ASan + UBSan, whose
# ctest also replays every fuzz corpus and crash input and fuzzes each parser for 30 s (tests/fuzz).
test: CONFIGURE_FLAGS = $(TEST_CMAKE_FLAGS)
test: deps check-amalgamation build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@$(MAKE) --no-print-directory sanitize-test

sanitize-test: deps
	@JOBS=$(JOBS) tools/sanitize-build.sh $(SANITIZE_BUILD)
	@cd $(SANITIZE_BUILD) && ctest --output-on-failure -j $(JOBS)

# Every libFuzzer harness for FUZZ_SECONDS each (default 600), with a table of executions and coverage.
fuzz: deps
	@FUZZ_JOBS=$(FUZZ_JOBS) tools/fuzz.sh $(FUZZ_SECONDS)

# A build directory that exists already (make test's, or an earlier demo's) is used as it is configured.
demo: deps amalgamate
	@if [ ! -f $(BUILD)/CMakeCache.txt ]; then $(MAKE) --no-print-directory configure CONFIGURE_FLAGS="$(DEMO_CMAKE_FLAGS)"; fi
	@MAKEFLAGS= MAKELEVEL= cmake --build $(BUILD) -j $(JOBS) --target kvlite caption_image
	@tools/demo.sh $(BUILD)

# On a machine with an NVIDIA GPU: build for its arch, run every GPU test and the benchmarks.
gpu-check:
	@tools/gpu-check.sh

lib: deps amalgamate
	@cmake -S . -B $(LIB_BUILD) $$(tools/cmake-generator.sh $(LIB_BUILD)) -DKVLITE_BUILD_TESTS=OFF -DKVLITE_BUILD_EXAMPLES=OFF \
	  -DKVLITE_BUILD_SHARED=ON $(LIB_CMAKE_FLAGS) $(CMAKE_FLAGS) > $(LIB_BUILD).configure.log 2>&1 || (cat $(LIB_BUILD).configure.log; exit 1)
	@rm -f $(LIB_BUILD).configure.log
	@MAKEFLAGS= MAKELEVEL= cmake --build $(LIB_BUILD) -j $(JOBS) --target kvlite_shared
	@echo "$(LIB_BUILD)/libkvlite.so: cc -std=c11 -I. app.c -L$(LIB_BUILD) -lkvlite -Wl,-rpath,\"\$$PWD/$(LIB_BUILD)\""

clean:
	rm -rf $(BUILD) $(SANITIZE_BUILD) $(LIB_BUILD)
