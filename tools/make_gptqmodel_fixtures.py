#!/usr/bin/env python3
"""Make kvlite's GPTQModel fixtures: tiny random Qwen3 models quantized by GPTQModel itself (its GPTQ and AWQ
quantizers, on the CPU), saved by GPTQModel, and the logits transformers computes from the weights that
GPTQModel's own kernels dequantize from the saved checkpoint.

    tests/fixtures/quant_formats/gptqmodel-<case>/   config.json + quantize_config.json (as GPTQModel writes them),
                                       model.safetensors (GPTQModel's packing), tokenizer files,
                                       reference.json, logits.npy

Unlike tools/make_awq_gptq_fixtures.py (which packs per the formats' definitions), nothing here quantizes or
packs: the seeded dense model goes through `GPTQModel.load(dense, QuantizeConfig(...)).quantize(calibration)`
and `.save(dir)`. GPTQ cases save GPTQModel's default v1 (`format="gptq"`: qzeros hold zero - 1) except the
gptq-v2-* / gptq8-v2-* ones, saved with `format="gptq_v2"` (FORMAT.GPTQ_V2: `checkpoint_format: gptq_v2`, qzeros
hold the zero itself); GPTQModel loads those back without its v1 -> v2 conversion. The reference then loads the saved checkpoint back with `GPTQModel.load(dir,
backend=BACKEND.TORCH)` and takes every quantized Linear's weight from GPTQModel's own dequantization
(`TorchLinear.dequantize_weight` for GPTQ; `gptqmodel.quantization.awq.utils.packing_utils.dequantize_gemm`,
what its AwqTorchLinear runs, for AWQ), widens it to float32 and runs transformers' Qwen3 (eager, float32, CPU).

Environment (a venv of its own: GPTQModel pulls ~40 packages; see tools/README.md):

    python3.11 -m venv /opt/kvquant
    /opt/kvquant/bin/pip install --no-deps torch==2.15.0   # + the nvidia-* libs of tools/README.md
    /opt/kvquant/bin/pip install transformers==5.23.0 tokenizers==0.23.3 gptqmodel==7.7.0
    GPTQMODEL_CPU_WORKERS=2 /opt/kvquant/bin/python tools/make_gptqmodel_fixtures.py [CASE...]

GPTQMODEL_CPU_WORKERS=2: GPTQModel 7.7.0 sizes its CPU pool as (cores + 1) // 2 and then asks for a 2-worker
model-loader pool inside it, which fails on a 2-core machine ("Virtual pool 'model_loader:cpu' requests 2
workers but parent 'cpu' only has 1"); the script sets it itself before importing gptqmodel.

About 45 s a case on 2 cores. Seeded; GPTQModel on the CPU is deterministic for these sizes (rerun to check:
the script prints each case's model.safetensors sha256).
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as base  # noqa: E402  (tokenizer training, randomize_weights, greedy_without_cache)

OUT = base.FIXTURES / "quant_formats"  # beside make_awq_gptq_fixtures.py's cases, as gptqmodel-<case>
TOKENIZER_VOCAB = 264  # trained BPE entries (256 bytes + 8 merges): small embeddings keep the fixtures small
PROMPT = "The quick brown fox jumps over the lazy dog."
NEW_TOKENS = 16

# Tiny Qwen3s. hidden 64 keeps the fixtures small (the 9 cases total ~995 KiB); the group-128 case needs
# in_features >= 128 (a group of 128 inputs), so it alone uses hidden 128 (~220 KB).
SMALL = dict(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
WIDE = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32)

CASES = {
    # GPTQ, desc_act on (act-order: g_idx a permutation of the groups), asymmetric, groups of 32
    "gptq-g32-asym-actorder": dict(model=SMALL, seed=4101, method="gptq", bits=4, group_size=32, sym=False,
                                   desc_act=True),
    # GPTQ, desc_act off, symmetric, groups of 128 (GPTQModel's default act_group_aware on)
    "gptq-g128-sym": dict(model=WIDE, seed=4102, method="gptq", bits=4, group_size=128, sym=True, desc_act=False),
    # GPTQ per channel (group_size -1), asymmetric, desc_act off
    "gptq-channel-asym": dict(model=SMALL, seed=4103, method="gptq", bits=4, group_size=-1, sym=False,
                              desc_act=False),
    # 8-bit: symmetric with act-order, groups of 32; asymmetric per channel without
    "gptq8-g32-sym-actorder": dict(model=SMALL, seed=4104, method="gptq", bits=8, group_size=32, sym=True,
                                   desc_act=True),
    "gptq8-channel-asym": dict(model=SMALL, seed=4105, method="gptq", bits=8, group_size=-1, sym=False,
                               desc_act=False),
    # GPTQModel's `dynamic` rules (tried in order, first match decides): a module left dense ("-:" = do not
    # quantize; transformers' modules_to_not_convert has no GPTQModel counterpart), one made 8-bit and the o_projs
    # given groups of 64, asymmetric; the rest 4-bit symmetric groups of 32, desc_act off
    "gptq-g32-dynamic": dict(model=SMALL, seed=4106, method="gptq", bits=4, group_size=32, sym=True,
                             desc_act=False, dynamic={r"-:model\.layers\.1\.mlp\.down_proj": {},
                                                      r"+:model\.layers\..\.mlp\.down_proj": {"bits": 8},
                                                      r"+:.*\.o_proj": {"group_size": 64, "sym": False}}),
    # AWQ GEMM with zero points, groups of 32. Two KV heads: GPTQModel's AWQ clip search takes out_features in
    # multiples of 64 (awq_processor._compute_best_clip asserts it), so k_proj / v_proj get 64 rows.
    "awq-g32-zp": dict(model=dict(SMALL, num_key_value_heads=2), seed=4107, method="awq", bits=4, group_size=32, sym=False),
    # GPTQModel's FORMAT.GPTQ_V2 on save (checkpoint_format "gptq_v2": qzeros hold z itself, not v1's z - 1):
    # asymmetric, where the two differ, at 4 bits with act-order and groups of 32, and at 8 bits per channel
    "gptq-v2-g32-asym-actorder": dict(model=SMALL, seed=4108, method="gptq", format="gptq_v2", bits=4, group_size=32,
                                      sym=False, desc_act=True),
    "gptq8-v2-channel-asym": dict(model=SMALL, seed=4109, method="gptq", format="gptq_v2", bits=8, group_size=-1,
                                  sym=False, desc_act=False),
}


def write_json(path, obj, compact=False):
    text = json.dumps(obj, separators=(",", ":") if compact else None, indent=None if compact else 1,
                      ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


def make_tokenizer(directory):
    """A byte-level BPE wired as Qwen2's (make_fixtures.py's, with 8 merges), written compact, no chat template."""
    saved = base.FAMILIES["qwen2"]["vocab_size"]
    base.FAMILIES["qwen2"]["vocab_size"] = TOKENIZER_VOCAB
    try:
        text = base.train_tokenizer("qwen2")
    finally:
        base.FAMILIES["qwen2"]["vocab_size"] = saved
    config = base.tokenizer_config("qwen2", text)
    del config["chat_template"]
    write_json(directory / "tokenizer.json", json.loads(text), compact=True)
    write_json(directory / "tokenizer_config.json", config, compact=True)


def dense_model(spec, directory):
    """The seeded dense Qwen3 (make_fixtures.py's randomize_weights), saved float16 with its tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from tokenizers import Tokenizer
    make_tokenizer(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    config = Qwen3Config(vocab_size=tok.get_vocab_size(), num_hidden_layers=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=eot,
                         eos_token_id=im_end, pad_token_id=eot, **spec["model"])
    torch.manual_seed(spec["seed"])
    model = Qwen3ForCausalLM(config)
    base.randomize_weights(model, spec["seed"])
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
    model.to(torch.float16).save_pretrained(str(directory))
    return model


def calibration(spec, vocab):
    """Random token sequences (a tiny random model has no data distribution to match): 16 x 48 tokens."""
    import torch
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(0, vocab, (16, 48), generator=g)
    return [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids]


def quantize(name, spec, dense_dir, out_dir):
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    kwargs = dict(bits=spec["bits"], group_size=spec["group_size"], sym=spec["sym"],
                  offload_to_disk=False)  # else meta records a temporary directory's name
    if spec["method"] == "awq":
        kwargs.update(method="awq", format="gemm")
    else:
        kwargs.update(method="gptq", format=spec.get("format", "gptq"), desc_act=spec["desc_act"])
        if spec["desc_act"] or spec["group_size"] == -1:
            # act_group_aware (GPTQModel's default with desc_act off) reorders within groups: desc_act=True turns it
            # off anyway (GPTQModel warns otherwise) and group_size -1 refuses it ("requires group_size > 0")
            kwargs["act_group_aware"] = False
    if spec.get("dynamic"):
        kwargs["dynamic"] = spec["dynamic"]
    qc = QuantizeConfig(**kwargs)
    torch.manual_seed(spec["seed"])
    model = GPTQModel.load(str(dense_dir), qc, dtype=torch.float16)
    vocab = model.model.config.vocab_size
    model.quantize(calibration(spec, vocab), batch_size=1)
    model.save(str(out_dir))
    # GPTQModel's run log (timings) is no part of the checkpoint and differs on every run
    (out_dir / "quant_log.csv").unlink(missing_ok=True)


def dequantized_state(spec, out_dir):
    """The checkpoint loaded back by GPTQModel; every quantized Linear's weight as its own code dequantizes it."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file
    stored = load_file(str(out_dir / "model.safetensors"))
    awq = spec["method"] == "awq"
    loaded = GPTQModel.load(str(out_dir), device="cpu", dtype=torch.float16, backend=BACKEND.AWQ_TORCH if awq else BACKEND.TORCH)
    state, kernels, layouts = {}, {}, {}
    for module_name, module in loaded.model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        with torch.no_grad():
            if awq:
                weight = dequantize_gemm(module.qweight, module.qzeros, module.scales, module.bits,
                                         module.group_size)
            else:
                weight = module.dequantize_weight()
        assert weight.dtype == torch.float16, (module_name, weight.dtype)
        state[module_name + ".weight"] = weight.t().contiguous()  # [K, N] -> nn.Linear's [N, K]
        kernels[module_name] = type(module).__name__
        # what GPTQModel's loader resolved for this module (dynamic rules applied), for the test to hold kvlite to
        layouts[module_name] = {"bits": int(module.bits),
                                "group_size": int(getattr(module, "requested_group_size", module.group_size)),
                                "sym": bool(module.sym), "desc_act": bool(getattr(module, "desc_act", False))}
    for key, tensor in stored.items():  # embeddings, norms and the Linears left dense
        if key.rsplit(".", 1)[-1] not in ("qweight", "qzeros", "scales", "g_idx"):
            state[key] = tensor
    return state, kernels, layouts, loaded


def reference(name, spec, out_dir, dense):
    import numpy as np
    import torch
    import transformers
    import gptqmodel
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    state, kernels, layouts, loaded = dequantized_state(spec, out_dir)
    config_doc = json.loads((out_dir / "config.json").read_text())
    qconfig = config_doc.pop("quantization_config")
    config = Qwen3Config(**{k: v for k, v in config_doc.items() if k not in ("architectures", "transformers_version")})
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()

    # GPTQ: the dequantized weights are GPTQModel's quantization of the dense ones, within a few steps of them.
    # (AWQ first scales each input channel by its activation-aware factor, folding the inverse into the norm or
    # Linear before, so its weights are not the dense ones: the check is GPTQModel's own forward below.)
    worst = 0.0
    dense_state = dense.state_dict()
    for key in state:
        if key.endswith("proj.weight") and key[:-len(".weight")] in kernels:
            step = (state[key].float() - dense_state[key].float()).abs().max().item()
            worst = max(worst, step / dense_state[key].float().abs().max().item())
    assert spec["method"] == "awq" or worst < (0.3 if spec["bits"] == 4 else 0.03), (name, worst)

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    ids = tok.encode(PROMPT, add_special_tokens=True)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids).logits[0].float()
    rows = [0, len(ids) // 2, len(ids) - 1]
    np.save(out_dir / "logits.npy", logits[rows].numpy().astype(np.float32), allow_pickle=False)
    eos_ids = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    with torch.no_grad():
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   max_new_tokens=NEW_TOKENS, eos_token_id=sorted(eos_ids),
                                   pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    new_ids = generated[0, len(ids):].tolist()
    check_ids, margins = base.greedy_without_cache(model, input_ids, NEW_TOKENS, eos_ids)
    assert check_ids == new_ids, (name, new_ids, check_ids)

    # GPTQModel's own forward (its kernel, float16 on the CPU) beside the float32 reference: information only
    with torch.no_grad():
        own = loaded.model(input_ids).logits[0].float()
    own_diff = float((own - logits).abs().max())
    # float16 activations move logits of this size by ~0.03; a dequantization that disagreed with GPTQModel's
    # kernel (a wrong zero point or order) would move them by whole units
    assert own_diff < 0.15, (name, own_diff)

    quantized = sorted(kernels)
    dense_linears = sorted(k[:-len(".weight")] for k in state
                           if k.endswith("proj.weight") and k[:-len(".weight")] not in kernels)
    write_json(out_dir / "reference.json", compact=True, obj={
        "model": name,
        "generator": "tools/make_gptqmodel_fixtures.py",
        "path": ("quantized and saved by GPTQModel (GPTQModel.load(dense, QuantizeConfig).quantize(calibration); "
                 ".save); reference weights dequantized by GPTQModel from the saved checkpoint "
                 f"({'packing_utils.dequantize_gemm' if spec['method'] == 'awq' else 'TorchLinear.dequantize_weight'})"),
        "versions": {"gptqmodel": gptqmodel.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "numpy": np.__version__},
        "quantize_config": {k: v for k, v in spec.items() if k not in ("model", "seed")},
        "quantization_config": qconfig,
        "kernels": sorted(set(kernels.values())),
        "quantized_linears": quantized,
        "layouts": layouts,
        "dense_linears": dense_linears,
        "max_relative_quantization_error": worst,
        "dequantization": "GPTQModel's, in float16 ((q - z) * scale), widened to float32",
        "reference_dtype": "float32",
        "attn_implementation": "eager",
        "gptqmodel_forward_float16_max_abs_diff": own_diff,
        "vocab_size": config.vocab_size,
        "eos_token_ids": sorted(eos_ids),
        "prompt": {"text": PROMPT, "input_ids": ids, "logits_file": "logits.npy", "logits_rows": rows,
                   "greedy": {"max_new_tokens": NEW_TOKENS, "new_ids": new_ids,
                              "stopped_at_eos": bool(new_ids) and new_ids[-1] in eos_ids,
                              "top1_margins": margins}},
        "notes": ["logits.npy: float32 [len(logits_rows), vocab]: row i = the logits after input_ids[0..logits_rows[i]].",
                  "greedy: generate(do_sample=False), cross-checked by an argmax loop without cache."],
    })
    return own_diff, new_ids


def make_case(name):
    spec = CASES[name]
    out_dir = OUT / f"gptqmodel-{name}"
    with tempfile.TemporaryDirectory(prefix="kvlite-gptqmodel-") as tmp:
        os.chdir(tmp)  # GPTQModel writes its run logs to ./logs
        dense_dir = Path(tmp) / "dense"
        dense_dir.mkdir()
        dense = dense_model(spec, dense_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        quantize(name, spec, dense_dir, out_dir)
        # the tokenizer as trained (compact, no chat template) rather than as transformers re-saves it
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(dense_dir / file, out_dir / file)
        own_diff, new_ids = reference(name, spec, out_dir, dense)
    digest = hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest()[:16]
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{name}: {size} bytes, model.safetensors sha256 {digest}, GPTQModel fp16 forward vs reference "
          f"{own_diff:.3g}, greedy {new_ids}", flush=True)


def main():
    base.run_cases(CASES, make_case, OUT)


if __name__ == "__main__":
    main()
