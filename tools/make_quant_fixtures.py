#!/usr/bin/env python3
"""Make kvlite's quantized-checkpoint fixtures with compressed-tensors and transformers.

kvlite reads three families of quantized Linear weights; this script writes small checkpoints in each, using
the reference libraries' own quantize / pack / dequantize code, and records what those libraries compute from
them, so that kvlite's C++ tests compare against the reference rather than against us:

    tests/fixtures/quant/
      tiny-w4a16/     compressed-tensors "pack-quantized" int4 (4 config groups: symmetric group 64,
                      asymmetric group 32, channel symmetric / asymmetric, actorder "group" with weight_g_idx)
      tiny-fp8/       compressed-tensors "float-quantized" fp8 e4m3 (channel, tensor, block 128x128 with
                      partial blocks)
      tiny-fp8-qwen/  Qwen's fine-grained fp8 (quant_method "fp8", weight_scale_inv, block 128x128),
                      quantized by transformers' own Fp8Quantize
      odd-linears/    single Linears with awkward shapes (partial packed words, partial zero-point words,
                      partial blocks, small blocks, every scale dtype) and their reference dequantization
      activations/    compressed-tensors' dynamic fp8 activation quantization (per token, per 128 channels)

Each model directory is an ordinary Hugging Face checkpoint (config.json with quantization_config,
model.safetensors, tokenizer files) plus reference.json, logits_<k>.npy (float32 logits of the dequantized
model) and reference.safetensors (dequantized weights of a few Linears, in the dtype the reference produces).
The layout and every rounding rule are described in tests/fixtures/quant/README.md.

    /opt/kvdev/bin/python tools/make_quant_fixtures.py

Deterministic: seeded, one thread; rerunning with the same package versions gives identical files.
Needs tests/fixtures/tokenizers/qwen2 (tools/make_fixtures.py tokenizers).
"""

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # compressed-tensors' progress bars

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as base  # noqa: E402  (shares the seeded init, prompts and greedy cross-check)

QUANT = base.FIXTURES / "quant"
TOKENIZER_DIR = base.FIXTURES / "tokenizers" / "qwen2"

# Qwen3 shapes with K and N multiples of 128 where the fp8 block formats want them. intermediate_size 320 gives
# gate/up 320 rows (2.5 blocks of 128: a partial block row) and down_proj 320 columns (a partial block column).
BASE_CONFIG = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

ATTN_QKV = r"re:.*self_attn\.(q|k|v)_proj$"
ATTN_O = r"re:.*self_attn\.o_proj$"
MLP_GATE_UP = r"re:.*mlp\.(gate|up)_proj$"

# compressed-tensors config groups: (targets, weight args, input activation args or None).
INT4 = dict(num_bits=4, type="int")
FP8 = dict(num_bits=8, type="float", symmetric=True)
MODELS = {
    "tiny-w4a16": {
        # hidden 64 (the int4 formats need no 128-multiples): q/k/v, gate/up read 64 columns
        "kind": "compressed-tensors", "dtype": "float16", "seed": 2001, "intermediate_size": 320, "hidden_size": 64,
        "groups": {
            "group_0": ([ATTN_QKV], dict(INT4, symmetric=True, strategy="group", group_size=32), None),
            "group_1": ([MLP_GATE_UP], dict(INT4, symmetric=False, strategy="group", group_size=16), None),
            "group_2": ([r"re:.*layers\.0\.mlp\.down_proj$"], dict(INT4, symmetric=True, strategy="channel"), None),
            "group_3": ([r"re:.*layers\.1\.mlp\.down_proj$"], dict(INT4, symmetric=False, strategy="channel"), None),
            "group_4": ([ATTN_O], dict(INT4, symmetric=True, strategy="group", group_size=32, actorder="group"),
                        None),
        },
        "reference_linears": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
                              "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj"],
    },
    "tiny-fp8": {
        "kind": "compressed-tensors", "dtype": "bfloat16", "seed": 2002, "intermediate_size": 320,
        "groups": {
            # FP8_DYNAMIC: channel weights, dynamic per-token activations
            "group_0": ([ATTN_QKV], dict(FP8, strategy="channel"),
                        dict(FP8, strategy="token", dynamic=True)),
            # per-tensor weights, dynamic per-token activations
            "group_1": ([ATTN_O], dict(FP8, strategy="tensor"), dict(FP8, strategy="token", dynamic=True)),
            # FP8_BLOCK: 128x128 weight blocks, dynamic 1x128 activation groups
            "group_2": ([MLP_GATE_UP, r"re:.*mlp\.down_proj$"],
                        dict(FP8, strategy="block", block_structure=[128, 128]),
                        dict(FP8, strategy="group", group_size=128, dynamic=True)),
        },
        "reference_linears": ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.o_proj",
                              "model.layers.1.mlp.down_proj"],
    },
    "tiny-fp8-qwen": {
        # head_dim 64: k_proj and v_proj get 2 x 64 = 128 rows (transformers quantizes only whole blocks)
        "kind": "qwen-fp8", "dtype": "bfloat16", "seed": 2003, "intermediate_size": 256, "head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]},
        "reference_linears": ["model.layers.1.self_attn.k_proj"],
    },
}

PROMPTS = base.PLAIN_PROMPTS[:1]  # plain_short (12 tokens), encoded with add_special_tokens=True


# ---------------------------------------------------------------------------------------------------------
# compressed-tensors: min-max weight calibration (what llm-compressor's default observer computes), then the
# library's own quantize + pack (ModelCompressor) and dequantize (the compressors' decompress)
# ---------------------------------------------------------------------------------------------------------

def actorder_g_idx(columns, group_size, seed):
    """A GPTQ-style activation order: column perm[i] is the i-th most important and lands in group i // G."""
    import torch
    perm = torch.randperm(columns, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(columns, dtype=torch.int32)
    g_idx[perm] = (torch.arange(columns) // group_size).to(torch.int32)
    return g_idx


def weight_min_max(weight, args, g_idx=None):
    """Per scale element minimum and maximum of the weight, laid out as the scale is."""
    import torch
    rows, cols = weight.shape
    if args.strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy == "group":
        if g_idx is not None:  # group j holds the columns with g_idx == j (compressed-tensors sorts by g_idx)
            weight = weight[:, torch.argsort(g_idx, stable=True)]
        grouped = weight.reshape(rows, cols // args.group_size, args.group_size)
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == "block":
        bn, bk = args.block_structure
        nb, kb = -(-rows // bn), -(-cols // bk)
        lo = torch.empty(nb, kb, dtype=weight.dtype)
        hi = torch.empty(nb, kb, dtype=weight.dtype)
        for i in range(nb):
            for j in range(kb):
                block = weight[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                lo[i, j], hi[i, j] = block.amin(), block.amax()
        return lo, hi
    raise ValueError(args.strategy)


def calibrated_state(weight, args, seed):
    """weight, weight_scale, weight_zero_point (and weight_g_idx) for one Linear, from its own min/max."""
    from compressed_tensors.quantization.utils import calculate_qparams
    g_idx = actorder_g_idx(weight.shape[1], args.group_size, seed) if args.actorder == "group" else None
    lo, hi = weight_min_max(weight, args, g_idx)
    scale, zero_point = calculate_qparams(lo, hi, args)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    if g_idx is not None:
        state["weight_g_idx"] = g_idx
    return state


def make_scheme(targets, weights, activations):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return QuantizationScheme(targets=targets, weights=QuantizationArgs(**weights),
                              input_activations=QuantizationArgs(**activations) if activations else None)


def ct_decompress(state, scheme):
    """The reference dequantization: compressed-tensors' unpack and dequantize on the tensors as stored.

    This is the compressors' decompress with the scheme's QuantizationArgs passed to dequantize, as
    compressed-tensors 0.20 does: 0.18's decompress lets dequantize infer the strategy from the scale's shape,
    which takes a [3, 1] block scale (320 x 128 weight, 128 x 128 blocks) for a channel scale. For packed int4
    the result is checked equal to 0.18's decompress itself.
    """
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    args = scheme.weights
    scale = state["weight_scale"]
    zero_point = state.get("weight_zero_point")
    if "weight_packed" in state:
        shape = state["weight_shape"]
        if zero_point is not None:
            zero_point = unpack_from_int32(zero_point, args.num_bits, (int(shape[0]), scale.shape[-1]), packed_dim=0)
        quantized = unpack_from_int32(state["weight_packed"], args.num_bits, shape)
    else:
        quantized = state["weight"]
    weight = dequantize(x_q=quantized, scale=scale, zero_point=zero_point, args=args,
                        g_idx=state.get("weight_g_idx"))
    assert weight.dtype == scale.dtype
    if "weight_packed" in state:
        import torch
        assert torch.equal(weight, BaseCompressor.get_value_from_registry(scheme.format).decompress(
            dict(state), scheme)["weight"])
    return weight


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------

def dense_model(name):
    """The tiny Qwen3 before quantization, with make_fixtures.py's seeded init, in its on-disk dtype."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    spec = MODELS[name]
    cases = json.loads((TOKENIZER_DIR / "cases.json").read_text(encoding="utf-8"))
    token_ids = {t["content"]: t["id"] for t in cases["added_tokens"]}
    config = Qwen3Config(vocab_size=cases["vocab_size"], bos_token_id=token_ids["<|endoftext|>"],
                         eos_token_id=token_ids["<|im_end|>"], pad_token_id=token_ids["<|endoftext|>"],
                         **dict(BASE_CONFIG, intermediate_size=spec["intermediate_size"],
                                hidden_size=spec.get("hidden_size", BASE_CONFIG["hidden_size"]),
                                head_dim=spec.get("head_dim", BASE_CONFIG["head_dim"])))
    torch.manual_seed(spec["seed"])
    model = Qwen3ForCausalLM(config)
    base.randomize_weights(model, spec["seed"])
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=[token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
        pad_token_id=config.pad_token_id)
    return model.to(getattr(torch, spec["dtype"])).eval()


def fresh_dir(directory):
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / file, directory / file)


def save_compressed_tensors_model(name, directory):
    """Quantize with compressed-tensors the way llm-compressor saves: apply the config, calibrate, compress.

    Returns {module name: scheme} for the quantized Linears.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    spec = MODELS[name]
    model = dense_model(name)
    groups = {key: make_scheme(*group) for key, group in spec["groups"].items()}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"],
                                                        quantization_status="calibration"), show_progress=False)
    schemes = {}
    for index, (module_name, module) in enumerate(model.named_modules()):
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        state = calibrated_state(module.weight.data, scheme.weights, seed=spec["seed"] * 100 + index)
        for key in ("weight_scale", "weight_zero_point", "weight_g_idx"):
            if key in state and hasattr(module, key):
                getattr(module, key).data.copy_(state[key])
        schemes[module_name] = scheme
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    fresh_dir(directory)
    model.save_pretrained(str(directory))
    compressor.update_config(str(directory))
    # The compressors' decompress takes the scheme with the format it was compressed with.
    for scheme in schemes.values():
        assert scheme.format is not None
    return schemes


def compressed_tensors_dequantized(directory, schemes):
    """Every tensor of the checkpoint with each quantized Linear replaced by compressed-tensors' dequantization.

    Dequantized weights keep the dtype compressed-tensors gives them: the scale's (products rounded to it).
    """
    from safetensors.torch import load_file
    stored = load_file(str(directory / "model.safetensors"))
    dense = {}
    owned = set()
    for module_name, scheme in schemes.items():
        prefix = module_name + "."
        state = {key[len(prefix):]: value for key, value in stored.items() if key.startswith(prefix)}
        owned.update(prefix + key for key in state)
        bias = state.pop("bias", None)
        dense[prefix + "weight"] = ct_decompress(state, scheme)
        if bias is not None:
            dense[prefix + "bias"] = bias
    for key, value in stored.items():
        if key not in owned:
            dense[key] = value
    return dense


def fp8_quantized_state(stored, linear_names, weight_block_size, modules_to_not_convert):
    """Qwen's fine-grained fp8 of a state dict: each `<name>.weight` with name in linear_names through
    transformers' own quantizer op (Fp8Quantize: e4m3 weight + weight_scale_inv per block), every other tensor
    as it is. Returns (state dict, the quantized names in the state dict's order)."""
    import torch
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    class QuantizerSettings:  # what Fp8Quantize reads from its quantizer
        quantization_config = FineGrainedFP8Config(weight_block_size=weight_block_size,
                                                   modules_to_not_convert=modules_to_not_convert)

    quantize = Fp8Quantize(QuantizerSettings())
    out = {}
    quantized = []
    for key, value in stored.items():
        module_name = key[:-len(".weight")] if key.endswith(".weight") else None
        if module_name in linear_names:
            result = quantize.convert({key: value})
            assert result[key].dtype == torch.float8_e4m3fn, key
            out.update(result)
            quantized.append(module_name)
        else:
            out[key] = value
    return out, quantized


def save_qwen_fp8_model(name, directory):
    """Qwen's fine-grained fp8, written by transformers' own quantizer op (Fp8Quantize) tensor by tensor.

    Returns the names of the quantized Linears.
    """
    import torch
    from safetensors.torch import load_file, save_file
    spec = MODELS[name]
    qconfig = spec["quantization_config"]
    model = dense_model(name)
    fresh_dir(directory)
    model.save_pretrained(str(directory))
    linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                    and not any(skip in n for skip in qconfig["modules_to_not_convert"])}
    out, quantized = fp8_quantized_state(load_file(str(directory / "model.safetensors")), linear_names,
                                         qconfig["weight_block_size"], qconfig["modules_to_not_convert"])
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = qconfig
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return quantized


def fp8_block_dequantized(weight, scale_inv):
    """transformers' Fp8Dequantize: fp8 and scale widened to float32, multiplied per block in float32."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    import torch
    return Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=torch.float32)


def reference_outputs(name, model, quantization):
    """Logits and greedy continuations of `model` (float32, eager attention, CPU) for the plain prompts."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoTokenizer
    directory = QUANT / name
    tok = AutoTokenizer.from_pretrained(str(directory))
    eos_ids = set(model.generation_config.eos_token_id)
    prompts = []
    for k, (prompt_name, text) in enumerate(PROMPTS):
        ids = tok.encode(text, add_special_tokens=True)
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids).logits[0].float()
        np.save(directory / f"logits_{k}.npy", logits.numpy().astype(np.float32), allow_pickle=False)
        with torch.no_grad():
            generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=base.GREEDY_NEW_TOKENS)
        new_ids = generated[0, len(ids):].tolist()
        check_ids, margins = base.greedy_without_cache(model, input_ids, base.GREEDY_NEW_TOKENS, eos_ids)
        assert check_ids == new_ids, (name, prompt_name, new_ids, check_ids)
        prompts.append({
            "name": prompt_name, "kind": "text", "text": text, "how": "tokenizer.encode(text, add_special_tokens=True)",
            "input_ids": ids, "logits_file": f"logits_{k}.npy", "logits_shape": list(logits.shape),
            "greedy": {"max_new_tokens": base.GREEDY_NEW_TOKENS, "new_ids": new_ids,
                       "stopped_at_eos": bool(new_ids) and new_ids[-1] in eos_ids,
                       "text": tok.decode(new_ids, skip_special_tokens=False), "top1_margins": margins},
        })
    return {
        "model": name,
        "generator": "tools/make_quant_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        **quantization,
        "reference_dtype": "float32",
        "attn_implementation": "eager",
        "vocab_size": model.config.vocab_size,
        "eos_token_ids": sorted(eos_ids),
        "prompts": prompts,
    }


def make_compressed_tensors_model(name):
    import compressed_tensors
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, Qwen3ForCausalLM
    directory = QUANT / name
    schemes = save_compressed_tensors_model(name, directory)
    dense = compressed_tensors_dequantized(directory, schemes)
    # transformers' Qwen3 with the dequantized weights widened to float32. (transformers' own loader cannot
    # be the reference here: with dequantize=True it decompresses every module with the first config group's
    # scheme, and its compressed route widens the scales to the model dtype before multiplying.)
    config = AutoConfig.from_pretrained(str(directory))
    del config.quantization_config
    model = Qwen3ForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in dense.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.generation_config = dense_model(name).generation_config
    model.config._attn_implementation = "eager"
    model.eval()
    reference = {k + ".weight": dense[k + ".weight"].contiguous() for k in MODELS[name]["reference_linears"]}
    save_file(reference, str(directory / "reference.safetensors"), metadata={"format": "pt"})
    quantization = {
        "quantization": "compressed-tensors",
        "compressed_tensors_version": compressed_tensors.__version__,
        "dequantization": "compressed-tensors' compressor decompress per Linear, with that Linear's own "
                          "config group: (q - zero_point) * scale in the scale's dtype (products rounded to it), "
                          "then widened to float32",
        "reference_linears": {k: {"format": schemes[k].format, "weights": schemes[k].weights.model_dump(
            include={"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "actorder"}),
            "dtype": str(dense[k + ".weight"].dtype).replace("torch.", "")}
            for k in MODELS[name]["reference_linears"]},
    }
    write_reference(name, reference_outputs(name, model, quantization))


def make_qwen_fp8_model(name):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    directory = QUANT / name
    quantized = save_qwen_fp8_model(name, directory)
    # transformers' own loader: without a GPU it dequantizes every FP8Linear at load (Fp8Dequantize).
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, attn_implementation="eager")
    # With the fp8 quantizer, dtype=float32 reaches only the dequantized Linears: embeddings and norms stay
    # bfloat16. Widen them (exactly) so that the whole model runs in float32 like the dense fixtures.
    model = model.float().eval()
    stored = load_file(str(directory / "model.safetensors"))
    for module_name in quantized:
        expected = fp8_block_dequantized(stored[module_name + ".weight"], stored[module_name + ".weight_scale_inv"])
        loaded = model.get_submodule(module_name).weight.detach()
        assert loaded.dtype == torch.float32 and torch.equal(loaded, expected), module_name
    reference = {k + ".weight": fp8_block_dequantized(stored[k + ".weight"], stored[k + ".weight_scale_inv"])
                 for k in MODELS[name]["reference_linears"]}
    save_file(reference, str(directory / "reference.safetensors"), metadata={"format": "pt"})
    quantization = {
        "quantization": "fp8 (transformers FineGrainedFP8, weights by Fp8Quantize)",
        "dequantization": "transformers' Fp8Dequantize at load: float32(fp8) * float32(weight_scale_inv) per "
                          "128x128 block, in float32 (the loaded model's weights are checked equal to it)",
        "reference_linears": {k: {"format": "fp8 block 128x128", "dtype": "float32"}
                              for k in MODELS[name]["reference_linears"]},
    }
    write_reference(name, reference_outputs(name, model, quantization))


def write_reference(name, reference):
    reference["notes"] = [
        "logits_<k>.npy: float32 [T, vocab] of the dequantized model, row t = logits after input_ids[0..t].",
        "greedy: model.generate(do_sample=False, max_new_tokens=16) of the same model, cross-checked by an "
        "argmax loop without cache; top1_margins: logit(top1) - logit(top2) at each step.",
        "reference.safetensors: the dequantized weight of each Linear in reference_linears, in the dtype the "
        "reference produces.",
    ]
    base.write_json(QUANT / name / "reference.json", reference)


# ---------------------------------------------------------------------------------------------------------
# Single Linears with awkward shapes
# ---------------------------------------------------------------------------------------------------------

# (name, out N, in K, weight args, scale dtype). Shapes chosen for what they exercise.
ODD_CT_LINEARS = [
    # 37 rows: the zero points' last packed word holds 5 rows; 96 columns: 3 groups of 32
    ("int4_group_asym", 37, 96, dict(INT4, symmetric=False, strategy="group", group_size=32), "bfloat16"),
    # 100 columns: the packed row's last word holds 4 nibbles (its upper half is padding)
    ("int4_channel_sym", 24, 100, dict(INT4, symmetric=True, strategy="channel"), "float32"),
    ("int4_channel_asym", 19, 52, dict(INT4, symmetric=False, strategy="channel"), "float16"),
    ("int4_actorder_asym", 20, 64, dict(INT4, symmetric=False, strategy="group", group_size=16, actorder="group"),
     "float16"),
    ("int4_actorder_sym", 16, 96, dict(INT4, symmetric=True, strategy="group", group_size=32, actorder="group"),
     "bfloat16"),
    # 136 x 160: scale [2, 2]; the last block row holds 8 rows and the last block column 32 columns
    ("fp8_block_partial", 136, 160, dict(FP8, strategy="block", block_structure=[128, 128]), "bfloat16"),
    ("fp8_block_small", 40, 48, dict(FP8, strategy="block", block_structure=[16, 32]), "float16"),
    ("fp8_tensor", 9, 40, dict(FP8, strategy="tensor"), "float32"),
    ("fp8_channel", 33, 24, dict(FP8, strategy="channel"), "float16"),
    ("fp8_channel_bf16", 12, 72, dict(FP8, strategy="channel"), "bfloat16"),
    # the group sizes llm-compressor's W4A16 recipes use: 64, and 128 (the common one) with zero points
    ("int4_group64_sym", 48, 192, dict(INT4, symmetric=True, strategy="group", group_size=64), "bfloat16"),
    ("int4_group128_asym", 72, 384, dict(INT4, symmetric=False, strategy="group", group_size=128), "float16"),
]
# Qwen-style weight_scale_inv written by transformers' Fp8Quantize: (name, N, K, block, scale_inv dtype).
ODD_QWEN_LINEARS = [
    ("qwen_fp8_f32", 64, 96, [32, 32], "float32"),
    # some published checkpoints store weight_scale_inv in bfloat16: the fp32 scales rounded to it
    ("qwen_fp8_bf16", 48, 64, [16, 32], "bfloat16"),
]


def make_odd_linears():
    import compressed_tensors
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    directory = QUANT / "odd-linears"
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(3001)
    stored, reference, described = {}, {}, []
    for index, (name, n, k, weights, dtype) in enumerate(ODD_CT_LINEARS):
        weight = (0.25 * torch.randn(n, k, generator=generator)).to(getattr(torch, dtype))
        scheme = make_scheme(["Linear"], weights, None)
        scheme.format = "pack-quantized" if weights["type"] == "int" else "float-quantized"
        state = calibrated_state(weight, scheme.weights, seed=3100 + index)
        compressed = BaseCompressor.get_value_from_registry(scheme.format).compress(state, scheme)
        for key, value in compressed.items():
            stored[f"{name}.{key}"] = value.contiguous()
        dequantized = ct_decompress(dict(compressed), scheme)
        assert dequantized.dtype == weight.dtype
        reference[f"{name}.weight"] = dequantized.contiguous()
        described.append({"name": name, "out_features": n, "in_features": k, "format": scheme.format,
                          "weights": scheme.weights.model_dump(include={
                              "num_bits", "type", "symmetric", "strategy", "group_size", "block_structure",
                              "actorder"}),
                          "scale_name": "weight_scale", "scale_dtype": dtype})
    for name, n, k, block, dtype in ODD_QWEN_LINEARS:
        weight = (0.25 * torch.randn(n, k, generator=generator)).to(torch.bfloat16)

        class QuantizerSettings:
            quantization_config = FineGrainedFP8Config(weight_block_size=block)

        result = Fp8Quantize(QuantizerSettings()).convert({f"{name}.weight": weight})
        fp8 = result[f"{name}.weight"]
        scale_inv = result[f"{name}.weight_scale_inv"].to(getattr(torch, dtype))
        stored[f"{name}.weight"] = fp8
        stored[f"{name}.weight_scale_inv"] = scale_inv
        reference[f"{name}.weight"] = fp8_block_dequantized(fp8, scale_inv)
        described.append({"name": name, "out_features": n, "in_features": k, "format": "fp8",
                          "weights": {"strategy": "block", "block_structure": block},
                          "scale_name": "weight_scale_inv", "scale_dtype": dtype})
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference, str(directory / "reference.safetensors"), metadata={"format": "pt"})
    import transformers
    base.write_json(directory / "linears.json", {
        "generator": "tools/make_quant_fixtures.py",
        "compressed_tensors_version": compressed_tensors.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "notes": [
            "model.safetensors: each Linear's tensors as its format stores them, under '<name>.'.",
            "reference.safetensors: '<name>.weight', the dequantized weight: compressed-tensors' decompress "
            "(products in the scale's dtype) for scale_name weight_scale; transformers' Fp8Dequantize "
            "(float32 products) for weight_scale_inv.",
        ],
        "linears": described,
    })
    print(f"wrote {directory.relative_to(base.REPO_ROOT)}")


# ---------------------------------------------------------------------------------------------------------
# Dynamic fp8 activation quantization
# ---------------------------------------------------------------------------------------------------------

def make_activations():
    """compressed-tensors' dynamic fp8 activation quantization of float32 activations.

    token: one scale per row (FP8_DYNAMIC's input_activations); group: one per 128 columns of a row
    (FP8_BLOCK's). Rows include a zero row (compressed-tensors then uses scale = float32 eps), a row with a
    huge dynamic range (small values underflow to fp8 subnormals and zero) and negative-only rows.
    """
    import compressed_tensors
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from safetensors.torch import save_file
    directory = QUANT / "activations"
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(4001)
    out = {}
    for name, rows, cols, args in [
            ("token", 7, 320, QuantizationArgs(**FP8, strategy="token", dynamic=True)),
            ("group", 5, 384, QuantizationArgs(**FP8, strategy="group", group_size=128, dynamic=True))]:
        x = 3.0 * torch.randn(rows, cols, generator=generator)
        x[1] = 0.0
        x[2] *= torch.logspace(-6, 2, cols)       # 8 decades along the row
        x[3] = -x[3].abs()
        x = x.to(torch.float32)
        # compressed-tensors sees activations as [batch, tokens, features]
        scale, zero_point = compute_dynamic_scales_and_zp(value=x.unsqueeze(0), args=args, module=None)
        q = quantize(x=x.unsqueeze(0), scale=scale, zero_point=zero_point, args=args, dtype=torch.float8_e4m3fn)
        out[f"{name}.x"] = x.contiguous()
        out[f"{name}.scale"] = scale.reshape(rows, -1).to(torch.float32).contiguous()
        out[f"{name}.q"] = q.reshape(rows, cols).contiguous()
    # (safetensors writes __metadata__ in hash order: versions go to a JSON file so reruns are identical)
    save_file(out, str(directory / "activations.safetensors"), metadata={"format": "pt"})
    base.write_json(directory / "activations.json", {
        "generator": "tools/make_quant_fixtures.py",
        "compressed_tensors_version": compressed_tensors.__version__, "torch_version": torch.__version__,
        "notes": [
            "<case>.x: float32 activations [rows, cols]; <case>.scale: float32 [rows, scales per row]; "
            "<case>.q: F8_E4M3 [rows, cols], compressed-tensors' quantize(x, scale).",
            "token: QuantizationArgs(num_bits=8, type=float, strategy=token, dynamic=True), one scale per row.",
            "group: the same with strategy=group, group_size=128: one scale per 128 columns of a row.",
            "scale = max(|x|) / 448 over its elements (float32 eps where that is 0); q = e4m3(clamp(x / scale "
            "+ 0, -448, 448)), round to nearest even.",
        ]})
    print(f"wrote {directory.relative_to(base.REPO_ROOT)}")


def main():
    import torch
    import transformers
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from loguru import logger
    logger.remove()  # compressed-tensors' warnings about partial blocks are expected here
    QUANT.mkdir(parents=True, exist_ok=True)
    for name, spec in MODELS.items():
        if spec["kind"] == "compressed-tensors":
            make_compressed_tensors_model(name)
        else:
            make_qwen_fp8_model(name)
        print(f"wrote {(QUANT / name).relative_to(base.REPO_ROOT)}")
    make_odd_linears()
    make_activations()


if __name__ == "__main__":
    sys.exit(main())
