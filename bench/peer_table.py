#!/usr/bin/env python3
"""bench/peer-cpu.sh's parser and ratio table (standard library only).

    peer_table.py --kvlite OUT.txt              one `kvlite bench` output -> a runs.tsv row's figures
    peer_table.py --llama PP.json TG.json       two `llama-bench -o json` outputs -> the same
    peer_table.py --table DIR                   DIR/runs.tsv (+ meta.txt) -> the markdown table, medians

Figures: prefill tok/s (kvlite: 128 prompt tokens over its time to first token; llama.cpp: pp128's tok/s),
decode tok/s (kvlite: the tokens after the first over their time; llama.cpp: tg64 at depth 128), kvlite's % of
its memory roofline (its own `of_roofline`: the bytes a decode step reads over the copy bandwidth it measured),
the copy bandwidth and the weight bytes read per decode step (llama.cpp: llama-bench's model_size).
"""
import json
import re
import statistics
import sys
from pathlib import Path

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def read_kvlite_bench(path):
    """A `kvlite bench` output: its copy bandwidth (GB/s), weight bytes a decode step reads, and the table's rows
    (each line after the `batch prompt decode ...` header, split; tools/peer_gpu_table.py reads it too)."""
    text = Path(path).read_text()
    copy = float(re.search(r"^copy bandwidth: ([0-9.]+) GB/s", text, re.M).group(1))
    size = re.search(r"^weights read per decode step: ([0-9.]+) (B|KiB|MiB|GiB)", text, re.M)
    weights = float(size.group(1)) * UNITS[size.group(2)]
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["batch", "prompt", "decode"])
    rows = []
    for line in lines[header + 1:]:
        fields = line.split()
        if len(fields) < 8 or not fields[0].isdigit():
            break
        rows.append(fields)
    return copy, weights, rows


def parse_kvlite(path):
    copy, weights, rows = read_kvlite_bench(path)
    row = rows[0]
    prompt, ttft_ms, decode_tok_s, roofline = int(row[1]), float(row[3]), float(row[5]), float(row[7].rstrip("%"))
    return [prompt / (ttft_ms / 1e3), decode_tok_s, roofline, copy, weights]


def parse_llama(pp_path, tg_path):
    pp = [r for r in json.loads(Path(pp_path).read_text()) if r["n_prompt"] > 0 and r["n_gen"] == 0]
    tg = [r for r in json.loads(Path(tg_path).read_text()) if r["n_gen"] > 0 and r["n_prompt"] == 0]
    return [pp[0]["avg_ts"], tg[0]["avg_ts"], "", "", tg[0]["model_size"]]


def cell(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def table(directory):
    directory = Path(directory)
    rows = (directory / "runs.tsv").read_text().splitlines()
    keys = rows[0].split("\t")
    runs = [dict(zip(keys, line.split("\t"))) for line in rows[1:] if line.strip()]
    groups, order = {}, []
    for run in runs:
        key = (run["model"], run["format"], int(run["threads"]))
        if key not in groups:
            groups[key] = {}
            order.append(key)
        groups[key].setdefault(run["engine"], []).append(run)

    def median(group, engine, field):
        values = [float(r[field]) for r in group.get(engine, []) if r[field] != ""]
        return statistics.median(values) if values else None

    def spread(group, engine, field):
        values = [float(r[field]) for r in group.get(engine, []) if r[field] != ""]
        return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else ""

    pairing = {"bf16": "BF16 vs BF16", "w8": "W8A16 vs Q8_0", "w4": "W4A16 g128 vs Q4_0"}
    meta = (directory / "meta.txt").read_text() if (directory / "meta.txt").exists() else ""
    out = [line for line in meta.splitlines()]
    out.append("")
    out.append("| model | pairing | threads | kvlite kernels | rounds | prefill 128 tok/s kvlite / llama.cpp | prefill "
               "ratio | decode 64 tok/s kvlite / llama.cpp | decode ratio | kvlite % of roofline | llama.cpp % (same "
               "bandwidth) | weights GiB kvlite / llama.cpp |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in order:
        model, fmt, threads = key
        g = groups[key]
        ll_p, ll_d = median(g, "llama.cpp", "prefill_tok_s"), median(g, "llama.cpp", "decode_tok_s")
        copies = [float(r["copy_gb_s"]) for e in g for r in g[e] if r["copy_gb_s"] != ""]
        copy = statistics.median(copies) if copies else None
        ll_bytes = median(g, "llama.cpp", "weight_bytes")
        ll_roof = None if None in (ll_d, ll_bytes, copy) else 100.0 * ll_d * ll_bytes / (copy * 1e9)
        for engine in (e for e in g if e.startswith("kvlite-")):
            p, d = median(g, engine, "prefill_tok_s"), median(g, engine, "decode_tok_s")
            roof, kv_bytes = median(g, engine, "roofline_pct"), median(g, engine, "weight_bytes")
            out.append(
                f"| {model} | {pairing.get(fmt, fmt)} | {threads} | {engine[len('kvlite-'):]} | {len(g[engine])} "
                f"| {cell(p)} / {cell(ll_p)} | {cell(ratio(p, ll_p))}x | {cell(d)} / {cell(ll_d)} | {cell(ratio(d, ll_d))}x "
                f"| {cell(roof, 1)}% | {cell(ll_roof, 1)}% "
                f"| {cell(None if kv_bytes is None else kv_bytes / 2**30)} / {cell(None if ll_bytes is None else ll_bytes / 2**30)} |")
    out.append("")
    out.append("Spread (min-max over rounds), decode tok/s: " + "; ".join(
        f"{m} {f} t{t}: " + ", ".join(f"{e} {spread(groups[(m, f, t)], e, 'decode_tok_s')}" for e in groups[(m, f, t)])
        for (m, f, t) in order))
    copies = [float(r["copy_gb_s"]) for r in runs if r["copy_gb_s"] != ""]
    if copies:
        out.append(f"kvlite's measured copy bandwidth over all runs: {min(copies):.1f}-{max(copies):.1f} GB/s "
                   f"(median {statistics.median(copies):.1f})")
    return "\n".join(out)


def main(argv):
    if argv[:1] == ["--kvlite"] and len(argv) == 2:
        print("\t".join(str(v) for v in parse_kvlite(argv[1])))
    elif argv[:1] == ["--llama"] and len(argv) == 3:
        print("\t".join(str(v) for v in parse_llama(argv[1], argv[2])))
    elif argv[:1] == ["--table"] and len(argv) == 2:
        print(table(argv[1]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
