#!/usr/bin/env python3
"""Evaluate the bundled captioner with kvlite, next to transformers, for each format (BF16, FP8, W4A16).

    /opt/kvdev/bin/python tools/eval_captioner.py --seed 7 --n 200

Draws N new scenes from the seed (tools/captioner/scenes.py; the training script's streams use other seeds),
writes them as PNG files and, for each model directory,

  * captions every image with kvlite (build/caption_image: the chat template with the image and "Describe this
    image.", greedy) and with transformers (generate, greedy, on the same model in float32), and counts exact
    matches with the scene's caption;
  * scores the scenes' captions, one per line, with `kvlite score` (sliding windows of --context-length tokens
    every --stride) and computes the same perplexity with transformers: the same tokens, the same windows
    (kvlite's score_windows, transformers' "Perplexity of fixed-length models" recipe), every token after the
    first scored once.

The transformers reference of a quantized directory is the model with each quantized Linear replaced by the
reference libraries' dequantization: transformers' Fp8Dequantize for Qwen's FP8 (float32 products),
compressed-tensors' decompress for pack-quantized int4 (products in the scale's dtype), widened to float32.

Prints a markdown table (format, exact match kvlite, exact match transformers, share of scenes where kvlite's
caption is transformers', perplexity kvlite, perplexity transformers, difference). Exit status 0 when every format ran, 1 when kvlite refused one (its message is in
the table).
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from captioner import common, scenes  # noqa: E402

FORMATS = {"bf16": "kvlite-captioner-bf16", "fp8": "kvlite-captioner-fp8", "w4a16": "kvlite-captioner-w4a16"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=7, help="scene stream of the evaluation")
    p.add_argument("--n", type=int, default=200, help="scenes to caption")
    p.add_argument("--formats", default="bf16,fp8,w4a16")
    p.add_argument("--models", type=Path, default=common.REPO_ROOT / "models")
    p.add_argument("--build", type=Path, default=common.REPO_ROOT / "build", help="where kvlite was built")
    p.add_argument("--context-length", type=int, default=128, help="perplexity window, tokens")
    p.add_argument("--stride", type=int, default=64, help="tokens between perplexity windows")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the transformers side")
    p.add_argument("--show-wrong", type=int, default=3, help="wrong captions to print per format and engine")
    p.add_argument("--kv-dtype", default="auto", help="kvlite's KV cache dtype: auto (f32 on the CPU) or fp8, ...")
    return p.parse_args()


# ---------------------------------------------------------------------------------------------------------
# kvlite
# ---------------------------------------------------------------------------------------------------------

def kvlite_captions(build, model_dir, image_paths, kv_dtype="auto"):
    """kvlite's caption of each image, or raises RuntimeError with kvlite's message."""
    captions = []
    for path in image_paths:
        run = subprocess.run([str(build / "caption_image"), str(model_dir), str(path), "--backend", "cpu",
                              "--kv-dtype", kv_dtype], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(run.stderr.strip() or f"caption_image exited {run.returncode}")
        captions.append(run.stdout.strip())
    return captions


def kvlite_perplexity(build, model_dir, text_file, context, stride, kv_dtype="auto"):
    run = subprocess.run([str(build / "kvlite"), "score", str(model_dir), "--text-file", str(text_file),
                          "--context-length", str(context), "--stride", str(stride), "--backend", "cpu",
                          "--kv-dtype", kv_dtype], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip() or f"kvlite score exited {run.returncode}")
    match = re.search(r"^perplexity: ([0-9.eE+-]+)$", run.stdout, re.M)
    tokens = re.search(r"^tokens: (\d+) scored", run.stdout, re.M)
    return float(match.group(1)), int(tokens.group(1))


# ---------------------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------------------

def dense_state(model_dir, config):
    """Every tensor of the checkpoint, quantized Linears dequantized by their reference library, in float32."""
    from safetensors.torch import load_file
    import make_quant_fixtures as quant
    stored = load_file(str(model_dir / "model.safetensors"))
    quantization = config.get("quantization_config")
    dense = {}
    if quantization is None:
        return {key: value.float() for key, value in stored.items()}
    if quantization["quant_method"] == "fp8":
        for key, value in stored.items():
            if key.endswith(".weight_scale_inv"):
                continue
            scale = stored.get(key + "_scale_inv")
            dense[key] = quant.fp8_block_dequantized(value, scale) if scale is not None else value.float()
        return dense
    if quantization["quant_method"] == "compressed-tensors":
        from compressed_tensors.quantization import QuantizationScheme
        groups = quantization["config_groups"]
        assert len(groups) == 1, "one config group expected"
        group = dict(next(iter(groups.values())))
        group.setdefault("format", quantization["format"])
        scheme = QuantizationScheme.model_validate(group)
        prefixes = [key[:-len(".weight_packed")] for key in stored if key.endswith(".weight_packed")]
        owned = set()
        for prefix in prefixes:
            state = {key[len(prefix) + 1:]: value for key, value in stored.items() if key.startswith(prefix + ".")}
            owned.update(f"{prefix}.{key}" for key in state)
            dense[prefix + ".weight"] = quant.ct_decompress(state, scheme).float()
        for key, value in stored.items():
            if key not in owned:
                dense[key] = value.float()
        return dense
    raise ValueError(f"{model_dir}: unexpected quant_method {quantization['quant_method']}")


def reference_model(model_dir):
    """Qwen3VLForConditionalGeneration in float32 (eager attention) with the directory's weights dequantized."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    hf_config._attn_implementation = "eager"
    model = Qwen3VLForConditionalGeneration(hf_config).float()
    missing, unexpected = model.load_state_dict(dense_state(model_dir, config), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    from transformers import GenerationConfig
    model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
    return model.eval()


@torch.no_grad()
def transformers_perplexity(model, ids, context, stride):
    """kvlite score's windows (src/sampler.inl score_windows) on transformers' logits."""
    nll, count, previous_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        first_target = max(previous_end, begin + 1)
        window = torch.tensor([ids[begin:end]])
        logits = model(input_ids=window).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        for target in range(first_target, end):
            nll -= float(logprobs[target - 1 - begin, ids[target]])
            count += 1
        previous_end = end
        if end == len(ids):
            break
    return math.exp(nll / count), count


# ---------------------------------------------------------------------------------------------------------

def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for kind in formats:
        if kind not in FORMATS:
            sys.exit(f"eval_captioner: unknown format {kind!r} (known: {', '.join(FORMATS)})")
    for tool in ("caption_image", "kvlite"):
        if not (args.build / tool).exists():
            sys.exit(f"eval_captioner: {args.build / tool} is missing: build kvlite first (tools/README.md)")

    held_out = scenes.scenes(args.seed, args.n)
    expected = [s.caption for s in held_out]
    rows = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="kvlite-captioner-eval-") as tmp:
        tmp = Path(tmp)
        images = [scenes.render(s) for s in held_out]
        paths = []
        for i, image in enumerate(images):
            paths.append(tmp / f"scene_{i:04d}.png")
            image.save(paths[-1])
        text_file = tmp / "captions.txt"
        text_file.write_text("\n".join(expected) + "\n", encoding="utf-8")

        for kind in formats:
            model_dir = args.models / FORMATS[kind]
            row = {"format": kind}
            started = time.time()
            # transformers
            processor = common.load_processor(model_dir)
            model = reference_model(model_dir)
            hf_captions = common.caption_images(model, processor, images)
            row["hf_exact"] = sum(c == e for c, e in zip(hf_captions, expected)) / args.n
            ids = processor.tokenizer.encode(text_file.read_text(encoding="utf-8"), add_special_tokens=True)
            row["hf_ppl"], row["hf_tokens"] = transformers_perplexity(model, ids, args.context_length, args.stride)
            # kvlite
            try:
                kv_captions = kvlite_captions(args.build, model_dir, paths, args.kv_dtype)
                row["kv_exact"] = sum(c == e for c, e in zip(kv_captions, expected)) / args.n
                row["agree"] = sum(a == b for a, b in zip(kv_captions, hf_captions)) / args.n
                row["kv_ppl"], row["kv_tokens"] = kvlite_perplexity(args.build, model_dir, text_file,
                                                                    args.context_length, args.stride, args.kv_dtype)
                assert row["kv_tokens"] == row["hf_tokens"], (row["kv_tokens"], row["hf_tokens"])
            except RuntimeError as error:
                row["error"] = str(error).splitlines()[-1]
                kv_captions = None
                failed = True
            print(f"{kind}: {time.time() - started:.0f} s", file=sys.stderr)
            for engine, captions in (("kvlite", kv_captions), ("transformers", hf_captions)):
                wrong = [(e, c) for e, c in zip(expected, captions or []) if c != e]
                for e, c in wrong[:args.show_wrong]:
                    print(f"  {kind} {engine}: expected {e!r}, got {c!r}", file=sys.stderr)
            rows.append(row)

    print(f"\nscenes: seed {args.seed}, n {args.n}; perplexity: the {args.n} captions one per line, "
          f"{rows[0]['hf_tokens']} tokens scored, windows of {args.context_length} every {args.stride}\n")
    print("| format | exact match (kvlite) | exact match (transformers) | kvlite's caption = transformers' "
          "| perplexity (kvlite) | perplexity (transformers) | difference |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['format']} | kvlite refused: {row['error']} | {100 * row['hf_exact']:.1f}% | - | - "
                  f"| {row['hf_ppl']:.6f} | - |")
        else:
            print(f"| {row['format']} | {100 * row['kv_exact']:.1f}% | {100 * row['hf_exact']:.1f}% "
                  f"| {100 * row['agree']:.1f}% | {row['kv_ppl']:.6f} | {row['hf_ppl']:.6f} | {row['kv_ppl'] - row['hf_ppl']:+.1e} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
