#!/usr/bin/env python3
"""Make kvlite's llm-compressor INT8 fixtures: tiny random Qwen3 models quantized by llm-compressor itself
(`llmcompressor.oneshot` with its own modifiers and preset schemes, on the CPU), saved compressed by it, and the
logits transformers computes from the weights compressed-tensors decompresses from the saved checkpoint.

    tests/fixtures/quant_formats/llmc-<case>/   config.json (quantization_config as llm-compressor writes it),
                                  recipe.yaml (llm-compressor's own record of the recipe), model.safetensors,
                                  tokenizer files, reference.json, logits.npy (W8A8: activations.safetensors)

Nothing here quantizes or packs: the seeded dense model (tools/make_gptqmodel_fixtures.py's, float16) goes through
`oneshot(model, recipe=QuantizationModifier(targets="Linear", scheme=..., ignore=["lm_head"]))` (data-free) or
`GPTQModifier(...)` (w8a8-smoothquant-gptq: after a SmoothQuantModifier, llm-compressor's W8A8 example recipe)
with 16 random calibration sequences, then `model.save_pretrained(dir, save_compressed=True)`
(llm-compressor's wrapped save: it picks the compressed-tensors format itself). The reference loads the saved
checkpoint back with transformers (`AutoModelForCausalLM.from_pretrained(dir, quantization_config=
CompressedTensorsConfig(dequantize=True))`: compressed-tensors' ModelCompressor decompresses every quantized
Linear), takes those weights, widens them to float32 and runs transformers' Qwen3 (eager, float32, CPU). For W8A8
every quantized Linear's input goes through compressed-tensors' own dynamic per-token int8 quantize-dequantize
(compute_dynamic_scales_and_zp + fake_quantize) with the scheme llm-compressor saved, and the script measures
what float32 rounding noise alone does to those logits (`w8a8_rounding_sensitivity`, as make_awq_gptq_fixtures.py
does for ct-w8a8-dynamic): the bound kvlite is held to there.

Environment (a venv of its own: llm-compressor 0.14.0.1 pins torch <= 2.14.0 and transformers <= 5.17.0, both
older than /opt/kvdev's; transformers 5.17.0 has Qwen3):

    python3.11 -m venv /opt/kvllmc
    /opt/kvllmc/bin/pip install --no-deps torch==2.14.0
    /opt/kvllmc/bin/pip install --no-deps nvidia-cufile==1.15.1.6 nvidia-cusparselt-cu13==0.8.1 \\
        nvidia-nvshmem-cu13==3.4.5 nvidia-nccl-cu13==2.30.7   # torch 2.14.0's, missing at `import torch`
    # llm-compressor 0.14.0.1 and everything `pip install --dry-run llmcompressor==0.14.0.1 transformers==5.17.0`
    # resolves, without torch's CUDA wheels (nvidia-*, cuda-toolkit, triton: the machine has the CUDA 13 libraries):
    /opt/kvllmc/bin/pip install --no-deps \\
        Jinja2==3.1.6 MarkupSafe==3.0.4 PyYAML==6.0.4 Pygments==2.21.0 accelerate==1.15.0 \\
        annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 auto-round==0.15.1 \\
        certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 compressed-tensors==0.19.0 \\
        datasets==5.2.0 dill==0.4.1 filelock==4.3.1 fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0 \\
        httpcore==1.0.9 httpx==0.28.1 huggingface_hub==1.33.0 idna==3.20 llmcompressor==0.14.0.1 \\
        loguru==0.7.3 markdown-it-py==4.3.0 mdurl==0.1.2 mpmath==1.3.0 multiprocess==0.70.19 networkx==3.6.1 \\
        numpy==2.4.6 nvidia-ml-py==13.615.71 packaging==26.4 pandas==3.1.1 pillow==13.0.0 psutil==7.2.2 \\
        py-cpuinfo==9.0.0 pyarrow==26.0.1 pydantic==2.14.4 pydantic_core==2.50.5 python-dateutil==4.0.0 \\
        regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 setuptools==84.2.1 \\
        shellingham==1.5.4 sympy==1.14.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.17.0 typer==0.29.2 \\
        typing-inspection==0.4.5 typing_extensions==4.16.0 tzdata==2026.6 urllib3==2.8.0 xxhash==4.1.0
    nice /opt/kvllmc/bin/python tools/make_llmcompressor_fixtures.py [CASE...]

About 15 s a case on 2 cores. Seeded and deterministic on the CPU (the script prints each case's
model.safetensors sha256: rerun to check).
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as base  # noqa: E402  (greedy_without_cache)
import make_gptqmodel_fixtures as gm  # noqa: E402  (the tokenizer, the seeded dense Qwen3, calibration rows)

OUT = base.FIXTURES / "quant_formats"  # beside the other cases, as llmc-<case>
PROMPT = gm.PROMPT
NEW_TOKENS = gm.NEW_TOKENS

CASES = {
    # llm-compressor's W8A8 preset: int8 weights per channel (symmetric), int8 activations per token, dynamic;
    # data-free (QuantizationModifier, min-max weight observer)
    "w8a8": dict(model=gm.SMALL, seed=4201, modifier="QuantizationModifier", scheme="W8A8"),
    # the W8A16 preset: int8 weights in groups of 128 (symmetric); in_features >= 128 needs the wide model
    "w8a16-g128": dict(model=gm.WIDE, seed=4202, modifier="QuantizationModifier", scheme="W8A16"),
    # GPTQ (llm-compressor's GPTQModifier, 16 random calibration sequences) to int8 weights per channel,
    # symmetric, weight-only: config_groups written out, as a recipe for a per-channel W8A16 release is
    "w8a16-channel-gptq": dict(model=gm.SMALL, seed=4203, modifier="GPTQModifier", config_groups={
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                       "strategy": "channel"}}}),
    # llm-compressor's W8A8 example recipe: SmoothQuant (activation scales folded into the norms and Linears
    # before) then GPTQ to the W8A8 preset, on 16 random calibration sequences
    "w8a8-smoothquant-gptq": dict(model=gm.SMALL, seed=4204, modifier="GPTQModifier", scheme="W8A8",
                                  smoothquant=0.8),
    # asymmetric int8 weights (zero points, packed) in groups of 32, weight-only, data-free
    "w8a16-g32-asym": dict(model=gm.SMALL, seed=4205, modifier="QuantizationModifier", config_groups={
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": False,
                                                       "strategy": "group", "group_size": 32}}}),
}


def recipe(spec):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    kwargs = dict(ignore=["lm_head"])
    if "scheme" in spec:
        kwargs.update(targets="Linear", scheme=spec["scheme"])
    else:
        kwargs.update(config_groups=spec["config_groups"])
    cls = GPTQModifier if spec["modifier"] == "GPTQModifier" else QuantizationModifier
    if "smoothquant" in spec:
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
        return [SmoothQuantModifier(smoothing_strength=spec["smoothquant"]), cls(**kwargs)]
    return cls(**kwargs)


def quantize(spec, dense_dir, out_dir):
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float16)
    kwargs = {}
    if spec["modifier"] == "GPTQModifier" or "smoothquant" in spec:
        from datasets import Dataset
        rows = gm.calibration(spec, model.config.vocab_size)
        kwargs.update(dataset=Dataset.from_list(rows), num_calibration_samples=len(rows),
                      max_seq_length=len(rows[0]["input_ids"]))
    oneshot(model=model, recipe=recipe(spec), **kwargs)
    model.save_pretrained(str(out_dir), save_compressed=True)


def reference(name, spec, out_dir):
    import numpy as np
    import torch
    import compressed_tensors
    import llmcompressor
    import transformers
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig, Qwen3Config, Qwen3ForCausalLM

    # the saved checkpoint as transformers loads it, compressed-tensors decompressing every quantized Linear
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float16,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    stored = load_file(str(out_dir / "model.safetensors"))
    schemes, state, layouts = {}, {}, {}
    for module_name, module in loaded.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if not isinstance(module, torch.nn.Linear) or scheme is None:
            continue
        assert module_name + ".weight" not in stored or stored[module_name + ".weight"].dtype == torch.int8, module_name
        schemes[module_name] = scheme
        weight = module.weight.detach()
        assert weight.dtype == torch.float16, (module_name, weight.dtype)
        state[module_name + ".weight"] = weight.clone()
        w = scheme.weights
        layouts[module_name] = {"num_bits": w.num_bits, "strategy": str(getattr(w.strategy, "value", w.strategy)), "group_size": w.group_size,
                                "symmetric": w.symmetric, "actorder": None if w.actorder is None else str(w.actorder),
                                "input_activations": None if scheme.input_activations is None else
                                scheme.input_activations.model_dump(include={"num_bits", "type", "symmetric", "strategy", "dynamic"}, mode="json")}
    for key, tensor in stored.items():  # embeddings, norms
        module_name = key.rsplit(".", 1)[0]
        if module_name not in schemes:
            state[key] = tensor

    config_doc = json.loads((out_dir / "config.json").read_text())
    qconfig = config_doc.pop("quantization_config")
    config = Qwen3Config(**{k: v for k, v in config_doc.items() if k not in ("architectures", "transformers_version")})
    config._attn_implementation = "eager"
    model = Qwen3ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()

    w8a8 = 0
    jitter = {"on": False, "generator": torch.Generator().manual_seed(spec["seed"])}
    for module_name, scheme in schemes.items():
        args = scheme.input_activations
        if args is None:
            continue
        assert args.dynamic is True and args.num_bits == 8, (module_name, args)

        def quantize_input(module, inputs, args=args):
            x = inputs[0]
            if jitter["on"]:  # float32 rounding noise (2^-23 relative), as another summation order would leave
                x = x * (1 + 2.0**-23 * torch.randn(x.shape, generator=jitter["generator"]))
            scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
            return (fake_quantize(x, scale, zero_point, args),)
        model.get_submodule(module_name).register_forward_pre_hook(quantize_input)
        w8a8 += 1

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    ids = tok.encode(PROMPT, add_special_tokens=True)
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids).logits[0].float()
    sensitivity = None
    if w8a8:
        # W8A8's activation rounding is discontinuous: a float32 activation one rounding error away from a
        # half-step boundary lands on the other integer. How far that alone moves the logits (the largest over
        # 8 jittered runs) is the scale against which a float32 reimplementation can be held.
        with torch.no_grad():
            jitter["on"] = True
            sensitivity = max(float((model(input_ids).logits[0] - logits).abs().max()) for _ in range(8))
            jitter["on"] = False
        # compressed-tensors' own quantize-dequantize of activation rows (the scheme llm-compressor saved), for a
        # bit-exact check of kvlite's rounding: random rows, a zero row, a wide dynamic range, all negative, and
        # values on exact quarter steps (ties in x / scale)
        from safetensors.torch import save_file
        x = base.w8a8_probe_rows(spec["seed"] + 1)
        args = next(sch.input_activations for sch in schemes.values() if sch.input_activations is not None)
        scale, zero_point = compute_dynamic_scales_and_zp(value=x.unsqueeze(0), args=args, module=None)
        fq = fake_quantize(x.unsqueeze(0), scale, zero_point, args)[0]
        save_file({"x": x.contiguous(), "fake_quantized": fq.contiguous()}, str(out_dir / "activations.safetensors"),
                  metadata={"format": "pt"})
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

    # transformers' own forward of the loaded checkpoint (float16, compressed-tensors' quantization lifecycle
    # on the decompressed Linears) beside the float32 reference: information only
    with torch.no_grad():
        own = loaded(input_ids).logits[0].float()
    own_diff = float((own - logits).abs().max())
    assert own_diff < 0.5, (name, own_diff)

    dense_linears = sorted(k[:-len(".weight")] for k in state
                           if k.endswith("proj.weight") and k[:-len(".weight")] not in schemes)
    write_json = gm.write_json
    write_json(out_dir / "reference.json", compact=True, obj={
        "model": name,
        "generator": "tools/make_llmcompressor_fixtures.py",
        "path": ("quantized and saved by llm-compressor (oneshot(model, recipe); model.save_pretrained(dir, "
                 "save_compressed=True)); reference weights decompressed by compressed-tensors from the saved "
                 "checkpoint (transformers from_pretrained with CompressedTensorsConfig(dequantize=True))"
                 + ("; W8A8 inputs through compressed-tensors' dynamic per-token quantize-dequantize "
                    "(compute_dynamic_scales_and_zp + fake_quantize)" if w8a8 else "")),
        "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "recipe": {k: v for k, v in spec.items() if k not in ("model", "seed")} | {"ignore": ["lm_head"]},
        "quantization_config": qconfig,
        "quantized_linears": sorted(schemes),
        "layouts": layouts,
        "dense_linears": dense_linears,
        "w8a8_linears": w8a8,
        "w8a8_rounding_sensitivity": sensitivity,
        "dequantization": "compressed-tensors' decompression in float16 ((q - zero_point) * scale), widened to float32",
        "reference_dtype": "float32",
        "attn_implementation": "eager",
        "transformers_forward_float16_max_abs_diff": own_diff,
        "vocab_size": config.vocab_size,
        "eos_token_ids": sorted(eos_ids),
        "prompt": {"text": PROMPT, "input_ids": ids, "logits_file": "logits.npy", "logits_rows": rows,
                   "greedy": {"max_new_tokens": NEW_TOKENS, "new_ids": new_ids,
                              "stopped_at_eos": bool(new_ids) and new_ids[-1] in eos_ids,
                              "top1_margins": margins}},
        "notes": ["logits.npy: float32 [len(logits_rows), vocab]: row i = the logits after input_ids[0..logits_rows[i]].",
                  "greedy: generate(do_sample=False), cross-checked by an argmax loop without cache.",
                  "w8a8_rounding_sensitivity: the largest |logit change| over 8 runs whose W8A8 inputs were "
                  "multiplied by 1 + 2^-23 N(0, 1) before quantization (float32 rounding noise).",
                  "activations.safetensors (W8A8 only): x [6, 320] float32 and compressed-tensors' fake_quantize of "
                  "it with the input_activations scheme llm-compressor saved (int8, per token, dynamic, symmetric)."],
    })
    return own_diff, new_ids, sensitivity


def make_case(name):
    spec = CASES[name]
    out_dir = OUT / f"llmc-{name}"
    with tempfile.TemporaryDirectory(prefix="kvlite-llmc-") as tmp:
        os.chdir(tmp)
        dense_dir = Path(tmp) / "dense"
        dense_dir.mkdir()
        gm.dense_model(spec, dense_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        quantize(spec, dense_dir, out_dir)
        # the tokenizer as trained (compact, no chat template) rather than as transformers re-saves it
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(dense_dir / file, out_dir / file)
        own_diff, new_ids, sensitivity = reference(name, spec, out_dir)
    digest = hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest()[:16]
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"{name}: {size} bytes, model.safetensors sha256 {digest}, transformers fp16 forward vs reference "
          f"{own_diff:.3g}, W8A8 sensitivity {sensitivity}, greedy {new_ids}", flush=True)


def main():
    base.run_cases(CASES, make_case, OUT)


if __name__ == "__main__":
    main()
