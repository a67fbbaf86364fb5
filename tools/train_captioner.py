#!/usr/bin/env python3
"""Train kvlite's bundled captioner: a tiny Qwen3-VL that describes generated scenes, saved as BF16, FP8 and W4A16.

    nice -n 10 /opt/kvdev/bin/python tools/train_captioner.py            # everything, into models/
    /opt/kvdev/bin/python tools/train_captioner.py --export-only         # redo FP8/W4A16 from the BF16 dir

From one seed it draws scenes (tools/captioner/scenes.py: one to three shapes, their exact captions), trains a
byte-level BPE tokenizer on captions, and trains a Qwen3VLForConditionalGeneration built with transformers'
own classes: loss on the answer tokens only (prompt = the chat template with the image and "Describe this
image.", answer = caption + <|im_end|>), fresh scenes every step. Every --eval-every steps it captions
--val-n validation scenes greedily with the weights rounded to BF16 (what is saved) and stops once at least
--target of them are exactly right. Then it writes

    models/kvlite-captioner-bf16/   config.json, model.safetensors (BF16), tokenizer.json, tokenizer_config.json
                                    (chat_template), preprocessor_config.json, generation_config.json
    models/kvlite-captioner-fp8/    the language model's Linears in Qwen's fine-grained FP8 (weight_scale_inv per
                                    128 x 128 block, transformers' Fp8Quantize); vision tower and lm_head BF16
    models/kvlite-captioner-w4a16/  the same Linears in compressed-tensors pack-quantized int4, symmetric, groups
                                    of 128 (compressed-tensors' own compressor); vision tower and lm_head BF16

checks the BF16 directory with transformers' generate on held-out scenes, and writes training.json (settings,
steps, time, accuracies) next to the weights.

Reproducible: seeded, and one thread by default (--threads changes the float reduction order, so the weights).
"""

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from captioner import common, scenes  # noqa: E402

MODELS = common.REPO_ROOT / "models"
NAME = "kvlite-captioner"
EXAMPLES = common.REPO_ROOT / "examples" / "images"
EXAMPLES_SEED = 11  # the scene stream the example images are taken from (make demo captions them)

# Text: hidden 128 and every Linear's K and N a multiple of 128, so that FP8 blocks of 128 x 128 and int4
# groups of 128 tile them exactly. GQA (4 query heads over 2 KV heads of 64), interleaved M-RoPE with
# mrope_section summing to head_dim / 2 as Qwen's do.
TEXT_CONFIG = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                     "mrope_interleaved": True})
# Vision: patch 16 (a 128 x 128 scene is 8 x 8 patches, 16 tokens after the 2 x 2 merge), an 8 x 8 position
# table (the grid of a scene, so no interpolation between rows), DeepStack taps after blocks 1 and 2 feeding
# text layers 0 and 1, the final block feeding the merger.
VISION_CONFIG = dict(
    depth=4, hidden_size=96, intermediate_size=384, num_heads=3, out_hidden_size=128, num_position_embeddings=64,
    patch_size=common.PATCH, spatial_merge_size=common.MERGE, temporal_patch_size=common.TEMPORAL,
    deepstack_visual_indexes=[1, 2])

# Quantized variants: only the language model's Linears (as Qwen's and llm-compressor's VL releases do); the
# vision tower, its mergers and the tied lm_head stay BF16.
TEXT_LINEARS = r"re:model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$"
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", "model.visual"]}
W4A16_GROUP = 128


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=2024, help="fixes the tokenizer, the model and every scene")
    p.add_argument("--out", type=Path, default=MODELS, help="where the three model directories go")
    p.add_argument("--threads", type=int, default=1, help="torch threads (changes the weights' last bits)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--cell-weight", type=float, default=1.0, help="weight of the training-only CellHead loss")
    p.add_argument("--max-steps", type=int, default=5000, help="the learning rate decays over this many steps")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--val-n", type=int, default=256, help="validation scenes captioned at each evaluation")
    p.add_argument("--target", type=float, default=0.99, help="stop when this share of validation is exact")
    p.add_argument("--check-n", type=int, default=500, help="held-out scenes that check the saved BF16 model")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint.pt is in the BF16 dir")
    p.add_argument("--export-only", action="store_true", help="skip training: requantize the BF16 directory")
    p.add_argument("--examples-only", action="store_true", help="only write examples/images/")
    return p.parse_args()


def stream_seeds(seed):
    """Independent scene streams derived from the one seed."""
    return {"tokenizer": seed * 10 + 1, "train": seed * 10 + 2, "validation": seed * 10 + 3, "check": seed * 10 + 4}


# ---------------------------------------------------------------------------------------------------------
# Model and batches
# ---------------------------------------------------------------------------------------------------------

def build_model(tokenizer, seed):
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in common.SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), **TEXT_CONFIG), vision_config=VISION_CONFIG,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config)
    # Qwen3-VL-Instruct's generation_config: greedy here, stop on <|im_end|> or <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"], do_sample=False)
    return model


class LinearPatchEmbed(torch.nn.Module):
    """Qwen3-VL's patch embedding computed as the Linear it is (a Conv3d whose kernel equals its stride, on rows
    that are already one patch each): the same parameters and result, several times faster to train on a CPU
    than the convolution. Only training uses it; the saved model is the stock class."""

    def forward(self, hidden_states):
        weight = self.proj.weight  # [hidden, 3, TEMPORAL, PATCH, PATCH]
        rows = hidden_states.view(-1, weight[0].numel()).to(weight.dtype)
        return torch.nn.functional.linear(rows, weight.reshape(weight.shape[0], -1), self.proj.bias)


def use_linear_patch_embed(model, pixel_values):
    embed = model.model.visual.patch_embed
    with torch.no_grad():
        expected = embed(pixel_values)
        embed.__class__ = type("LinearPatchEmbed", (LinearPatchEmbed, type(embed)), {})
        difference = float((embed(pixel_values) - expected).abs().max())
    assert difference < 1e-4, f"the Linear patch embedding differs from the Conv3d by {difference}"


class Batches:
    """Training batches of fresh scenes: the shared prompt, then caption + <|im_end|>, right-padded.

    Right padding needs no attention mask under causal attention (no real token sees a later one); labels
    are -100 on the prompt and the padding, so the loss covers the answer tokens only.
    """

    def __init__(self, processor, seed, batch_size):
        self.rng = random.Random(seed)
        self.batch_size = batch_size
        self.tokenizer = processor.tokenizer
        self.end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        probe = scenes.render(scenes.sample_scene(random.Random(0)))
        self.prompt = common.prompt_inputs(processor, probe)

    def next(self):
        batch = [scenes.sample_scene(self.rng) for _ in range(self.batch_size)]
        answers = [self.tokenizer.encode(s.caption, add_special_tokens=False) + [self.end] for s in batch]
        width = max(len(a) for a in answers)
        prompt_ids = self.prompt["input_ids"][0]
        p = len(prompt_ids)
        input_ids = torch.full((len(batch), p + width), self.pad, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)
        input_ids[:, :p] = prompt_ids
        for row, answer in enumerate(answers):
            input_ids[row, p:p + len(answer)] = torch.tensor(answer)
            labels[row, p:p + len(answer)] = torch.tensor(answer)
        types = torch.zeros_like(input_ids)
        types[:, :p] = self.prompt["mm_token_type_ids"][0]
        images = np.stack([np.asarray(scenes.render(s)) for s in batch])
        return {"input_ids": input_ids, "mm_token_type_ids": types, "pixel_values": common.pixel_values(images),
                "image_grid_thw": self.prompt["image_grid_thw"].expand(len(batch), -1)}, labels, cell_labels(batch)


CELL = common.PATCH * common.MERGE  # pixels of image per image token (one 2 x 2 merge window of patches)
CELLS = scenes.SIDE // CELL


def cell_labels(batch):
    """What the training-only CellHead must read from each image token: the shape that covers most of the
    token's CELL x CELL window (class 0: none), its colour and size, and where its centre is relative to the
    window's centre (in windows). A window is left out (-100) when a shape covers only a sliver of it or two
    shapes cover it about equally. Coverage is that of the shape's circle, sampled on an 8 x 8 grid per window.
    Tokens are in raster order, as the merger emits them."""
    samples = (np.arange(8) + 0.5) * CELL / 8
    tops, lefts = np.divmod(np.arange(CELLS * CELLS), CELLS)
    ys = (tops * CELL)[:, None, None] + samples[None, :, None]  # [token, 8, 1]
    xs = (lefts * CELL)[:, None, None] + samples[None, None, :]  # [token, 1, 8]
    kinds = torch.zeros(len(batch), CELLS * CELLS, 3, dtype=torch.long)  # shape, colour, size; 0 = no shape
    offsets = torch.zeros(len(batch), CELLS * CELLS, 2)
    for b, scene in enumerate(batch):
        coverage = np.stack([((xs - s.x) ** 2 + (ys - s.y) ** 2 <= s.radius ** 2).mean(axis=(1, 2))
                             for s in scene.shapes], axis=1)  # [token, shape]
        ranked = np.sort(coverage, axis=1)[:, ::-1]
        owner = coverage.argmax(axis=1)
        for token in np.flatnonzero(ranked[:, 0] > 0):
            best = ranked[token, 0]
            if best < 0.15 or (ranked.shape[1] > 1 and ranked[token, 1] >= 0.5 * best):
                kinds[b, token] = -100
                continue
            shape = scene.shapes[owner[token]]
            kinds[b, token] = torch.tensor([1 + scenes.SHAPES.index(shape.kind),
                                            1 + list(scenes.COLOURS).index(shape.colour),
                                            1 + list(scenes.SIZES).index(shape.size)])
            offsets[b, token] = torch.tensor([shape.x - lefts[token] * CELL, shape.y - tops[token] * CELL]) / CELL - 0.5
    return kinds.reshape(-1, 3), offsets.reshape(-1, 2)


class CellHead(torch.nn.Module):
    """Training only, not saved: linear read-outs of the merger's output tokens (the image rows the language
    model receives), supervised with cell_labels. They give the vision tower a direct signal per image token,
    which the caption loss alone delivers only after the language model has learned where to look: on one CPU
    core this is what makes the tiny tower learn shapes within the time budget."""

    def __init__(self, dim):
        super().__init__()
        self.kind = torch.nn.Linear(dim, 1 + len(scenes.SHAPES))
        self.colour = torch.nn.Linear(dim, 1 + len(scenes.COLOURS))
        self.size = torch.nn.Linear(dim, 1 + len(scenes.SIZES))
        self.offset = torch.nn.Linear(dim, 2)

    def loss(self, tokens, kinds, offsets):
        ce = torch.nn.functional.cross_entropy
        loss = ce(self.kind(tokens), kinds[:, 0], ignore_index=-100)
        loss = loss + ce(self.colour(tokens), kinds[:, 1], ignore_index=-100)
        loss = loss + ce(self.size(tokens), kinds[:, 2], ignore_index=-100)
        present = kinds[:, 0] > 0
        return loss + torch.nn.functional.mse_loss(self.offset(tokens[present]), offsets[present])


def answer_loss(model, inputs, labels):
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    targets = labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                             ignore_index=-100)


def exact_match(model, processor, scene_list):
    images = [scenes.render(s) for s in scene_list]
    captions = common.caption_images(model, processor, images)
    wrong = [(s.caption, c) for s, c in zip(scene_list, captions) if c != s.caption]
    return 1 - len(wrong) / len(scene_list), wrong


def describe_errors(wrong):
    """A one-line summary of wrong captions: how many got the number of shapes or the relation wrong, and the
    most frequent attribute confusions ("small circle -> square x 3")."""
    import collections
    import re
    phrase = re.compile(r"a (small|large) (\w+) (\w+)")
    structure, confusions = 0, collections.Counter()
    for expected, got in wrong:
        want, have = phrase.findall(expected), phrase.findall(got)
        if len(want) != len(have) or (" above " in expected) != (" above " in got):
            structure += 1
            continue
        for (size, colour, kind), (size2, colour2, kind2) in zip(want, have):
            if kind != kind2:
                confusions[f"{size} {kind} -> {kind2}"] += 1
            if colour != colour2:
                confusions[f"{colour} -> {colour2}"] += 1
            if size != size2:
                confusions[f"{size} -> {size2}"] += 1
    top = ", ".join(f"{what} x {n}" for what, n in confusions.most_common(6))
    return f"{len(wrong)} wrong: {structure} with the wrong count or relation; {top}"


def bf16_copy(model):
    """The model with its weights rounded to BF16 (what is saved) and widened back to float32."""
    import copy
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return rounded.eval()


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------

def train(args, directory):
    from transformers import PreTrainedTokenizerFast
    seeds = stream_seeds(args.seed)
    checkpoint_path = directory / "checkpoint.pt"
    if args.resume and not checkpoint_path.exists():
        sys.exit(f"train_captioner: --resume: {checkpoint_path} does not exist")
    if not args.resume:
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
    tokenizer_json, tokenizer_config = common.train_tokenizer(seeds["tokenizer"])
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    common.write_json(directory / "tokenizer_config.json", tokenizer_config)
    common.write_json(directory / "preprocessor_config.json", common.PREPROCESSOR)
    processor = common.load_processor(directory)
    assert isinstance(processor.tokenizer, PreTrainedTokenizerFast)
    probe = [scenes.render(s) for s in scenes.scenes(seeds["validation"], 8)]
    common.check_pixel_values(processor, probe)

    model = build_model(processor.tokenizer, args.seed)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {parameters / 1e6:.2f} M parameters, vocab {len(processor.tokenizer)}", flush=True)
    batches = Batches(processor, seeds["train"], args.batch_size)
    use_linear_patch_embed(model, common.pixel_values(np.stack([np.asarray(image) for image in probe])))
    validation = scenes.scenes(seeds["validation"], args.val_n)
    cell_head = CellHead(model.config.vision_config.out_hidden_size)
    merged = {}
    model.model.visual.merger.register_forward_hook(lambda module, inputs, output: merged.update(tokens=output))
    decay, no_decay = list(cell_head.parameters()), []
    for name, parameter in model.named_parameters():
        (no_decay if parameter.ndim < 2 or "norm" in name or "embed" in name else decay).append(parameter)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0}],
                                  lr=args.lr, betas=(0.9, 0.98))

    def learning_rate(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    history = []
    running = running_cell = None
    step = 0
    accuracy = 0.0
    seconds_before = cpu_seconds_before = 0.0  # spent by the runs this one resumes
    if args.resume:
        saved = torch.load(checkpoint_path, weights_only=False)
        model.load_state_dict(saved["model"])
        cell_head.load_state_dict(saved["cell_head"])
        optimizer.load_state_dict(saved["optimizer"])
        batches.rng.setstate(saved["scene_rng"])
        step, history, running, running_cell = saved["step"], saved["history"], saved["running"], saved["running_cell"]
        seconds_before, cpu_seconds_before = saved["seconds"], saved["cpu_seconds"]
        print(f"resumed at step {step}", flush=True)
    started, cpu_started = time.time() - seconds_before, time.process_time() - cpu_seconds_before
    while step < args.max_steps:
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        inputs, labels, (kinds, offsets) = batches.next()
        caption_loss = answer_loss(model, inputs, labels)
        cell_loss = cell_head.loss(merged["tokens"], kinds, offsets)
        optimizer.zero_grad(set_to_none=True)
        (caption_loss + args.cell_weight * cell_loss).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(cell_head.parameters()), 1.0)
        optimizer.step()
        step += 1
        loss = float(caption_loss.detach())
        running = loss if running is None else 0.98 * running + 0.02 * loss
        cell = float(cell_loss.detach())
        running_cell = cell if running_cell is None else 0.98 * running_cell + 0.02 * cell
        if step % 50 == 0:
            print(f"step {step}  loss {running:.4f}  cell loss {running_cell:.4f}  lr {learning_rate(step):.2e}  "
                  f"{time.time() - started:.0f} s", flush=True)
        if step % args.eval_every == 0 or step == args.max_steps:
            accuracy, wrong = exact_match(bf16_copy(model), processor, validation)
            history.append({"step": step, "seconds": round(time.time() - started), "loss": round(running, 5),
                            "cell_loss": round(running_cell, 5),
                            "validation_exact_match": accuracy})
            print(f"step {step}  validation exact match {accuracy:.4f} (BF16 weights)", flush=True)
            print("    " + describe_errors(wrong), flush=True)
            if accuracy >= args.target:
                break
            # Everything the following steps depend on, so that --resume continues this run exactly.
            torch.save({"model": model.state_dict(), "cell_head": cell_head.state_dict(),
                        "optimizer": optimizer.state_dict(), "scene_rng": batches.rng.getstate(), "step": step,
                        "history": history, "running": running, "running_cell": running_cell,
                        "seconds": time.time() - started, "cpu_seconds": time.process_time() - cpu_started},
                       checkpoint_path.with_suffix(".tmp"))
            checkpoint_path.with_suffix(".tmp").replace(checkpoint_path)
    seconds, cpu_seconds = time.time() - started, time.process_time() - cpu_started

    model = bf16_copy(model).to(torch.bfloat16)
    model.save_pretrained(str(directory))
    checkpoint_path.unlink(missing_ok=True)
    return {"steps": step, "train_seconds": round(seconds), "train_cpu_seconds": round(cpu_seconds),
            "parameters": parameters,
            "validation_exact_match": accuracy, "history": history}


# ---------------------------------------------------------------------------------------------------------
# Quantized variants
# ---------------------------------------------------------------------------------------------------------

def copy_side_files(source, target):
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "generation_config.json"):
        shutil.copyfile(source / file, target / file)


def text_linear_names(state_dict):
    import re
    pattern = re.compile(TEXT_LINEARS[len("re:"):])
    return sorted(key[:-len(".weight")] for key in state_dict if key.endswith(".weight")
                  and pattern.match(key[:-len(".weight")]))


def export_fp8(source, target):
    """Qwen's fine-grained FP8: transformers' own Fp8Quantize on each language-model Linear."""
    from safetensors.torch import load_file, save_file
    import make_quant_fixtures as quant
    copy_side_files(source, target)
    stored = load_file(str(source / "model.safetensors"))
    linears = text_linear_names(stored)
    for name in linears:
        n, k = stored[name + ".weight"].shape
        assert n % 128 == 0 and k % 128 == 0, (name, (n, k))  # whole 128 x 128 blocks
    out, _ = quant.fp8_quantized_state(stored, set(linears), FP8_CONFIG["weight_block_size"],
                                       FP8_CONFIG["modules_to_not_convert"])
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = FP8_CONFIG
    common.write_json(target / "config.json", config)
    return linears


def export_w4a16(source, target):
    """compressed-tensors pack-quantized int4 (symmetric, groups of 128, min-max scales: llm-compressor's
    default observer), packed by compressed-tensors' own ModelCompressor."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import Qwen3VLForConditionalGeneration
    import make_quant_fixtures as quant
    copy_side_files(source, target)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(source), dtype=torch.bfloat16).eval()
    scheme = quant.make_scheme([TEXT_LINEARS], dict(quant.INT4, symmetric=True, strategy="group",
                                                    group_size=W4A16_GROUP), None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head", "re:model\\.visual\\..*"],
                                                        quantization_status="calibration"), show_progress=False)
    linears = []
    for name, module in model.named_modules():
        module_scheme = getattr(module, "quantization_scheme", None)
        if module_scheme is None:
            continue
        assert module.weight.shape[1] % W4A16_GROUP == 0, (name, module.weight.shape)
        state = quant.calibrated_state(module.weight.data, module_scheme.weights, seed=0)
        for key in ("weight_scale", "weight_zero_point"):
            if key in state and hasattr(module, key):
                getattr(module, key).data.copy_(state[key])
        linears.append(name)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(target))
    compressor.update_config(str(target))
    # save_pretrained rewrote these two from the model: keep the BF16 directory's.
    shutil.copyfile(source / "generation_config.json", target / "generation_config.json")
    return sorted(linears)


def check_saved(directory, seed, n):
    """Greedy captions of n held-out scenes by the saved directory, through transformers."""
    from transformers import Qwen3VLForConditionalGeneration
    processor = common.load_processor(directory)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    accuracy, wrong = exact_match(model, processor, scenes.scenes(seed, n))
    return accuracy, wrong


def write_examples():
    """examples/images/: one scene of each kind of caption (one shape, "to the left of", "above", three shapes
    twice), as PNG, and captions.txt: "<file>\t<caption>" per line."""
    wanted = ["1", "left", "above", "3", "3"]
    picked = []
    for scene in scenes.scenes(EXAMPLES_SEED, 200):
        kind = ("left" if " to the left of " in scene.caption else "above") if len(scene.shapes) == 2 \
            else str(len(scene.shapes))
        if kind in wanted:
            wanted.remove(kind)
            picked.append(scene)
    assert not wanted
    EXAMPLES.mkdir(parents=True, exist_ok=True)
    for stale in EXAMPLES.glob("scene_*.png"):
        stale.unlink()
    lines = []
    for i, scene in enumerate(picked, 1):
        name = f"scene_{i}.png"
        scenes.render(scene).save(EXAMPLES / name)
        lines.append(f"{name}\t{scene.caption}")
    (EXAMPLES / "captions.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {EXAMPLES} ({len(picked)} images)")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    transformers.logging.set_verbosity_error()
    from loguru import logger
    logger.remove()
    write_examples()
    if args.examples_only:
        return 0
    bf16, fp8, w4a16 = (args.out / f"{NAME}-{kind}" for kind in ("bf16", "fp8", "w4a16"))
    seeds = stream_seeds(args.seed)
    record_path = bf16 / "training.json"
    if args.export_only:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    else:
        record = {"seed": args.seed, "scene_streams": seeds, "threads": args.threads, "batch_size": args.batch_size,
                  "lr": args.lr, "warmup": args.warmup, "max_steps": args.max_steps, "cell_weight": args.cell_weight,
                  "target": args.target, "val_n": args.val_n, "torch": torch.__version__,
                  "transformers": transformers.__version__}
        record.update(train(args, bf16))
        accuracy, wrong = check_saved(bf16, seeds["check"], args.check_n)
        record["check_exact_match"] = accuracy
        record["check_n"] = args.check_n
        print(f"saved BF16 model, transformers generate on {args.check_n} held-out scenes: exact match "
              f"{accuracy:.4f}", flush=True)
        for expected, got in wrong[:10]:
            print(f"    expected {expected!r}\n    got      {got!r}")
        common.write_json(record_path, record)
    export_fp8(bf16, fp8)
    export_w4a16(bf16, w4a16)
    for directory in (bf16, fp8, w4a16):
        size = sum(f.stat().st_size for f in directory.iterdir())
        print(f"wrote {directory} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    sys.exit(main())
