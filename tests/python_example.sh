#!/usr/bin/env bash
# examples/caption_image.py, run as a user would (Python's standard library and libkvlite.so, nothing else),
# captions every image of examples/images/ with the bundled BF16 captioner as captions.txt says it must.
#   tests/python_example.sh PYTHON LIBKVLITE_SO      (from the repository root)
set -uo pipefail
python=$1
library=$2
# The interpreter configure found, or (a build carried to another machine, the GPU bundle) the one on PATH.
[ -x "$python" ] || python=$(command -v python3 || echo "$python")
failures=0
count=0
while IFS=$'\t' read -r image expected; do
  [ -n "$image" ] || continue
  count=$((count + 1))
  caption=$("$python" examples/caption_image.py --library "$library" --backend cpu models/kvlite-captioner-bf16 \
            "examples/images/$image")
  status=$?
  if [ "$status" -ne 0 ] || [ "$caption" != "$expected" ]; then
    echo "$image: exit $status, caption '$caption', expected '$expected'"
    failures=$((failures + 1))
  else
    echo "$image: ok  $caption"
  fi
done < examples/images/captions.txt
echo "$count images captioned through ctypes, $failures wrong"
[ "$count" -gt 0 ] && [ "$failures" -eq 0 ]
