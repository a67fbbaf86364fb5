#!/usr/bin/env python3
"""Make the external-truth fixtures of the model families kvlite runs besides Llama / Qwen: tiny random
models saved with transformers' own classes, and transformers' float32 outputs for them.

    /opt/kvdev/bin/python tools/make_family_fixtures.py     # writes tests/fixtures/families/<name>/

Each family keeps its real features at a tiny size (hidden 64, 3-4 layers, float32 on disk):

  mistral        Llama's block, sliding_window 8 on every layer, untied lm_head
  qwen2-swa      use_sliding_window with max_window_layers 1: layer 0 full, layers 1.. sliding (window 8)
  phi3           fused qkv_proj and gate_up_proj, sliding_window 8
  gemma2         x (1 + w) norms, sqrt(H) embedding scale, GeGLU (gelu_pytorch_tanh), sandwich norms, attention
                 and final logit soft-caps (small caps so that tanh bends), query_pre_attn_scalar != head_dim,
                 sliding / full alternating (window 8), head_dim 32 != hidden / heads
  gemma3_text    q/k norms (1 + w), sliding_window_pattern 2 (sliding, full, ...), window 8, local RoPE base
                 10000 against the global 1e6, no soft-caps

Every norm weight is drawn at random (not transformers' zeros or ones) so that the norm form x w versus
x (1 + w) decides the output. The prompts are raw token ids (byte-level tokenizer of tests/fixtures/models/
tiny-qwen2, copied: tokenizers are another part's concern); the longest is 40 tokens, past 3 x the window.
Outputs (AutoModelForCausalLM with attn_implementation="eager", float32, CPU):
  logits_<k>.npy  float32 [T, vocab] of prompt k in one forward
  reference.json  the prompts, greedy continuations (generate(do_sample=False)), library versions

RoPE per family (every scaling type on Llama / Qwen2 lives with RoPE's own fixtures, make_rope_fixtures.py):
  gemma3_text-linear  gemma3_text with rope_scaling linear (factor 8) on the global layers, the local layers on
                      their own default RoPE of base rope_local_base_freq (Gemma-3-4B's arrangement)
  phi3-partial        phi3 with partial_rotary_factor 0.75 and the default RoPE (Phi3's own default reads it)
  phi3-longrope       Phi-4-mini's arrangement: partial_rotary_factor 0.75 and longrope (short / long factors)
                      with original_max_position_embeddings 24, so the 40-token prompt crosses it in its prefill
                      and the 19-token prompt while generating. Its frequencies depend on each forward call's
                      length, so besides the one-forward logits it records:
                        logits_<k>_chunks_3.npy  the prompt fed in chunks of 3 through the cache
                        greedy_pieces            greedy decoding fed as kvlite feeds it: the prompt in one call,
                                                 then one token per call through the cache
                      and greedy (generate()) as transformers' Phi-3 does it: it drops its cache and recomputes
                      the whole sequence with the long factors when it first passes the original length.

    /opt/kvdev/bin/python tools/make_family_fixtures.py phi3-longrope ...   # only the named cases
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "families"
TOKENIZER_FROM = ROOT / "tests" / "fixtures" / "models" / "tiny-qwen2"
VOCAB = 1415          # the copied tokenizer's
EOS = 1405
WINDOW = 8
NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 19, 40]  # inside the window, past 2 x W, past 3 x W (+ the continuation)
LONGROPE_ORIGINAL = 24        # phi3-longrope's original_max_position_embeddings: between the prompts' lengths
CHUNK = 3

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=EOS - 2, eos_token_id=EOS,
              pad_token_id=0)


def families():
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config, Qwen2Config
    return {
        "mistral": MistralConfig(**COMMON, num_hidden_layers=3, sliding_window=WINDOW, rope_theta=1e6,
                                 tie_word_embeddings=False),
        "qwen2-swa": Qwen2Config(**COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1, rope_theta=1e6, tie_word_embeddings=True),
        "phi3": Phi3Config(**COMMON, num_hidden_layers=3, sliding_window=WINDOW, rope_theta=10000.0,
                           tie_word_embeddings=False, original_max_position_embeddings=256),
        "gemma2": Gemma2Config(**COMMON, num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
                               query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                               hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "gemma3_text": Gemma3TextConfig(**COMMON, num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
                                        sliding_window_pattern=2, query_pre_attn_scalar=24, rope_theta=1e6,
                                        rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
                                        tie_word_embeddings=True),
        "gemma3_text-linear": Gemma3TextConfig(**COMMON, num_hidden_layers=4, head_dim=32, sliding_window=WINDOW,
                                               sliding_window_pattern=2, query_pre_attn_scalar=24,
                                               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                                   "rope_theta": 1e6},
                                                                "sliding_attention": {"rope_type": "default",
                                                                                      "rope_theta": 10000.0}},
                                               hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "phi3-partial": Phi3Config(**COMMON, num_hidden_layers=3, rope_theta=10000.0, partial_rotary_factor=0.75,
                                   tie_word_embeddings=True, original_max_position_embeddings=256),
        # rotary_dim = int(16 * 0.75) = 12: 6 frequencies, each with its own short and long divisor
        "phi3-longrope": Phi3Config(**COMMON, num_hidden_layers=3, rope_theta=10000.0, partial_rotary_factor=0.75,
                                    tie_word_embeddings=True, original_max_position_embeddings=LONGROPE_ORIGINAL,
                                    rope_scaling={"type": "longrope",
                                                  "short_factor": [1.0, 1.02, 1.05, 1.1, 1.3, 1.6],
                                                  "long_factor": [1.0, 1.5, 3.0, 7.0, 16.0, 40.0]}),
    }


def randomize(model, generator, embedding_std):
    """Every parameter drawn again: Linears N(0, 0.15^2) (logits of a few units, so argmax is not a coin toss),
    embeddings N(0, embedding_std^2), norms N(0, 0.3^2) around transformers' init (zeros for Gemma's 1 + w, ones
    otherwise). Gemma's tied table is drawn smaller: scaled by sqrt(H) it would otherwise outweigh the layers, and
    greedy decoding would repeat the last token forever (a continuation that tests nothing)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(p + 0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(embedding_std * noise)
            else:
                p.copy_(0.15 * noise)


def chunked_logits(model, ids):
    """The prompt fed CHUNK tokens a call through a DynamicCache: each call's rotary frequencies follow its own
    max(position_ids) + 1 (dynamic_rope_update), cached keys keep theirs."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    rows = []
    with torch.no_grad():
        for start in range(0, len(ids), CHUNK):
            piece = torch.tensor([ids[start:start + CHUNK]])
            positions = torch.arange(start, start + piece.shape[1])[None]
            out = model(input_ids=piece, past_key_values=cache, position_ids=positions, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0].float().numpy())
    return np.concatenate(rows, axis=0)


def greedy_in_pieces(model, ids):
    """Greedy decoding as kvlite's engine feeds it: the prompt in one call, then one token a call through the
    cache (no recomputation when the sequence passes original_max_position_embeddings)."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    new_ids = []
    with torch.no_grad():
        piece, start = list(ids), 0
        for _ in range(NEW_TOKENS):
            positions = torch.arange(start, start + len(piece))[None]
            out = model(input_ids=torch.tensor([piece]), past_key_values=cache, position_ids=positions, use_cache=True)
            cache = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            new_ids.append(token)
            if token == EOS:
                break
            start += len(piece)
            piece = [token]
    return new_ids


def make(name, config, seed, pieces=False):
    directory = OUT / name
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    randomize(model, generator, 0.02 if config.model_type.startswith("gemma") else 0.15)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(directory))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / file, directory / file)

    # Reload from disk, as a user would: the reference is what the saved files compute.
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    rng = np.random.default_rng(seed)
    prompts = []
    for k, length in enumerate(PROMPT_LENGTHS):
        ids = [int(x) for x in rng.integers(3, VOCAB - 16, size=length)]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids).logits[0].float().numpy()
            generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=0)
        np.save(directory / f"logits_{k}.npy", logits.astype(np.float32))
        new_ids = [int(x) for x in generated[0, length:]]
        entry = {"input_ids": ids, "logits_file": f"logits_{k}.npy",
                 "greedy": {"max_new_tokens": NEW_TOKENS, "new_ids": new_ids,
                            "stopped_at_eos": bool(new_ids and new_ids[-1] == EOS)}}
        if pieces:
            np.save(directory / f"logits_{k}_chunks_{CHUNK}.npy", chunked_logits(model, ids).astype(np.float32))
            entry["chunks_logits_file"] = f"logits_{k}_chunks_{CHUNK}.npy"
            entry["greedy_pieces"] = {"max_new_tokens": NEW_TOKENS, "new_ids": greedy_in_pieces(model, ids)}
        prompts.append(entry)
    reference = {
        "model": name,
        "generator": "tools/make_family_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "dtype_on_disk": "float32",
        "reference_dtype": "float32",
        "attn_implementation": "eager",
        "sliding_window": WINDOW,
        "notes": ["logits_<k>.npy: float32 [T, vocab], row t = logits after input_ids[0..t], one forward.",
                  "greedy: model.generate(do_sample=False, max_new_tokens=12), stopping at eos_token_id."]
                 + (["logits_<k>_chunks_3.npy: the prompt in chunks of 3 through a DynamicCache, each call's "
                     "frequencies by its own length.",
                     "greedy_pieces: the prompt in one call, then one token a call through the cache (generate() "
                     "of Phi-3 instead recomputes everything when the sequence first passes "
                     "original_max_position_embeddings)."] if pieces else []),
        "prompts": prompts,
    }
    (directory / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"greedy {[p['greedy']['new_ids'] for p in prompts]}")


def main():
    wanted = set(sys.argv[1:])
    for seed, (name, config) in enumerate(families().items()):
        if wanted and name not in wanted:
            continue
        make(name, config, 100 + seed, pieces=name == "phi3-longrope")


if __name__ == "__main__":
    main()
