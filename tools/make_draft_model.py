#!/usr/bin/env python3
"""Make a draft model for speculative decoding from a model's own first layers (early exit, no training).

A draft model proposes tokens that the target verifies (kvlite --draft DIR --spec-tokens K): it must share the
target's tokenizer and should agree with it often while costing a fraction of a forward pass. The cheapest such
model is the target cut short: its embedding table, its first N decoder layers, its final norm and its lm_head
(LayerSkip's self-speculation, without the early-exit training). This writes that as a plain text checkpoint:

    tools/make_draft_model.py models/kvlite-captioner-bf16 models/kvlite-captioner-draft --layers 1

    config.json              model_type qwen3 (from a Qwen3-VL's text_config: for text tokens, whose three M-RoPE
                             rows are equal, interleaved M-RoPE is plain RoPE) or the target's own text type
    model.safetensors        model.embed_tokens, model.layers.0 .. N-1, model.norm (and lm_head when untied), as
                             stored in the target (same dtype, bytes copied)
    tokenizer.json, tokenizer_config.json, generation_config.json: the target's, copied

A vision-language target's draft is text-only: it reads image tokens as their <|image_pad|> ids, without the
image. --noise S adds Gaussian noise of S x each tensor's standard deviation to the decoder layers' BF16 weights
(seeded): a draft that agrees with its target often but not always, which the tests use to check partial
acceptance (tests/fixtures/models/tiny-llama3-draft):

    tools/make_draft_model.py tests/fixtures/models/tiny-llama3 tests/fixtures/models/tiny-llama3-draft \
        --layers 3 --noise 0.3

Standard library only, numpy for --noise (safetensors are read and written by hand).
"""

import argparse
import json
import shutil
import struct
from pathlib import Path


def read_safetensors(path):
    data = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    header.pop("__metadata__", None)
    body = data[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        tensors[name] = (info["dtype"], info["shape"], body[begin:end])
    return tensors


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        dtype, shape, blob = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def add_noise(tensors, scale, seed):
    """w + scale x std(w) x N(0, 1), rounded to BF16 (nearest even), for every BF16 weight of a decoder layer."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for name in sorted(tensors):
        dtype, shape, blob = tensors[name]
        if dtype != "BF16" or not name.startswith("model.layers.") or not name.endswith("proj.weight"):
            continue
        bits = np.frombuffer(blob, dtype=np.uint16).astype(np.uint32) << 16
        w = bits.view(np.float32)
        w = w + np.float32(scale * w.std()) * rng.standard_normal(w.shape).astype(np.float32)
        u = w.astype(np.float32).view(np.uint32)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        tensors[name] = (dtype, shape, u.astype(np.uint16).tobytes())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="the target model's directory (Hugging Face layout)")
    parser.add_argument("out", help="the draft model's directory (created)")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers kept (default 1)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="Gaussian noise on the decoder layers' BF16 weights, in units of each tensor's std")
    parser.add_argument("--seed", type=int, default=0, help="the noise's seed")
    args = parser.parse_args()
    target, out = Path(args.target), Path(args.out)
    config = json.loads((target / "config.json").read_text())
    vision = "text_config" in config
    text = dict(config["text_config"] if vision else config)
    layers = text["num_hidden_layers"]
    if not 1 <= args.layers <= layers or (args.layers == layers and args.noise == 0):
        parser.error(f"--layers must be in 1..{layers - 1} (the target has {layers}; all {layers} with --noise)")

    # The target's tensors under the names a text model has: model.language_model.* (Qwen3-VL) -> model.*
    prefix = "model.language_model." if vision else "model."
    tensors = {}
    files = sorted(target.glob("*.safetensors"))
    for file in files:
        for name, tensor in read_safetensors(file).items():
            if name.startswith(prefix):
                rest = name[len(prefix) :]
                if rest.startswith("layers.") and int(rest.split(".")[1]) >= args.layers:
                    continue
                tensors["model." + rest] = tensor
            elif name == "lm_head.weight":
                tensors[name] = tensor
    if args.noise > 0:
        add_noise(tensors, args.noise, args.seed)
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if tied:
        tensors.pop("lm_head.weight", None)

    # (a Qwen3-VL's rope_parameters carry M-RoPE's sections: a text draft gets plain RoPE with the same theta)
    draft = {k: v for k, v in text.items() if not (vision and k == "rope_parameters")}
    draft["model_type"] = "qwen3" if vision else text["model_type"]
    draft["architectures"] = ["Qwen3ForCausalLM"] if vision else config.get("architectures")
    draft["num_hidden_layers"] = args.layers
    draft["tie_word_embeddings"] = bool(tied)
    rope = text.get("rope_parameters") or {}
    if vision:
        draft["rope_theta"] = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        draft["rope_scaling"] = None
    draft["torch_dtype"] = config.get("torch_dtype", text.get("torch_dtype", text.get("dtype", "bfloat16")))
    for key in ("bos_token_id", "eos_token_id"):
        if key in config and key not in draft:
            draft[key] = config[key]
    draft["kvlite_draft_of"] = {"target": target.name, "layers": args.layers,
                                "made_by": "tools/make_draft_model.py (the target's first layers, no training)"}

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft, indent=2) + "\n")
    write_safetensors(out / "model.safetensors", tensors)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copyfile(target / name, out / name)
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}: {len(tensors)} tensors, {size} bytes, {args.layers} of {layers} layers of {target.name}")


if __name__ == "__main__":
    main()
