#!/usr/bin/env bash
# README.md's examples print what README.md shows. In each ``` block, a line "$ build/kvlite plan|tokenize|score
# ..." is run from the repository root (with BUILD_DIR's kvlite), and the lines that follow it up to the next
# "$ " line or the end of the block must appear in its output in that order (a "..." line stands for lines
# left out). generate and bench are not checked: they print timings. Plan examples name --wsl2 or --no-wsl2,
# so that the check does not depend on the machine it runs on.
#   tests/readme_examples.sh SOURCE_DIR BUILD_DIR
set -uo pipefail
root=$1
build=$2
cd "$root" || exit 2

failures=0
examples=0

check() {  # check COMMAND EXPECTED_LINES...
  local command=$1
  shift
  examples=$((examples + 1))
  if [[ "$command" == "build/kvlite plan "* && ! "$command" =~ \ --(no-)?wsl2(\ |$) ]]; then
    echo "README.md: \$ $command"
    echo "  names neither --wsl2 nor --no-wsl2: its output would depend on the machine"
    failures=$((failures + 1))
    return
  fi
  local output
  output=$(eval "$build/kvlite ${command#build/kvlite }" 2>&1)
  local -a got
  mapfile -t got <<< "$output"
  local at=0 expected line found
  for expected in "$@"; do
    [[ "$expected" == ...* ]] && continue
    found=0
    while [ "$at" -lt "${#got[@]}" ]; do
      line=${got[$at]}
      at=$((at + 1))
      if [ "${line%"${line##*[![:space:]]}"}" = "${expected%"${expected##*[![:space:]]}"}" ]; then
        found=1
        break
      fi
    done
    if [ "$found" -eq 0 ]; then
      echo "README.md: \$ $command"
      echo "  shows:    $expected"
      echo "  not printed (in this order); kvlite printed:"
      printf '    %s\n' "${got[@]}"
      failures=$((failures + 1))
      return
    fi
  done
}

in_block=0
command=""
expected=()
flush() {
  [ -n "$command" ] && check "$command" "${expected[@]}"
  command=""
  expected=()
}
while IFS= read -r line; do
  if [[ "$line" == '```'* ]]; then
    flush
    in_block=$((1 - in_block))
    continue
  fi
  [ "$in_block" -eq 1 ] || continue
  if [[ "$line" == '$ '* ]]; then
    flush
    if [[ "$line" =~ ^\$\ build/kvlite\ (plan|tokenize|score)\  ]]; then command=${line#\$ }; fi
    continue
  fi
  [ -n "$command" ] && expected+=("$line")
done < README.md
flush

echo "$examples README examples run, $failures differ from what README.md shows"
[ "$examples" -gt 0 ] && [ "$failures" -eq 0 ]
