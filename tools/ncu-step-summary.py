#!/usr/bin/env python3
"""Splits one decode step into its kernels, from Nsight Compute's CSV of a short `kvlite bench` run.

    ncu --csv --print-units base --metrics gpu__time_duration.sum kvlite bench MODEL --batch 1 ... > step.csv
    tools/ncu-step-summary.py step.csv

Each kernel is timed alone (ncu serializes launches and graph nodes), so the sum is the step's GPU time without
launch gaps; the bench's own step time minus that sum is what the graph's node overhead and gaps cost. A decode
step is found as the shortest tail of the launch sequence that repeats (same kernel names, in order, twice)."""
import csv
import re
import sys
from collections import OrderedDict


def short_name(name):
    while re.search(r"<[^<>]*>", name):         # template arguments, innermost first (they may hold "(int)4")
        name = re.sub(r"<[^<>]*>", "", name)
    name = re.sub(r"\(.*$", "", name)          # arguments
    name = name.split(" ")[-1]                  # return type
    return name.split("::")[-1]


def read_kernels(path):
    rows = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages start with ==
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        us = value / 1000.0 if unit in ("ns", "nsecond") else value * 1e6 if unit in ("s", "second") else value
        rows.append((short_name(row["Kernel Name"]), row.get("Grid Size", ""), row.get("Block Size", ""), us))
    return rows


def find_step(rows):
    # The shortest tail that the launches before it repeat: a step ends with lm_head and sampling, which no run of
    # layer kernels repeats, so nothing shorter than a whole step matches (and two steps are the next match).
    names = [r[0] for r in rows]
    for period in range(10, len(names) // 2 + 1):
        if names[-period:] == names[-2 * period:-period]:
            return rows[-period:]
    return None


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = read_kernels(sys.argv[1])
    if not rows:
        sys.exit("no gpu__time_duration rows in %s" % sys.argv[1])
    step = find_step(rows)
    if step is None:
        sys.exit("%d kernels timed, but no repeating decode step found" % len(rows))
    total = sum(r[3] for r in step)
    groups = OrderedDict()
    for name, grid, block, us in step:
        g = groups.setdefault((name, grid), [0, 0.0, grid, block])  # one row per kernel and shape
        g[0] += 1
        g[1] += us
    print("%d kernels timed; one decode step = %d kernels, %.1f us of kernel time (no gaps)" %
          (len(rows), len(step), total))
    print("%-40s %6s %10s %9s %6s  %s" % ("kernel", "calls", "total us", "us/call", "share", "grid x block"))
    for (name, _), (count, us, grid, block) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print("%-40s %6d %10.1f %9.2f %5.1f%%  %s x %s" % (name[:40], count, us, us / count, 100 * us / total, grid, block))


if __name__ == "__main__":
    main()
