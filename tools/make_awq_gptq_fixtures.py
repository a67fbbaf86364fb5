#!/usr/bin/env python3
"""Make kvlite's AWQ and GPTQ fixtures: tiny random Qwen3 models in the formats' on-disk layouts, and the logits
transformers computes from their dequantized weights.

    tests/fixtures/quant_formats/<case>/   config.json (quantization_config awq / gptq), model.safetensors,
                                            tokenizer files, reference.json, logits_0.npy, reference.safetensors

How the checkpoints are made (the path used is recorded in every reference.json as "path"): the reference
quantizers (GPTQModel, AutoAWQ) were not run -- they need a CUDA build or a calibration pass that does not fit
this machine's budget -- so this script quantizes the seeded random weights itself with plain min-max per group
(integers and fp16 scales; the calibration method does not matter to a reader of the format), and PACKS them as
the formats define, following the reference packing code (read, not copied):
  * AWQ GEMM: AutoAWQ's WQLinear_GEMM.from_linear / GPTQModel's pack_awq: qweight I32 [K, N/8], nibble i of word
    (k, c) holds column 8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros I32 [G, N/8] the same;
    scales F16 [G, N].
  * GPTQ: AutoGPTQ's / GPTQModel's QuantLinear.pack: qweight I32 [K/8, N] (row 8i + j of column n at bits 4j of
    word (i, n)); qzeros I32 [G, N/8] (column 8c + j at bits 4j), storing zero - 1 in v1 checkpoints
    (checkpoint_format "gptq") and zero itself in gptq_v2; scales F16 [G, N]; g_idx I32 [K].
The reference dequantization is then computed from the PACKED tensors by code that follows the reference
libraries' own dequantization step for step (cited at each function), not from the integers the packer was given
(they are cross-checked equal), and transformers' Qwen3 runs with those weights widened to float32.

    /opt/kvdev/bin/python tools/make_awq_gptq_fixtures.py

Deterministic: seeded, one thread. Needs tests/fixtures/tokenizers/qwen2 (tools/make_fixtures.py tokenizers).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as base  # noqa: E402
import make_quant_fixtures as qf  # noqa: E402  (dense_model, reference_outputs, write_reference)

OUT = base.FIXTURES / "quant_formats"

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]

# hidden 128, intermediate 256: group 128 divides every in_features; q_proj 128 rows, k/v 64, all multiples of 8.
COMMON = dict(dtype="float16", intermediate_size=256, hidden_size=128)
CASES = {
    "awq-g32-zp-skip": dict(COMMON, seed=3801, method="awq", group_size=32, zero_point=True,
                            modules_to_not_convert=["layers.1.mlp.down_proj"]),
    "awq-g128-zp": dict(COMMON, seed=3802, method="awq", group_size=128, zero_point=True),
    "awq-g64-nozp": dict(COMMON, seed=3803, method="awq", group_size=64, zero_point=False),
    "gptq-g128-sym": dict(COMMON, seed=3804, method="gptq", group_size=128, sym=True, desc_act=False,
                          checkpoint_format="gptq"),
    "gptq-g32-asym-actorder": dict(COMMON, seed=3805, method="gptq", group_size=32, sym=False, desc_act=True,
                                   checkpoint_format="gptq"),
    "gptq-v2-channel-asym": dict(COMMON, seed=3806, method="gptq", group_size=-1, sym=False, desc_act=False,
                                 checkpoint_format="gptq_v2"),
    "gptq-v2-g64-sym-actorder": dict(COMMON, seed=3807, method="gptq", group_size=64, sym=True, desc_act=True,
                                     checkpoint_format="gptq_v2"),
}
# 8-bit. GPTQ by this script's packer (qweight [K/4, N], qzeros [G, N/4], byte j = row / column 4i + j); the
# compressed-tensors INT8 cases by compressed-tensors itself (ModelCompressor, as llm-compressor saves them).
CASES.update({
    "gptq8-g32-asym-actorder": dict(COMMON, seed=3808, method="gptq", bits=8, group_size=32, sym=False,
                                    desc_act=True, checkpoint_format="gptq"),
    "gptq8-v2-channel-sym": dict(COMMON, seed=3809, method="gptq", bits=8, group_size=-1, sym=True, desc_act=False,
                                 checkpoint_format="gptq_v2"),
})
INT8 = dict(num_bits=8, type="int")
INT8_TOKEN = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
CT_CASES = {
    # llm-compressor's W8A16: channel, symmetric; one group asymmetric with groups of 64
    "ct-w8a16": dict(COMMON, kind="compressed-tensors", seed=3810, groups={
        "group_0": ([r"re:.*self_attn\.(q|k|v|o)_proj$"], dict(INT8, symmetric=True, strategy="channel"), None),
        "group_1": ([r"re:.*mlp\.(gate|up|down)_proj$"], dict(INT8, symmetric=False, strategy="group", group_size=64),
                    None)}),
    # llm-compressor's W8A8 (INT8 dynamic per token): channel weights, int8 activations quantized per token
    "ct-w8a8-dynamic": dict(COMMON, kind="compressed-tensors", seed=3811, groups={
        "group_0": (["Linear"], dict(INT8, symmetric=True, strategy="channel"), INT8_TOKEN)}),
    # pack-quantized 8-bit (4 a word), asymmetric groups of 32 with act-order
    "ct-pack8-g32-asym-actorder": dict(COMMON, kind="compressed-tensors", seed=3812, format="pack-quantized", groups={
        "group_0": (["Linear"], dict(INT8, symmetric=False, strategy="group", group_size=32, actorder="group"), None)}),
}
REFERENCE_LINEARS = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                     "model.layers.1.mlp.gate_proj", "model.layers.0.mlp.down_proj"]


# ---------------------------------------------------------------------------------------------------------
# Quantization: min-max per (group, output column), integers u in 0..15 and fp16 scales
# ---------------------------------------------------------------------------------------------------------

def quantize(weight, group_size, symmetric, g_idx, min_zero, bits=4):
    """weight [N, K] -> u [K, N] int64, zero [G, N] int64, scale [G, N] float16; row k of the input is in group
    g_idx[k]. Symmetric: zero 2^(bits-1) and scale = 2 max|w| / maxq (GPTQ's sym)."""
    import torch
    n, k = weight.shape
    groups = k // group_size
    w = weight.float().t()  # [K, N]
    lo = torch.empty(groups, n)
    hi = torch.empty(groups, n)
    for g in range(groups):
        rows = w[g_idx == g]
        lo[g], hi[g] = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
    maxq = 2**bits - 1
    if symmetric:
        scale = (torch.maximum(lo.abs(), hi) * 2 / maxq).clamp(min=1e-5).half()
        zero = torch.full((groups, n), 2**(bits - 1), dtype=torch.int64)
    else:
        scale = ((hi - lo) / maxq).clamp(min=1e-5).half()
        zero = torch.round(-lo / scale.float()).clamp(min_zero, maxq).to(torch.int64)
    per_row = g_idx.long()
    u = torch.round(w / scale.float()[per_row]) + zero[per_row]
    return u.clamp(0, maxq).to(torch.int64), zero, scale


def pack_awq(u, zero, scale):
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [G, N/8], nibble i of a word = column 8c + AWQ_ORDER[i]."""
    import torch

    def pack(values):  # [R, N] -> [R, N/8]
        rows, cols = values.shape
        words = torch.zeros(rows, cols // 8, dtype=torch.int64)
        for c in range(cols // 8):
            for i in range(8):
                words[:, c] |= values[:, 8 * c + AWQ_ORDER[i]] << (4 * i)
        return to_i32(words)
    return {"qweight": pack(u), "qzeros": pack(zero), "scales": scale.contiguous()}


def pack_gptq(u, zero, scale, g_idx, v1, bits=4):
    """GPTQ QuantLinear.pack: qweight [K/(32/bits), N] along K, qzeros [G, N/(32/bits)] along N (v1: zero - 1)."""
    import torch
    k, n = u.shape
    per = 32 // bits
    qweight = torch.zeros(k // per, n, dtype=torch.int64)
    for j in range(per):
        qweight |= u[j::per, :] << (bits * j)
    stored = zero - 1 if v1 else zero
    assert int(stored.min()) >= 0, "GPTQ v1 cannot store a zero point of 0"
    qzeros = torch.zeros(zero.shape[0], n // per, dtype=torch.int64)
    for j in range(per):
        qzeros |= stored[:, j::per] << (bits * j)
    return {"qweight": to_i32(qweight), "qzeros": to_i32(qzeros), "scales": scale.contiguous(),
            "g_idx": g_idx.to(torch.int32).contiguous()}


def to_i32(words):
    """int64 words holding 32-bit patterns -> int32 with the same bits (two's complement)."""
    import torch
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


# ---------------------------------------------------------------------------------------------------------
# Reference dequantization, from the packed tensors
# ---------------------------------------------------------------------------------------------------------

def dequantize_awq(t, group_size):
    """vLLM's awq_dequantize / AutoAWQ's dequantize_gemm (GPTQModel's utils/awq unpack_awq + reverse_awq_order):
    shift each word right by 0, 4, ..., 28, undo the interleave with AWQ_REVERSE_ORDER, mask to 4 bits, then
    (iweight - izeros) * scales with zeros and scales repeated over the group's rows: fp16 result [K, N].
    No qzeros (zero_point false): zero 8 (AutoAWQ's symmetric range q in [-8, 7] stored as q + 8)."""
    import torch
    shifts = torch.arange(0, 32, 4)

    def unpack(words):
        values = torch.bitwise_right_shift(words[:, :, None], shifts[None, None, :]).to(torch.int8)
        values = values.view(values.shape[0], -1)
        order = torch.arange(values.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
        return torch.bitwise_and(values[:, order], 0xF)
    iweight = unpack(t["qweight"])
    if "qzeros" in t:
        izeros = unpack(t["qzeros"])
    else:
        izeros = torch.full((t["scales"].shape[0], iweight.shape[1]), 8, dtype=torch.int8)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    scales = t["scales"].repeat_interleave(group_size, dim=0)
    return (iweight - izeros) * scales


def dequantize_gptq(t, v1, bits=4):
    """GPTQModel's TorchQuantLinear.dequantize_weight (AutoGPTQ's qlinear_cuda_old the same): zeros unpacked along N
    (+1 in v1), weights unpacked along K, each masked to 4 bits, then scales[g_idx] * (weight - zeros[g_idx]) in
    fp16: result [K, N]."""
    import torch
    per, mask = 32 // bits, 2**bits - 1
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    qzeros, qweight, scales, g_idx = t["qzeros"], t["qweight"], t["scales"], t["g_idx"].long()
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, per), wf.unsqueeze(0)).to(torch.int16)
    zeros = torch.bitwise_and(zeros, mask).reshape(qzeros.shape[0], -1)
    if v1:
        zeros = zeros + 1
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, per, -1), wf.unsqueeze(-1)).to(torch.int16)
    weight = torch.bitwise_and(weight, mask).reshape(-1, qweight.shape[1])
    return scales[g_idx] * (weight - zeros[g_idx])


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------

def quantization_config(spec):
    if spec["method"] == "awq":
        config = {"quant_method": "awq", "bits": 4, "group_size": spec["group_size"],
                  "zero_point": spec["zero_point"], "version": "gemm"}
        if "modules_to_not_convert" in spec:
            config["modules_to_not_convert"] = spec["modules_to_not_convert"]
        return config
    return {"quant_method": "gptq", "bits": spec.get("bits", 4), "group_size": spec["group_size"], "desc_act": spec["desc_act"],
            "sym": spec["sym"], "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
            "checkpoint_format": spec["checkpoint_format"]}


def make_case(name):
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, Qwen3ForCausalLM
    spec = CASES[name]
    qf.MODELS[name] = spec  # qf.dense_model reads its seed, dtype and sizes there
    directory = OUT / name
    model = qf.dense_model(name)
    qf.fresh_dir(directory)
    model.save_pretrained(str(directory))
    stored = load_file(str(directory / "model.safetensors"))
    awq = spec["method"] == "awq"
    skip = spec.get("modules_to_not_convert", [])
    out, dense, quantized = {}, {}, []
    for index, (module_name, module) in enumerate(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or module_name == "lm_head":
            continue
        if any(key in module_name for key in skip):
            continue
        weight = stored[module_name + ".weight"]
        n, k = weight.shape
        group = k if spec["group_size"] == -1 else spec["group_size"]
        if spec.get("desc_act"):
            # GPTQ orders a Linear's input rows by its input's Hessian diagonal: q, k and v read one input (as do
            # gate and up), so they share one order, which lets the GPU uploader fuse them.
            shared_input = module_name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            g_idx = qf.actorder_g_idx(k, group, spec["seed"] * 100 + sum(map(ord, shared_input)))
        else:
            g_idx = (torch.arange(k) // group).to(torch.int32)
        symmetric = (not spec["zero_point"]) if awq else spec["sym"]
        v1 = not awq and spec["checkpoint_format"] == "gptq"
        bits = spec.get("bits", 4)
        u, zero, scale = quantize(weight, group, symmetric, g_idx, min_zero=1 if v1 else 0, bits=bits)
        if awq:
            tensors = pack_awq(u, zero, scale)
            if symmetric:
                del tensors["qzeros"]
            w = dequantize_awq(tensors, group)
        else:
            tensors = pack_gptq(u, zero, scale, g_idx, v1, bits)
            w = dequantize_gptq(tensors, v1, bits)
        # The reference dequantization read back exactly what the packer was given.
        expected = (u - zero[g_idx.long()]).to(torch.float16) * scale[g_idx.long()]
        assert w.dtype == torch.float16 and torch.equal(w, expected), module_name
        del stored[module_name + ".weight"]
        for key, value in tensors.items():
            out[f"{module_name}.{key}"] = value
        dense[module_name + ".weight"] = w.t().contiguous()
        quantized.append(module_name)
    out.update(stored)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config(spec)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    reference_model = Qwen3ForCausalLM(AutoConfig.from_pretrained(str(directory))).to(torch.float32)
    state = {key: value.float() for key, value in stored.items()}
    state.update({key: value.float() for key, value in dense.items()})
    missing, unexpected = reference_model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    reference_model.tie_weights()
    reference_model.generation_config = model.generation_config
    reference_model.config._attn_implementation = "eager"
    reference_model.eval()
    reference = {k + ".weight": dense[k + ".weight"] for k in REFERENCE_LINEARS if k in quantized}
    save_file(reference, str(directory / "reference.safetensors"), metadata={"format": "pt"})
    quantization = {
        "quantization": spec["method"],
        "quantization_config": quantization_config(spec),
        "path": "packed by this script (the reference quantizers GPTQModel / AutoAWQ were not run here): seeded "
                "random weights, min-max int4 per group, packed per the formats' definitions; the reference "
                "dequantization is computed from the packed tensors following "
                + ("vLLM's awq_dequantize / AutoAWQ's dequantize_gemm" if awq
                   else "GPTQModel's TorchQuantLinear.dequantize_weight (v1: zeros + 1)"),
        "dequantization": "(u - z) * scale in float16 (one rounding), then widened to float32",
        "quantized_linears": len(quantized),
        "numpy_version": np.__version__,
        "reference_linears": {k[:-len(".weight")]: {"dtype": "float16"} for k in reference},
    }
    qf.QUANT = OUT  # reference_outputs / write_reference write under QUANT / name
    outputs = qf.reference_outputs(name, reference_model, quantization)
    outputs["generator"] = "tools/make_awq_gptq_fixtures.py"
    qf.write_reference(name, outputs)
    print(f"wrote {directory.relative_to(base.REPO_ROOT)} ({len(quantized)} quantized Linears, "
          f"transformers {transformers.__version__})")


def make_ct_case(name):
    """compressed-tensors INT8 quantized and compressed by compressed-tensors itself (tools/make_quant_fixtures.py's
    path: min-max calibration, ModelCompressor); the reference runs transformers' Qwen3 in float32 with the
    compressors' own decompression of every Linear and, for W8A8, compressed-tensors' own dynamic per-token
    activation quantize-dequantize (compute_dynamic_scales_and_zp + fake_quantize) on each quantized Linear's input."""
    import compressed_tensors
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3ForCausalLM
    spec = CT_CASES[name]
    qf.MODELS[name] = spec
    qf.QUANT = OUT
    directory = OUT / name
    if "format" in spec:  # pack-quantized rather than the int-quantized default for 8-bit ints
        import compressed_tensors.compressors.model_compressors.model_compressor as mc
        original = mc.ModelCompressor.from_pretrained_model.__func__

        def forced(cls, model, **kwargs):
            kwargs["quantization_format"] = spec["format"]
            return original(cls, model, **kwargs)
        mc.ModelCompressor.from_pretrained_model = classmethod(forced)
        try:
            schemes = qf.save_compressed_tensors_model(name, directory)
        finally:
            mc.ModelCompressor.from_pretrained_model = classmethod(original)
    else:
        schemes = qf.save_compressed_tensors_model(name, directory)
    dense = qf.compressed_tensors_dequantized(directory, schemes)
    config = AutoConfig.from_pretrained(str(directory))
    del config.quantization_config
    model = Qwen3ForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in dense.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.generation_config = qf.dense_model(name).generation_config
    model.config._attn_implementation = "eager"
    model.eval()
    w8a8 = 0
    jitter = {"on": False, "generator": torch.Generator().manual_seed(spec["seed"])}
    for module_name, scheme in schemes.items():
        args = scheme.input_activations
        if args is None:
            continue

        def quantize_input(module, inputs, args=args):
            x = inputs[0]
            if jitter["on"]:  # float32 rounding noise (2^-23 relative), as another summation order would leave
                x = x * (1 + 2.0**-23 * torch.randn(x.shape, generator=jitter["generator"]))
            scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
            return (fake_quantize(x, scale, zero_point, args),)
        model.get_submodule(module_name).register_forward_pre_hook(quantize_input)
        w8a8 += 1
    sensitivity = None
    if w8a8:
        # W8A8's activation rounding is discontinuous: a float32 activation one rounding error away from a
        # half-step boundary lands on the other integer. Measure how far that alone moves the logits (the largest
        # over a few jittered runs), the scale against which a float32 reimplementation can be held.
        import numpy as np
        from transformers import AutoTokenizer
        ids = torch.tensor([AutoTokenizer.from_pretrained(str(directory)).encode(qf.PROMPTS[0][1], add_special_tokens=True)])
        with torch.no_grad():
            exact = model(ids).logits[0]
            jitter["on"] = True
            sensitivity = max(float((model(ids).logits[0] - exact).abs().max()) for _ in range(8))
            jitter["on"] = False
        # compressed-tensors' own quantize-dequantize of activation rows, for a bit-exact check of kvlite's
        rows = base.w8a8_probe_rows(spec["seed"] + 1)
        args = next(sch.input_activations for sch in schemes.values() if sch.input_activations is not None)
        scale, zero_point = compute_dynamic_scales_and_zp(value=rows.unsqueeze(0), args=args, module=None)
        fq = fake_quantize(rows.unsqueeze(0), scale, zero_point, args)[0]
        save_file({"x": rows.contiguous(), "fake_quantized": fq.contiguous()}, str(directory / "activations.safetensors"),
                  metadata={"format": "pt"})
    reference = {k + ".weight": dense[k + ".weight"].contiguous() for k in REFERENCE_LINEARS}
    save_file(reference, str(directory / "reference.safetensors"), metadata={"format": "pt"})
    quantization = {
        "quantization": "compressed-tensors",
        "compressed_tensors_version": compressed_tensors.__version__,
        "path": "quantized and compressed by compressed-tensors' ModelCompressor (the reference library; "
                "llm-compressor itself was not installed), min-max calibration",
        "dequantization": "compressed-tensors' compressor decompress per Linear: (q - zero_point) * scale in the "
                          "scale's dtype, then widened to float32"
                          + ("; inputs of the quantized Linears through compressed-tensors' dynamic per-token int8 "
                             "quantize-dequantize (compute_dynamic_scales_and_zp + fake_quantize)" if w8a8 else ""),
        "w8a8_linears": w8a8,
        "w8a8_rounding_sensitivity": sensitivity,
        "w8a8_notes": None if not w8a8 else (
            "w8a8_rounding_sensitivity: the largest |logit change| over 8 runs whose W8A8 inputs were multiplied by "
            "1 + 2^-23 N(0, 1) before quantization (float32 rounding noise). activations.safetensors: x [6, 320] "
            "float32 and compressed-tensors' fake_quantize of it (int8, per token, dynamic, symmetric)."),
        "quantized_linears": len(schemes),
        "reference_linears": {k: {"format": schemes[k].format, "weights": schemes[k].weights.model_dump(
            include={"num_bits", "type", "symmetric", "strategy", "group_size", "actorder"}),
            "dtype": str(dense[k + ".weight"].dtype).replace("torch.", "")} for k in REFERENCE_LINEARS},
    }
    outputs = qf.reference_outputs(name, model, quantization)
    outputs["generator"] = "tools/make_awq_gptq_fixtures.py"
    qf.write_reference(name, outputs)
    print(f"wrote {directory.relative_to(base.REPO_ROOT)} ({len(schemes)} quantized Linears, {w8a8} W8A8)")


def make_fuzz_seeds():
    """Seeds of tests/fuzz/fuzz_quant_formats.cpp: 8 descriptor bytes (packing index, int8 flag, N - 1, K - 1,
    group - 1 (0: channel), flags, 2 reserved), then a small safetensors file of one Linear "m" in that layout."""
    import torch
    from safetensors.torch import save
    directory = base.REPO_ROOT / "tests" / "fuzz" / "corpus" / "quant_formats"
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(3899)
    n, k, group = 16, 64, 32
    weight = torch.randn(n, k, generator=gen).half()
    column_order = (torch.arange(k) // group).to(torch.int32)
    act_order = qf.actorder_g_idx(k, group, 3899)
    seeds = {}
    u, zero, scale = quantize(weight, group, False, column_order, 0)
    seeds["awq_g32_asym"] = ((0, 0, n - 1, k - 1, group - 1, 0), pack_awq(u, zero, scale))
    u, zero, scale = quantize(weight, group, False, act_order, 1)
    seeds["gptq_g32_actorder"] = ((1, 0, n - 1, k - 1, group - 1, 2), pack_gptq(u, zero, scale, act_order, True))
    u, zero, scale = quantize(weight, group, True, column_order, 0, bits=8)
    seeds["gptq8_v2_g32_sym"] = ((2, 1, n - 1, k - 1, group - 1, 1), pack_gptq(u, zero, scale, column_order, False, 8))
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    seeds["ct_int8_channel"] = ((4, 1, n - 1, k - 1, 0, 5), {
        "weight": q, "weight_scale": torch.rand(n, 1, generator=gen).half(),
        "weight_zero_point": torch.randint(-3, 3, (n, 1), generator=gen, dtype=torch.int8)})
    for name, (header, tensors) in seeds.items():
        body = save({f"m.{key}": value.contiguous() for key, value in tensors.items()})
        (directory / name).write_bytes(bytes(list(header) + [0, 0]) + body)
    print(f"wrote {len(seeds)} seeds to {directory.relative_to(base.REPO_ROOT)}")


def main():
    import torch
    import transformers
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    OUT.mkdir(parents=True, exist_ok=True)
    from loguru import logger
    logger.remove()
    if not sys.argv[1:]:
        make_fuzz_seeds()
    for name in (sys.argv[1:] or list(CASES) + list(CT_CASES)):
        if name in CT_CASES:
            make_ct_case(name)
        else:
            make_case(name)


if __name__ == "__main__":
    sys.exit(main())
