#!/usr/bin/env python3
"""Make random-weight checkpoints with the real shapes of published models, for `kvlite bench`.

Speed depends on shapes and formats, not on what the weights know, so a benchmark needs the real tensors'
shapes and dtypes and nothing else. This writes a Hugging Face directory kvlite opens like the real one:

    config.json              the real architecture (from models/<name>/config.json, see models/README.md)
    model.safetensors        every tensor the model reads, random, written tensor by tensor (streaming: the
                             memory used is one 32 MiB tile, whatever the model's size)
    tokenizer.json           a fixture tokenizer (tests/fixtures/models) with filler tokens "<|random_N|>" up to
    tokenizer_config.json    the config's vocab_size: the engine decodes every id it generates, so the
                             tokenizer must cover the whole vocabulary

    tools/make_random_checkpoint.py llama-3.1-8b /tmp/llama-8b                 # BF16, 16.1 GB
    tools/make_random_checkpoint.py qwen3-4b /tmp/qwen3-4b                     # BF16, 8.0 GB (tied lm_head)
    tools/make_random_checkpoint.py llama-3.1-8b /tmp/llama-w4a16 --quant w4a16    # 5.7 GB
    tools/make_random_checkpoint.py qwen3-vl-4b-text /tmp/qwen3vl-fp8 --quant fp8  # 4.4 GB
    tools/make_random_checkpoint.py --list

Presets: llama-3.1-8b (Llama-3.1-8B-Instruct), qwen3-4b (Qwen3-4B), qwen3-0.6b (Qwen3-0.6B's shapes),
llama-3.2-1b (Llama-3.2-1B's shapes: 16 layers, hidden 2048, tied embeddings, llama3 RoPE scaling),
llama-3.2-3b (Llama-3.2-3B's shapes: 28 layers, hidden 3072, 24 heads of 128, tied embeddings),
qwen3-vl-4b-text (Qwen3-VL-4B-Instruct's language model as a text-only Qwen3: the same Linears, plain RoPE instead of M-RoPE, which costs the same).
Formats (--quant):
  none   the checkpoint's dtype (BF16)
  w4a16  compressed-tensors "pack-quantized" int4, symmetric, group 128, every Linear of the decoder layers
         (lm_head stays BF16): weight_packed I32 [N, K/8], weight_scale BF16 [N, K/128], weight_shape I64 [2] -
         the layout of RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16 (models/README.md)
  w8a16  compressed-tensors "int-quantized" int8, symmetric, one scale per output channel, every Linear of the
         decoder layers (lm_head stays BF16): weight I8 [N, K], weight_scale BF16 [N, 1] (llm-compressor's W8A16)
  fp8    Qwen's fine-grained fp8 (quant_method "fp8", e4m3, 128 x 128 blocks, lm_head not converted): weight
         F8_E4M3 [N, K], weight_scale_inv F32 [ceil(N/128), ceil(K/128)]; the quantization_config is the one
         tools/make_quant_fixtures.py writes for its Qwen fp8 fixture
Values: dense weights normal(0, 0.02) (Hugging Face's initializer_range) rounded to BF16, norms 1, int4, int8 and
fp8 codes uniformly random (never the fp8 NaN codes) with scales that keep weights near 0.02: sane activations for
any number of layers, no meaning. --layers and --vocab shrink a model for a quick check of the tool itself.

Needs numpy only (runs on the GPU machine, whose python3 has it, or anywhere else with numpy).
"""

import argparse
import copy
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(TOOLS))
import make_quant_fixtures  # noqa: E402  (its Qwen fp8 quantization_config; stdlib-only at import)

MODELS = REPO / "models"
FIXTURE_MODELS = REPO / "tests" / "fixtures" / "models"

TILE_ELEMENTS = 1 << 24  # 32 MiB of BF16: the random values every dense tensor is cut from


def llama_config():
    config = json.loads((MODELS / "llama-3.1-8b-instruct-w4a16" / "config.json").read_text())
    quantization = config.pop("quantization_config")
    return config, quantization


def qwen3_config():
    return json.loads((MODELS / "qwen3-4b" / "config.json").read_text())


def qwen3_06b_config():
    """Qwen3-0.6B's shapes (its published config.json differs from Qwen3-4B's in these keys only): the CPU
    benchmarks' model (issue 45), small enough for a 2-core machine."""
    config = qwen3_config()
    config.update({"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "max_window_layers": 28})
    return config


def llama32_1b_config():
    """Llama-3.2-1B's shapes (its published config.json differs from Llama-3.1-8B-Instruct's in these keys): the
    CPU peer benchmark's second model (bench/peer-cpu.sh, issue 45). Tied embeddings, llama3 RoPE scaling 32."""
    config = llama_config()[0]
    config.update({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                   "tie_word_embeddings": True,
                   "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}})
    return config


def llama32_3b_config():
    """Llama-3.2-3B's shapes (its published config.json differs from Llama-3.1-8B-Instruct's in these keys): the GPU
    peer benchmark's small model (tools/peer-gpu.sh, issue 46). Tied embeddings, llama3 RoPE scaling 32."""
    config = llama32_1b_config()
    config.update({"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128})
    return config


def qwen3_vl_text_config():
    vl = json.loads((MODELS / "qwen3-vl-4b-instruct-fp8" / "config.json").read_text())
    text = copy.deepcopy(vl["text_config"])
    base = qwen3_config()
    config = {key: base[key] for key in ("architectures", "attention_dropout", "hidden_act", "initializer_range",
                                         "max_window_layers", "sliding_window", "use_cache", "use_sliding_window")}
    for key in ("attention_bias", "bos_token_id", "eos_token_id", "head_dim", "hidden_size", "intermediate_size",
                "max_position_embeddings", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                "rms_norm_eps", "rope_theta", "tie_word_embeddings", "vocab_size"):
        config[key] = text[key]
    config["model_type"] = "qwen3"
    config["rope_scaling"] = None  # M-RoPE sections only matter with images
    config["torch_dtype"] = text.get("dtype", "bfloat16")
    return config


PRESETS = {
    # name: (config factory, tokenizer fixture, the compressed-tensors config it ships with or None)
    "llama-3.1-8b": (lambda: llama_config()[0], "tiny-llama3", lambda: llama_config()[1]),
    "llama-3.2-1b": (llama32_1b_config, "tiny-llama3", None),
    "llama-3.2-3b": (llama32_3b_config, "tiny-llama3", None),
    "qwen3-0.6b": (qwen3_06b_config, "tiny-qwen3", None),
    "qwen3-4b": (qwen3_config, "tiny-qwen3", None),
    "qwen3-vl-4b-text": (qwen3_vl_text_config, "tiny-qwen3", None),
}

W4A16_CONFIG = {  # compressed-tensors, as llm-compressor saves W4A16 (group 128, symmetric)
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}


W8A16_CONFIG = {  # compressed-tensors int-quantized int8, symmetric, one scale per output channel (llm-compressor W8A16)
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
                    "type": "int"}}},
    "format": "int-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def fp8_config():
    return copy.deepcopy(make_quant_fixtures.MODELS["tiny-fp8-qwen"]["quantization_config"])


# ---- the tensors --------------------------------------------------------------------------------------------

class Spec:
    """One tensor: its name, safetensors dtype, shape and how its bytes are made."""

    def __init__(self, name, dtype, shape, fill):
        self.name, self.dtype, self.shape, self.fill = name, dtype, list(shape), fill

    ELEMENT_BYTES = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1}

    @property
    def nbytes(self):
        count = 1
        for d in self.shape:
            count *= d
        return count * self.ELEMENT_BYTES[self.dtype]


def linear_specs(name, out_features, in_features, quant, bias):
    """The tensors of one nn.Linear in the chosen format (lm_head is always dense)."""
    specs = []
    if quant == "w4a16":
        specs.append(Spec(name + ".weight_packed", "I32", [out_features, in_features // 8], "bytes"))
        specs.append(Spec(name + ".weight_scale", "BF16", [out_features, in_features // 128], ("const", 0.02 / 4)))
        specs.append(Spec(name + ".weight_shape", "I64", [2], ("shape", out_features, in_features)))
    elif quant == "w8a16":
        specs.append(Spec(name + ".weight", "I8", [out_features, in_features], "bytes"))
        specs.append(Spec(name + ".weight_scale", "BF16", [out_features, 1], ("const", 0.02 / 64)))
    elif quant == "fp8":
        specs.append(Spec(name + ".weight", "F8_E4M3", [out_features, in_features], "fp8"))
        blocks = [-(-out_features // 128), -(-in_features // 128)]
        specs.append(Spec(name + ".weight_scale_inv", "F32", blocks, ("const", 0.02 / 8)))
    else:
        specs.append(Spec(name + ".weight", "BF16", [out_features, in_features], "normal"))
    if bias:
        specs.append(Spec(name + ".bias", "BF16", [out_features], "normal"))
    return specs


def model_specs(config, quant):
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    qk_norm = config["model_type"] == "qwen3"
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    specs = [Spec("model.embed_tokens.weight", "BF16", [vocab, hidden], "normal")]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        specs.append(Spec(p + "input_layernorm.weight", "BF16", [hidden], ("const", 1.0)))
        for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            specs += linear_specs(p + "self_attn." + proj, rows, hidden, quant, attention_bias)
        if qk_norm:
            specs.append(Spec(p + "self_attn.q_norm.weight", "BF16", [head_dim], ("const", 1.0)))
            specs.append(Spec(p + "self_attn.k_norm.weight", "BF16", [head_dim], ("const", 1.0)))
        specs += linear_specs(p + "self_attn.o_proj", hidden, heads * head_dim, quant, False)
        specs.append(Spec(p + "post_attention_layernorm.weight", "BF16", [hidden], ("const", 1.0)))
        specs += linear_specs(p + "mlp.gate_proj", inter, hidden, quant, mlp_bias)
        specs += linear_specs(p + "mlp.up_proj", inter, hidden, quant, mlp_bias)
        specs += linear_specs(p + "mlp.down_proj", hidden, inter, quant, mlp_bias)
    specs.append(Spec("model.norm.weight", "BF16", [hidden], ("const", 1.0)))
    if not config.get("tie_word_embeddings", False):
        specs += linear_specs("lm_head", vocab, hidden, "none", False)
    return specs


# ---- bytes ----------------------------------------------------------------------------------------------------

def bf16_bytes(values):
    """float32 -> BF16 (round to nearest even) as little-endian bytes."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


class Tiles:
    """Random bytes to cut tensors from: one tile per kind, each tensor from its own offset."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.normal = bf16_bytes(rng.normal(0.0, 0.02, TILE_ELEMENTS))
        self.bytes = rng.integers(0, 256, 2 * TILE_ELEMENTS, dtype=np.uint8).tobytes()
        codes = rng.integers(0, 256, 2 * TILE_ELEMENTS, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # 0x7f / 0xff are e4m3fn's NaNs
        self.fp8 = codes.tobytes()

    def stream(self, tile, nbytes, alignment):
        """nbytes cut from `tile` cyclically, starting at a random offset (a multiple of `alignment`)."""
        start = int(self.rng.integers(0, len(tile) // alignment)) * alignment
        while nbytes > 0:
            piece = tile[start:start + nbytes]
            yield piece
            nbytes -= len(piece)
            start = 0


def tensor_chunks(spec, tiles):
    fill = spec.fill
    if fill == "normal":
        yield from tiles.stream(tiles.normal, spec.nbytes, 2)
    elif fill == "bytes":
        yield from tiles.stream(tiles.bytes, spec.nbytes, 1 if spec.dtype == "I8" else 4)
    elif fill == "fp8":
        yield from tiles.stream(tiles.fp8, spec.nbytes, 1)
    elif fill[0] == "const":
        count = spec.nbytes // Spec.ELEMENT_BYTES[spec.dtype]
        if spec.dtype == "BF16":
            yield bf16_bytes(np.full(count, fill[1], dtype=np.float32))
        else:
            yield np.full(count, fill[1], dtype="<f4").tobytes()
    elif fill[0] == "shape":
        yield struct.pack("<qq", fill[1], fill[2])
    else:
        raise ValueError(f"unknown fill {fill!r} for {spec.name}")


def write_safetensors(path, specs, seed):
    """Header first (every offset is known from the shapes), then each tensor in turn."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": spec.shape, "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tiles = Tiles(seed)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for spec in specs:
            written = 0
            for chunk in tensor_chunks(spec, tiles):
                out.write(chunk)
                written += len(chunk)
            if written != spec.nbytes:
                raise AssertionError(f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}")
    return offset


def write_tokenizer(fixture, vocab_size, directory):
    """The fixture's tokenizer with special filler tokens for every id it lacks below vocab_size."""
    source = FIXTURE_MODELS / fixture
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    used = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    if max(used) >= vocab_size:
        raise SystemExit(f"{fixture}'s tokenizer has ids up to {max(used)}, beyond vocab_size {vocab_size}")
    for token_id in range(vocab_size):
        if token_id not in used:
            tokenizer["added_tokens"].append({"id": token_id, "content": f"<|random_{token_id}|>", "single_word": False,
                                              "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    shutil.copyfile(source / "tokenizer_config.json", directory / "tokenizer_config.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", nargs="?", choices=sorted(PRESETS))
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--quant", choices=["none", "w4a16", "w8a16", "fp8"], default="none")
    parser.add_argument("--layers", type=int, help="fewer decoder layers (a quick check of the tool)")
    parser.add_argument("--vocab", type=int, help="a smaller vocabulary (a quick check of the tool)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the presets and their sizes")
    args = parser.parse_args()
    if args.list:
        for name, (make_config, _, _) in sorted(PRESETS.items()):
            config = make_config()
            sizes = ", ".join(f"{quant} {sum(s.nbytes for s in model_specs(config, quant)) / 1e9:.1f} GB"
                              for quant in ("none", "w4a16", "w8a16", "fp8"))
            print(f"{name}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, vocab "
                  f"{config['vocab_size']}: {sizes}")
        return
    if not args.preset or not args.out_dir:
        parser.error("PRESET and OUT_DIR are required (or --list)")
    make_config, tokenizer_fixture, shipped_quantization = PRESETS[args.preset]
    config = make_config()
    if args.layers:
        config["num_hidden_layers"] = args.layers
        config.pop("layer_types", None)
    if args.vocab:
        config["vocab_size"] = args.vocab
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            config.pop(key, None)
    if args.quant == "w4a16":
        config["quantization_config"] = shipped_quantization() if shipped_quantization else copy.deepcopy(W4A16_CONFIG)
    elif args.quant == "w8a16":
        config["quantization_config"] = copy.deepcopy(W8A16_CONFIG)
    elif args.quant == "fp8":
        config["quantization_config"] = fp8_config()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    specs = model_specs(config, args.quant)
    total = write_safetensors(out / "model.safetensors", specs, args.seed)
    write_tokenizer(tokenizer_fixture, config["vocab_size"], out)
    print(f"wrote {out}: {args.preset} ({args.quant}), {len(specs)} tensors, {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
