#!/usr/bin/env python3
"""Make kvlite's RoPE-scaling fixtures with transformers (tests/fixtures/rope/, read by tests/unit-rope.cpp).

    /opt/kvdev/bin/python tools/make_rope_fixtures.py

(a) tables.json: for each case (a config.json of a real model's rotary settings: Llama-3.1, Qwen2.5 with YaRN,
    Phi-3.5 / Phi-4-mini longrope with partial rotary, DeepSeek-style YaRN mscale, dynamic NTK, linear) and
    each sequence length, what a freshly made transformers rotary module computes in its forward for
    position_ids whose largest entry is length - 1: the inv_freq it used (after dynamic_rope_update), its
    attention_scaling and the first rotary_dim / 2 columns of cos and sin (emb = cat(freqs, freqs)). The same
    inv_freq also comes straight from ROPE_INIT_FUNCTIONS(config, seq_len=tensor(length)) where the type reads
    seq_len, and is recorded as `init_inv_freq` (seq_len=None).
(b) models/<arch>-<type>/: tiny random llama and qwen2 models (save_pretrained, float32) for each scaling type
    with a small original_max_position_embeddings (24), a byte-level tokenizer, and reference.json: for a
    prompt of 40 tokens (crossing 24 in the prefill) and one of 16 (crossing it while generating): the float32
    logits of one forward over the prompt, the logits of the prompt fed one token at a time through the cache
    (what differs for dynamic and longrope, whose frequencies follow the call's length), and greedy
    generate() continuations (prefill in one call, then one token per call).
Each run of the rotary module starts from a fresh module: transformers' dynamic RoPE keeps state between
calls (max_seq_len_cached).
"""
import json
import math
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "rope"

# A llama-shaped config.json around a rotary setting; head_dim is what the rotary code reads.
def config_json(head_dim, max_pos, rope, layout="rope_scaling", extra=None, theta=10000.0):
    doc = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": head_dim * 4,
           "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
           "head_dim": head_dim, "vocab_size": 256, "max_position_embeddings": max_pos, "rms_norm_eps": 1e-6,
           "torch_dtype": "float32"}
    if layout == "rope_scaling":
        doc["rope_theta"] = theta
        if rope is not None:
            doc["rope_scaling"] = rope
    else:
        doc["rope_parameters"] = {"rope_theta": theta, **(rope or {"rope_type": "default"})}
    doc.update(extra or {})
    return doc


def ramp(n, lo, hi):
    return [round(lo + (hi - lo) * i / max(n - 1, 1), 4) for i in range(n)]


TABLE_CASES = [
    ("default", config_json(128, 4096, None, theta=500000.0), [1, 100, 4096, 9000]),
    ("linear-4", config_json(128, 4096, {"rope_type": "linear", "factor": 4.0}), [1, 4096, 16384]),
    ("linear-v5-layout", config_json(64, 2048, {"rope_type": "linear", "factor": 2.5}, layout="rope_parameters"),
     [2048, 5000]),
    # dynamic NTK: frequencies recomputed from seq_len once it passes max_position_embeddings
    ("dynamic-2", config_json(128, 2048, {"type": "dynamic", "factor": 2.0}), [100, 2048, 2049, 3000, 8191]),
    ("dynamic-3.3-v5", config_json(64, 512, {"rope_type": "dynamic", "factor": 3.3}, layout="rope_parameters",
                                   theta=1000000.0), [512, 777, 4000]),
    # Qwen2.5-7B's model card YaRN
    ("yarn-qwen2.5", config_json(128, 32768, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                                 theta=1000000.0), [1, 32768, 32769, 131072]),
    ("yarn-mscale", config_json(64, 163840, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0},
                                theta=10000.0, layout="rope_parameters"), [4096, 100000]),
    ("yarn-no-truncate-attn", config_json(96, 8192, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                                                     "beta_fast": 16, "beta_slow": 2, "truncate": False,
                                                     "attention_factor": 1.25}), [4096, 8192]),
    # Phi-3.5-mini: longrope with top-level original_max_position_embeddings, factor absent
    ("longrope-phi3.5", config_json(96, 131072, {"type": "longrope", "short_factor": ramp(48, 1.0, 1.9),
                                                 "long_factor": ramp(48, 1.08, 60.0)},
                                    extra={"original_max_position_embeddings": 4096}), [1, 4096, 4097, 20000]),
    # Phi-4-mini: partial_rotary_factor 0.75 of head_dim 128 -> rotary_dim 96
    ("longrope-phi4-partial", config_json(128, 131072, {"type": "longrope", "short_factor": ramp(48, 1.0, 3.0),
                                                        "long_factor": ramp(48, 1.0, 40.0)},
                                          extra={"original_max_position_embeddings": 4096,
                                                 "partial_rotary_factor": 0.75}), [4096, 4097, 131072]),
    ("longrope-attn-v5", config_json(64, 8192, {"rope_type": "longrope", "short_factor": ramp(32, 1.0, 1.5),
                                                "long_factor": ramp(32, 1.0, 8.0), "factor": 4.0,
                                                "attention_factor": 1.1, "original_max_position_embeddings": 2048},
                                     layout="rope_parameters"), [2048, 2049]),
    ("llama3.1", config_json(128, 131072, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             theta=500000.0), [1, 8192, 131072]),
]


def positions_for(length):
    """A few positions up to length - 1 (the largest decides seq_len), spread over the range."""
    picks = {0, 1, length // 3, length // 2, length - 2, length - 1}
    return sorted(p for p in picks if 0 <= p < length)


def llama_config(doc):
    kwargs = {k: v for k, v in doc.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return LlamaConfig(**kwargs)


def table_case(name, doc, lengths):
    config = llama_config(doc)
    rope = config.rope_parameters
    rope_type = rope["rope_type"]
    out = {"name": name, "config": doc, "rope_type": rope_type, "lengths": []}
    fresh = LlamaRotaryEmbedding(config)
    out["init_inv_freq"] = fresh.inv_freq.tolist()
    out["init_attention_scaling"] = float(fresh.attention_scaling)
    for length in lengths:
        module = LlamaRotaryEmbedding(config)  # fresh: dynamic RoPE is stateful
        positions = positions_for(length)
        position_ids = torch.tensor([positions], dtype=torch.int64)
        x = torch.zeros(1, dtype=torch.float32)
        cos, sin = module(x, position_ids)
        half = module.inv_freq.shape[0]
        entry = {"length": length, "positions": positions, "inv_freq": module.inv_freq.tolist(),
                 "attention_scaling": float(module.attention_scaling),
                 "cos": cos[0, :, :half].tolist(), "sin": sin[0, :, :half].tolist()}
        if rope_type in ("dynamic", "longrope"):
            # the init function called as the forward calls it (seq_len a tensor)
            seq_len = torch.tensor(length) if rope_type == "dynamic" else (
                rope["original_max_position_embeddings"] + 1 if length > rope["original_max_position_embeddings"] else None)
            if rope_type == "dynamic" and length <= config.max_position_embeddings:
                seq_len = None
            inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
            assert torch.equal(inv, module.inv_freq), (name, length)
        out["lengths"].append(entry)
    return out


# ---- (b) tiny models ---------------------------------------------------------------------------------------

ORIGINAL = 24      # original_max_position_embeddings of the tiny models (dynamic, linear: max_position_embeddings)
LONG_PROMPT = 40   # crosses ORIGINAL in the prefill
SHORT_PROMPT = 16  # crosses it while generating
NEW_TOKENS = 12
CHUNK = 7          # the long prompt is also fed 7 tokens per call (a chunked prefill)
VOCAB = 257        # 256 bytes and <eos> = 256 (every id the model can pick decodes)


def model_ropes(arch):
    """(type, max_position_embeddings, rope dict) per scaling type; the two archs differ in the details."""
    if arch == "llama":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 8,
                "beta_slow": 0.5, "truncate": False, "mscale": 0.8, "mscale_all_dim": 0.5}
    else:  # Qwen2.5's model-card form
        yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    return [
        ("linear", ORIGINAL, {"rope_type": "linear", "factor": 4.0}),
        ("dynamic", ORIGINAL, {"type": "dynamic", "factor": 3.0}),
        ("yarn", 4 * ORIGINAL, yarn),
        ("longrope", 4 * ORIGINAL, {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                                    "short_factor": ramp(8, 1.0, 1.6), "long_factor": ramp(8, 1.2, 9.0)}),
        ("llama3", 4 * ORIGINAL, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    ]


def byte_tokenizer(directory):
    """A byte-level BPE with no merges: ids 0..255 are the bytes, 256 is <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = {}
    for b in range(256):  # GPT-2's byte-to-unicode order, so id == byte value
        table[b] = None
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_to_char = dict(zip(bs, (chr(c) for c in cs)))
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    assert tok.token_to_id("<eos>") == 256
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "model_max_length": 4 * ORIGINAL, "tokenizer_class": "PreTrainedTokenizerFast"},
        indent=2) + "\n")


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.25 * noise)


def fresh_rotary(model):
    inner = model.model
    inner.rotary_emb = type(inner.rotary_emb)(config=model.config)


@torch.no_grad()
def one_shot_logits(model, ids):
    fresh_rotary(model)
    return model(torch.tensor([ids])).logits[0].float().numpy()


@torch.no_grad()
def token_by_token_logits(model, ids):
    from transformers import DynamicCache
    fresh_rotary(model)
    cache = DynamicCache(config=model.config)
    rows = []
    for t, token in enumerate(ids):
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[t]]))
        cache = out.past_key_values
        rows.append(out.logits[0, -1].float().numpy())
    return np.stack(rows)


@torch.no_grad()
def chunked_logits(model, ids, chunk):
    """The prompt fed `chunk` tokens per call through the cache, as a chunked prefill feeds it."""
    from transformers import DynamicCache
    fresh_rotary(model)
    cache = DynamicCache(config=model.config)
    rows = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        out = model(torch.tensor([piece]), past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(start, start + len(piece))[None])
        cache = out.past_key_values
        rows.append(out.logits[0].float().numpy())
    return np.concatenate(rows)


@torch.no_grad()
def greedy(model, ids):
    fresh_rotary(model)
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=256,
                         pad_token_id=256, output_logits=True, return_dict_in_generate=True)
    new_ids = out.sequences[0, len(ids):].tolist()
    margins = []
    for logits in out.logits:
        top = torch.topk(logits[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return {"max_new_tokens": NEW_TOKENS, "new_ids": new_ids, "stopped_at_eos": bool(new_ids and new_ids[-1] == 256),
            "top1_margins": margins}


def build_model(arch, rope_type, max_pos, rope, seed):
    name = f"{arch}-{rope_type}"
    directory = OUT / "models" / name
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos, rms_norm_eps=1e-6,
                  eos_token_id=256, bos_token_id=None, pad_token_id=None, rope_scaling=dict(rope),
                  rope_theta=10000.0 if arch == "llama" else 1000000.0)
    if arch == "llama":
        config = LlamaConfig(tie_word_embeddings=False, **common)
        model = LlamaForCausalLM(config)
    else:
        config = Qwen2Config(tie_word_embeddings=True, **common)
        model = Qwen2ForCausalLM(config)
    config._attn_implementation = "eager"
    randomize(model, seed)
    model = model.to(torch.float32).eval()
    model.generation_config.eos_token_id = 256
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(str(directory))
    byte_tokenizer(directory)
    # the reference comes from the saved files, as a user would load them
    model = (LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM).from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager").eval()

    rng = np.random.default_rng(seed)
    prompts = []
    for kind, length in (("long", LONG_PROMPT), ("short", SHORT_PROMPT)):
        ids = [int(i) for i in rng.integers(0, 256, size=length)]
        one = one_shot_logits(model, ids)
        step = token_by_token_logits(model, ids)
        np.save(directory / f"logits_{kind}.npy", one)
        np.save(directory / f"logits_{kind}_token_by_token.npy", step)
        entry = {}
        if kind == "long":
            np.save(directory / f"logits_{kind}_chunks_{CHUNK}.npy", chunked_logits(model, ids, CHUNK))
            entry = {"chunked_logits_file": f"logits_{kind}_chunks_{CHUNK}.npy", "chunk": CHUNK}
        prompts.append({"name": kind, "input_ids": ids, "logits_file": f"logits_{kind}.npy", **entry,
                        "token_by_token_logits_file": f"logits_{kind}_token_by_token.npy",
                        "token_by_token_vs_one_shot_max_abs": float(np.abs(one - step).max()),
                        "greedy": greedy(model, ids)})
    reference = {
        "model": name, "generator": "tools/make_rope_fixtures.py", "transformers_version": transformers.__version__,
        "torch_version": torch.__version__, "numpy_version": np.__version__, "dtype": "float32",
        "attn_implementation": "eager", "rope_type": rope_type, "rope": rope, "max_position_embeddings": max_pos,
        "notes": [
            "logits_<kind>.npy: float32 [T, vocab], model(input_ids) in one call from a fresh rotary module.",
            "logits_<kind>_token_by_token.npy: the prompt fed one token per call through a DynamicCache "
            "(position_ids = t); row t = logits after input_ids[0..t]. dynamic/longrope rotate each token with "
            "the frequencies of its own call's seq_len = t + 1, and cached keys keep theirs.",
            "logits_long_chunks_7.npy: the long prompt fed 7 tokens per call through a DynamicCache (a chunked "
            "prefill); dynamic/longrope take each call's seq_len = its last position + 1.",
            "greedy: generate(do_sample=False, max_new_tokens=12, eos 256): prefill in one call, then one token "
            "per call; top1_margins: logit(top1) - logit(top2) per step.",
        ],
        "prompts": prompts,
    }
    (directory / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    return name


def main():
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    tables = {"generator": "tools/make_rope_fixtures.py", "transformers_version": transformers.__version__,
              "torch_version": torch.__version__,
              "notes": ["Each length: a fresh LlamaRotaryEmbedding(config) called with position_ids = positions "
                        "(largest = length - 1); inv_freq and attention_scaling as the module holds them after "
                        "dynamic_rope_update; cos/sin [positions, rotary_dim / 2] (the first half of emb)."],
              "cases": [table_case(*case) for case in TABLE_CASES]}
    (OUT / "tables.json").write_text(json.dumps(tables) + "\n")
    names = []
    seed = 390
    for arch in ("llama", "qwen2"):
        for rope_type, max_pos, rope in model_ropes(arch):
            seed += 1
            names.append(build_model(arch, rope_type, max_pos, rope, seed))
            print("wrote", names[-1], file=sys.stderr)
    (OUT / "models.json").write_text(json.dumps({"models": names}, indent=1) + "\n")


if __name__ == "__main__":
    main()
