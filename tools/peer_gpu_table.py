#!/usr/bin/env python3
"""tools/peer-gpu.sh's parser and ratio table (standard library only).

    peer_gpu_table.py --kvlite OUT.txt                 one `kvlite bench --batch 1,8` output -> a runs.tsv row's figures
    peer_gpu_table.py --llama PP.json TG.json B8.jsonl   llama-bench (pp, tg) and llama-batched-bench -> the same
    peer_gpu_table.py --table DIR                      DIR/runs.tsv (+ meta.txt) -> the markdown table, medians

Figures: prefill tok/s (kvlite: the prompt over batch 1's time to first token; llama.cpp: pp512), decode tok/s at
batch 1 (kvlite: the tokens after the first over their time; llama.cpp: tg128 at depth 512) and at batch 8 (all
sequences together; llama.cpp: llama-batched-bench's speed_tg at npl 8), kvlite's % of its roofline at batch 1
(its own of_roofline: the bytes a decode step reads over the copy bandwidth it measured), that copy bandwidth and
the weight bytes of a decode step (llama.cpp: llama-bench's model_size, which the same bandwidth turns into its %).
"""
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import peer_table  # noqa: E402  (bench/peer-cpu.sh's parser)
from peer_table import cell, ratio, read_kvlite_bench  # noqa: E402


def parse_kvlite(path):
    copy, weights, table_rows = read_kvlite_bench(path)
    rows = {int(fields[0]): fields for fields in table_rows}
    one, eight = rows[1], rows[8]
    prefill = int(one[1]) / (float(one[3]) / 1e3)
    return [prefill, float(one[5]), float(eight[5]), float(one[7].rstrip("%")), copy, weights]


def parse_llama(pp_path, tg_path, batched_path):
    prefill, decode, _, _, model_size = peer_table.parse_llama(pp_path, tg_path)
    batched = [json.loads(line) for line in Path(batched_path).read_text().splitlines() if line.startswith("{")]
    eight = [r for r in batched if r["pl"] == 8]
    return [prefill, decode, eight[0]["speed_tg"], "", "", model_size]


def table(directory):
    directory = Path(directory)
    rows = (directory / "runs.tsv").read_text().splitlines()
    keys = rows[0].split("\t")
    runs = [dict(zip(keys, line.split("\t"))) for line in rows[1:] if line.strip()]

    def median(model, fmt, field):
        values = [float(r[field]) for r in runs if r["model"] == model and r["format"] == fmt and r[field] != ""]
        return statistics.median(values) if values else None

    def spread(model, fmt, field):
        values = [float(r[field]) for r in runs if r["model"] == model and r["format"] == fmt and r[field] != ""]
        return f"{min(values):.1f}-{max(values):.1f}" if len(values) > 1 else (f"{values[0]:.1f}" if values else "-")

    meta = (directory / "meta.txt").read_text() if (directory / "meta.txt").exists() else ""
    out = meta.splitlines() + [""]
    out.append("| model | llama.cpp type | rounds | prefill 512 tok/s kvlite / llama.cpp | ratio | decode b1 tok/s "
               "kvlite / llama.cpp | ratio | decode b8 tok/s kvlite / llama.cpp | ratio | b1 % of roofline kvlite / "
               "llama.cpp | weights GiB kvlite / llama.cpp |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    models = list(dict.fromkeys(r["model"] for r in runs))
    for model in models:
        copies = [float(r["copy_gb_s"]) for r in runs if r["model"] == model and r["copy_gb_s"] != ""]
        copy = statistics.median(copies) if copies else None
        kp, k1, k8 = (median(model, "W4A16", f) for f in ("prefill_tok_s", "decode1_tok_s", "decode8_tok_s"))
        kroof, kbytes = median(model, "W4A16", "roofline1_pct"), median(model, "W4A16", "weight_bytes")
        for fmt in dict.fromkeys(r["format"] for r in runs if r["model"] == model and r["engine"] == "llama.cpp"):
            lp, l1, l8 = (median(model, fmt, f) for f in ("prefill_tok_s", "decode1_tok_s", "decode8_tok_s"))
            lbytes = median(model, fmt, "weight_bytes")
            lroof = None if None in (l1, lbytes, copy) else 100.0 * l1 * lbytes / (copy * 1e9)
            count = len([r for r in runs if r["model"] == model and r["format"] == fmt])
            out.append(
                f"| {model} | {fmt} | {count} | {cell(kp, 0)} / {cell(lp, 0)} | {cell(ratio(kp, lp), 2)}x "
                f"| {cell(k1, 1)} / {cell(l1, 1)} | {cell(ratio(k1, l1), 2)}x | {cell(k8, 1)} / {cell(l8, 1)} | {cell(ratio(k8, l8), 2)}x "
                f"| {cell(kroof, 1)}% / {cell(lroof, 1)}% "
                f"| {cell(None if kbytes is None else kbytes / 2**30, 2)} / {cell(None if lbytes is None else lbytes / 2**30, 2)} |")
    out.append("")
    out.append("Spread (min-max over rounds), decode b1 / b8 tok/s: " + "; ".join(
        f"{m} {f}: {spread(m, f, 'decode1_tok_s')} / {spread(m, f, 'decode8_tok_s')}"
        for m in models for f in dict.fromkeys(r["format"] for r in runs if r["model"] == m)))
    copies = [float(r["copy_gb_s"]) for r in runs if r["copy_gb_s"] != ""]
    if copies:
        out.append(f"kvlite's measured copy bandwidth: {min(copies):.0f}-{max(copies):.0f} GB/s; the llama.cpp % of "
                   "roofline is its decode tok/s x model_size over that bandwidth (KV not counted)")
    return "\n".join(out)


def print_row(values):
    print("\t".join(str(v) for v in values))


# flag: (arguments, action)
COMMANDS = {"--kvlite": (1, lambda args: print_row(parse_kvlite(*args))),
            "--llama": (3, lambda args: print_row(parse_llama(*args))),
            "--table": (1, lambda args: print(table(*args)))}


def main(argv):
    arity, action = COMMANDS.get(argv[0] if argv else "", (None, None))
    if arity is None or len(argv) - 1 != arity:
        sys.exit(__doc__)
    action(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
