#!/usr/bin/env bash
# make demo: the main job on the bundled models. For now: the plan for each shipped config on an 8 GiB card.
set -euo pipefail
build=${1:-build}
echo "kvlite $(./$build/kvlite --version 2>/dev/null || true)"
