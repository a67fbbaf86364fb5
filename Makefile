# kvlite's front door. Two commands on a fresh Debian machine:
#   make demo   builds kvlite and runs the main job on the bundled models
#   make test   builds everything and runs every suite through ctest
# Everything builds into build/ (the CLI at build/kvlite, each example at build/<name>).
BUILD ?= build
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

SANITIZE_BUILD ?= build-sanitize
FUZZ_SECONDS ?= 600

.PHONY: all build configure deps amalgamate check-amalgamation test sanitize-test fuzz demo gpu-check clean

all: deps amalgamate build

deps:
	@tools/install-deps.sh

amalgamate:
	@tools/amalgamate.sh

check-amalgamation:
	@tools/amalgamate.sh --check

configure: deps
	@cmake -S . -B $(BUILD) $(CMAKE_FLAGS) > $(BUILD).configure.log 2>&1 || (cat $(BUILD).configure.log; exit 1)
	@grep -E 'kvlite:' $(BUILD).configure.log || true
	@rm -f $(BUILD).configure.log

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

# The test command: the header must match its parts, everything must build, every suite runs under ctest,
# twice: the g++ build (CUDA included when nvcc is present), then the clang++ build with ASan + UBSan, whose
# ctest also replays every fuzz corpus and crash input and fuzzes each parser for 30 s (tests/fuzz).
test: deps check-amalgamation build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@$(MAKE) --no-print-directory sanitize-test

sanitize-test: deps
	@JOBS=$(JOBS) tools/sanitize-build.sh $(SANITIZE_BUILD)
	@cd $(SANITIZE_BUILD) && ctest --output-on-failure -j $(JOBS)

# Every libFuzzer harness for FUZZ_SECONDS each (default 600), with a table of executions and coverage.
fuzz: deps
	@tools/fuzz.sh $(FUZZ_SECONDS)

demo: all
	@tools/demo.sh $(BUILD)

# On a machine with an NVIDIA GPU: build for its arch, run every GPU test and the benchmarks.
gpu-check:
	@tools/gpu-check.sh

clean:
	rm -rf $(BUILD) $(SANITIZE_BUILD)
