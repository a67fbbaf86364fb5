#!/usr/bin/env python3
"""Fixtures for kvlite's fp8 (e4m3) KV cache, made outside kvlite:

1. tests/fixtures/fp8_kv/attention.json: a numpy emulation of what an fp8 KV cache stores and what attention
   reads back. K and V rows are divided by their layer's scale, saturated to +-448 and rounded to nearest even on
   the e4m3 grid (vLLM's scaled conversion); the stored bytes, and causal attention over the dequantized
   values (e4m3 x scale in float32, then float64 softmax), are the expected results. The grid rounding here is
   numpy's own (frexp and round-half-even), not kvlite's bit manipulation.
2. tests/fixtures/models/tiny-llama3-fp8kv: tests/fixtures/models/tiny-llama3 with a compressed-tensors
   kv_cache_scheme and per-layer self_attn.k_scale / v_scale calibrated as llm-compressor does for static
   per-tensor fp8 (max |K| or |V| over a calibration prompt / 448), the K and V taken from transformers'
   KV cache (keys after RoPE).

    /opt/kvdev/bin/python tools/make_fp8_kv_fixtures.py      (numpy for 1; torch + transformers for 2)
"""
import json
import os
import shutil

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E4M3_MAX = 448.0


def e4m3_round(x):
    """Nearest e4m3fn value (ties to even), saturated to +-448, for float32 inputs (no NaN here)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), E4M3_MAX)
    _, e = np.frexp(a)                        # a = m * 2^e, m in [0.5, 1)
    exponent = np.maximum(e - 1, -6)          # a = 1.f * 2^(e-1); below 2^-6 the step stays 2^-9 (subnormals)
    step = np.ldexp(1.0, exponent - 3)        # 3 mantissa bits
    q = np.round(a / step) * step             # numpy rounds half to even
    q = np.minimum(q, E4M3_MAX)
    return np.sign(x) * q


def e4m3_byte(v):
    """The e4m3fn encoding of a value already on the grid."""
    sign = 0x80 if (v < 0 or (v == 0 and np.signbit(v))) else 0
    a = abs(float(v))
    if a == 0:
        return sign
    if a < 2.0 ** -6:
        return sign | int(round(a / 2.0 ** -9))
    m, e = np.frexp(a)
    exponent = e - 1
    mantissa = int(round((a / 2.0 ** exponent - 1.0) * 8))
    return int(sign | ((int(exponent) + 7) << 3) | mantissa)


def attention_fixture():
    rng = np.random.default_rng(2026)
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 11
    k_scale, v_scale = np.float32(0.0125), np.float32(0.004)
    q = rng.uniform(-1, 1, (tokens, heads * head_dim)).astype(np.float32) * np.float32(3)
    k = rng.uniform(-1, 1, (tokens, kv_heads * head_dim)).astype(np.float32)
    v = rng.uniform(-1, 1, (tokens, kv_heads * head_dim)).astype(np.float32)
    # Edges: values that saturate (over 448 x scale), that land on subnormals, exact zeros and ties.
    k[2, :4] = np.float32([20.0, -9.0, 5.6, -5.6])
    k[3, :3] = np.float32([1e-5, -3e-5, 0.0])
    v[4, :3] = np.float32([2.5, -1e-6, 0.0])
    k[5, 0] = np.float32(0.0125 * 1.0625)  # exactly between 1.0 and 1.125 after the division: ties to even
    # The division in float32, as the cache write does, then the e4m3 grid.
    kq = e4m3_round((k / k_scale).astype(np.float32)).astype(np.float32)
    vq = e4m3_round((v / v_scale).astype(np.float32)).astype(np.float32)
    k_bytes = [[e4m3_byte(x) for x in row] for row in kq]
    v_bytes = [[e4m3_byte(x) for x in row] for row in vq]
    k_read = (kq * k_scale).astype(np.float32).astype(np.float64)  # e4m3 x scale in float32
    v_read = (vq * v_scale).astype(np.float32).astype(np.float64)
    scaling = float(np.float32(1.0) / np.sqrt(np.float32(head_dim)))
    group = heads // kv_heads
    out = np.zeros((tokens, heads * head_dim))
    for t in range(tokens):
        for h in range(heads):
            kv = h // group
            qh = q[t, h * head_dim:(h + 1) * head_dim].astype(np.float64)
            scores = k_read[:t + 1, kv * head_dim:(kv + 1) * head_dim] @ qh * scaling
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[t, h * head_dim:(h + 1) * head_dim] = p @ v_read[:t + 1, kv * head_dim:(kv + 1) * head_dim]
    fixture = {
        "about": "tools/make_fp8_kv_fixtures.py: numpy emulation of an e4m3 KV cache with per-layer scales",
        "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "tokens": tokens,
        "k_scale": float(k_scale), "v_scale": float(v_scale), "attention_scaling": scaling,
        "q": q.tolist(), "k": k.tolist(), "v": v.tolist(),
        "k_bytes": k_bytes, "v_bytes": v_bytes, "out": out.tolist(),
    }
    path = os.path.join(ROOT, "tests", "fixtures", "fp8_kv", "attention.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(fixture, f)
    print("wrote", os.path.relpath(path, ROOT))


def scales_checkpoint():
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    source = os.path.join(ROOT, "tests", "fixtures", "models", "tiny-llama3")
    target = os.path.join(ROOT, "tests", "fixtures", "models", "tiny-llama3-fp8kv")
    os.makedirs(target, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(source, name), os.path.join(target, name))
    with open(os.path.join(source, "reference.json")) as f:
        prompts = [p["input_ids"] for p in json.load(f)["prompts"]]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.eval()
    layers = model.config.num_hidden_layers
    k_max = np.zeros(layers)
    v_max = np.zeros(layers)
    with torch.no_grad():
        for ids in prompts:
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
            for l in range(layers):
                keys, values = cache.layers[l].keys, cache.layers[l].values
                k_max[l] = max(k_max[l], float(keys.abs().max()))
                v_max[l] = max(v_max[l], float(values.abs().max()))
    tensors = load_file(os.path.join(source, "model.safetensors"))
    scales = {}
    for l in range(layers):
        tensors[f"model.layers.{l}.self_attn.k_scale"] = torch.tensor([k_max[l] / E4M3_MAX], dtype=torch.float32)
        tensors[f"model.layers.{l}.self_attn.v_scale"] = torch.tensor([v_max[l] / E4M3_MAX], dtype=torch.float32)
        scales[l] = (float(k_max[l] / E4M3_MAX), float(v_max[l] / E4M3_MAX))
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                            "symmetric": True},
        "ignore": ["lm_head"], "quantization_status": "compressed",
    }
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(target, "scales.json"), "w") as f:
        json.dump({"about": "per-layer [k_scale, v_scale] = max |K|, max |V| over the reference prompts / 448 "
                            f"(transformers {transformers.__version__}, torch {torch.__version__})",
                   "scales": [scales[l] for l in range(layers)]}, f, indent=1)
    print("wrote", os.path.relpath(target, ROOT), "scales", scales)


if __name__ == "__main__":
    attention_fixture()
    scales_checkpoint()
