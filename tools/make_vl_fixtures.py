#!/usr/bin/env python3
"""Make the vision-language fixtures (tests/fixtures/vl/) with transformers' Qwen3-VL.

kvlite's tests/unit-vision.cpp compares its vision encoder, M-RoPE positions and fused prefill against what
these files record, so every expected value comes from the reference implementation:

  * a tiny random Qwen3VLForConditionalGeneration built with transformers' own classes, saved with
    save_pretrained in BF16, with the qwen2 fixture tokenizer (it has <|vision_start|>, <|vision_end|> and
    <|image_pad|>) and a preprocessor_config.json with a small pixel budget;
  * for a prompt with one image and a prompt with two images of different aspect ratios, run through
    transformers' own Qwen3VLProcessor and the model loaded in float32 (eager attention, CPU): input_ids (the
    processor expanded each <|image_pad|>), pixel_values, image_grid_thw, position_ids (3, S) and rope_deltas
    from get_rope_index, the vision tower's merged embeddings and its DeepStack features, the logits of every
    position, and a greedy continuation (generate(), cross-checked with a cache-free argmax loop).

    /opt/kvdev/bin/python tools/make_vl_fixtures.py

Needs the environment of tools/README.md (transformers, torch, torchvision, Pillow). Writes about 1.7 MB
(layout in tests/fixtures/vl/README.md). Deterministic: seeded, byte-identical on rerun with the same package
versions.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import PIL
import PIL.Image
import torch
import torchvision
import transformers
from transformers import (AutoImageProcessor, AutoTokenizer, GenerationConfig, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration, Qwen3VLProcessor)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures"
OUT = FIXTURES / "vl"
MODEL_NAME = "tiny-qwen3-vl"
MODEL_DIR = OUT / MODEL_NAME
TOKENIZER_DIR = FIXTURES / "tokenizers" / "qwen2"
IMAGES_DIR = FIXTURES / "images"
SEED = 1016  # the first seed from 1007 whose greedy steps all have a top-1 margin >= 0.05

# The pixel budget of tests/fixtures/images' processor cases (min 4 and max 8 merge windows of 32 x 32), so
# that the photo is scaled up, the wide image down, and their pixel_values are already recorded there.
MIN_PIXELS, MAX_PIXELS = 4096, 8192

# Tiny but not degenerate. Text: GQA (4 query heads over 2 KV heads), head_dim 16 with mrope_section [4, 2, 2]
# (sums to head_dim / 2; interleaved: frequencies 1, 4 take h, 2, 5 take w, the rest t), theta 10000 so that
# the h and w positions of image tokens turn the low frequencies visibly, 4 layers so that one layer runs
# after the three DeepStack injections. Vision: 2 heads of 16, depth 4 with DeepStack taps after blocks
# 0, 2 and 3 (block 1 feeds none, so a runtime that takes the wrong block differs), a 12 x 12 position table
# (side - 1 = 11 is prime, so the bilinear source coordinates of most grids fall between table rows).
TEXT_CONFIG = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True})
VISION_CONFIG = dict(
    depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, num_position_embeddings=144,
    deepstack_visual_indexes=[0, 2, 3])

# Qwen/Qwen3-VL-*-Instruct's preprocessor_config.json with the small budget.
PREPROCESSOR = {
    "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# (name, prompt text before the processor expands the image pads, images as (file, given_as)).
# given_as "path": the processor decodes the file itself; "array": Pillow's decode is passed (torchvision, the
# processor's loader, cannot read BMP).
PROMPTS = [
    ("one_image",
     "<|im_start|>user\n" + IMAGE + "Describe this image.<|im_end|>\n<|im_start|>assistant\n",
     [("photo_67x45.png", "path")]),
    ("two_images",
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + IMAGE + "Compare the wide picture with"
     + IMAGE + " the tall one.<|im_end|>\n<|im_start|>assistant\n",
     [("wide_640x64.png", "path"), ("tall_31x97.bmp", "array")]),
]
GREEDY_NEW_TOKENS = 8


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def save_npy(path, array):
    np.save(path, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)


def randomize_weights(model, seed):
    """Seeded weights of std ~0.2 (transformers' init uses 0.02, which would make every output near-flat).

    Norm gains are 1 + N(0, 0.2^2) and biases N(0, 0.2^2), so a runtime that skips one of them differs.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # the tied lm_head is listed once, as embed_tokens
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                parameter.copy_(0.2 * noise)
            else:
                parameter.copy_(0.2 * noise)


def build_model():
    cases = json.loads((TOKENIZER_DIR / "cases.json").read_text(encoding="utf-8"))
    token_ids = {t["content"]: t["id"] for t in cases["added_tokens"]}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=cases["vocab_size"], **TEXT_CONFIG),
        vision_config=VISION_CONFIG,
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=True)
    torch.manual_seed(SEED)
    model = Qwen3VLForConditionalGeneration(config)
    randomize_weights(model, SEED)
    # Qwen3-VL-Instruct's generation_config: stop on <|im_end|> or <|endoftext|>.
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["<|endoftext|>"], eos_token_id=[token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
        pad_token_id=token_ids["<|endoftext|>"])
    model = model.to(torch.bfloat16)
    if MODEL_DIR.exists():
        shutil.rmtree(MODEL_DIR)
    model.save_pretrained(str(MODEL_DIR))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / file, MODEL_DIR / file)
    write_json(MODEL_DIR / "preprocessor_config.json", PREPROCESSOR)


def load_image(file, given_as):
    path = IMAGES_DIR / file
    if given_as == "path":
        return str(path)
    return np.array(PIL.Image.open(path).convert("RGB"))  # a writable copy


def greedy_without_cache(model, inputs, new_tokens, eos_ids):
    """Argmax decoding with a full forward per step (positions recomputed from scratch by get_rope_index each
    time): a cross-check of generate()'s cached decoding with rope_deltas, and the top-1 margins."""
    ids = inputs["input_ids"].clone()
    types = inputs["mm_token_type_ids"].clone()
    margins = []
    for _ in range(new_tokens):
        with torch.no_grad():
            last = model(input_ids=ids, mm_token_type_ids=types, pixel_values=inputs["pixel_values"],
                         image_grid_thw=inputs["image_grid_thw"]).logits[0, -1]
        top = torch.topk(last, 2)
        margins.append(float(top.values[0] - top.values[1]))
        next_id = int(top.indices[0])
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
        types = torch.cat([types, torch.zeros((1, 1), dtype=types.dtype)], dim=1)
        if next_id in eos_ids:
            break
    return ids[0, inputs["input_ids"].shape[1]:].tolist(), margins


def reference_outputs():
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    image_processor = AutoImageProcessor.from_pretrained(str(MODEL_DIR))
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=Qwen3VLVideoProcessor())
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(MODEL_DIR), dtype=torch.float32,
                                                            attn_implementation="eager")
    model.eval()
    eos_ids = set(model.generation_config.eos_token_id)
    spatial_merge = model.config.vision_config.spatial_merge_size

    # Pixel values of each image, each written once: the ones tests/fixtures/images already records are
    # checked against that file and referenced, the others written here.
    recorded = {}
    prompts = []
    for k, (prompt_name, text, images) in enumerate(PROMPTS):
        inputs = processor(text=[text], images=[load_image(f, g) for f, g in images], return_tensors="pt")
        grids = inputs["image_grid_thw"].tolist()
        pixel_values = inputs["pixel_values"].numpy()
        image_entries = []
        row = 0
        for (file, given_as), grid in zip(images, grids):
            rows = grid[0] * grid[1] * grid[2]
            values = pixel_values[row:row + rows]
            row += rows
            stem = file.rsplit(".", 1)[0]
            existing = IMAGES_DIR / f"{stem}.pixel_values.npy"
            if existing.exists():
                assert np.array_equal(np.load(existing), values), f"{existing} differs from the processor's output"
                pixel_file = existing.relative_to(FIXTURES).as_posix()
            else:
                pixel_file = f"vl/{stem}.pixel_values.npy"
                if pixel_file not in recorded:
                    save_npy(FIXTURES / pixel_file, values)
            recorded[pixel_file] = True
            image_entries.append({"file": f"images/{file}", "given_as": given_as, "grid_thw": grid,
                                  "image_tokens": rows // spatial_merge ** 2, "pixel_values_file": pixel_file,
                                  "pixel_values_shape": list(values.shape)})
        assert row == pixel_values.shape[0]

        input_ids = inputs["input_ids"]
        with torch.no_grad():
            position_ids, rope_deltas = model.model.get_rope_index(
                input_ids, mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
            features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            logits = model(**inputs).logits[0].float()  # [S, vocab]
        merged = torch.cat(features.pooler_output, dim=0).numpy()
        save_npy(OUT / f"vision_{k}.npy", merged)
        deepstack_files = []
        for j, level in enumerate(features.deepstack_features):
            save_npy(OUT / f"deepstack_{k}_{j}.npy", torch.cat(level, dim=0).numpy())
            deepstack_files.append(f"deepstack_{k}_{j}.npy")
        save_npy(OUT / f"logits_{k}.npy", logits.numpy())

        with torch.no_grad():
            generated = model.generate(**inputs, do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS)
        new_ids = generated[0, input_ids.shape[1]:].tolist()
        check_ids, margins = greedy_without_cache(model, inputs, GREEDY_NEW_TOKENS, eos_ids)
        assert check_ids == new_ids, (prompt_name, new_ids, check_ids)

        prompts.append({
            "name": prompt_name,
            "text": text,
            "images": image_entries,
            "how": "Qwen3VLProcessor(text=[text], images=[...]): each <|image_pad|> expanded to its image_tokens",
            "input_ids": input_ids[0].tolist(),
            "mm_token_type_ids": inputs["mm_token_type_ids"][0].tolist(),
            "position_ids": position_ids[:, 0, :].tolist(),
            "rope_delta": int(rope_deltas[0, 0]),
            "vision_file": f"vision_{k}.npy",
            "vision_shape": list(merged.shape),
            "deepstack_files": deepstack_files,
            "logits_file": f"logits_{k}.npy",
            "logits_shape": list(logits.shape),
            "greedy": {"max_new_tokens": GREEDY_NEW_TOKENS, "new_ids": new_ids,
                       "stopped_at_eos": bool(new_ids) and new_ids[-1] in eos_ids,
                       "text": tokenizer.decode(new_ids, skip_special_tokens=False),
                       "top1_margins": margins},
        })

    return {
        "model": MODEL_NAME,
        "generator": "tools/make_vl_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "pillow_version": PIL.__version__,
        "numpy_version": np.__version__,
        "dtype_on_disk": "bfloat16",
        "reference_dtype": "float32",
        "attn_implementation": "eager",
        "vocab_size": model.config.text_config.vocab_size,
        "eos_token_ids": sorted(eos_ids),
        "image_token_id": model.config.image_token_id,
        "vision_start_token_id": model.config.vision_start_token_id,
        "vision_end_token_id": model.config.vision_end_token_id,
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "notes": [
            "Outputs of Qwen3VLForConditionalGeneration.from_pretrained(dir, dtype=float32, "
            "attn_implementation='eager') on CPU: the BF16 weights widened to float32.",
            "Paths of images and pixel_values files are relative to tests/fixtures/.",
            "position_ids: get_rope_index(input_ids, mm_token_type_ids, image_grid_thw), rows t, h, w; "
            "rope_delta: its mrope_position_deltas (a decoded token at cache index c has position c + rope_delta).",
            "vision_<k>.npy: get_image_features(...).pooler_output of the prompt's images, concatenated "
            "[image tokens, out_hidden_size]; deepstack_<k>_<j>.npy: deepstack_features[j], the same shape.",
            "logits_<k>.npy: float32 [S, vocab], row t = logits after input_ids[0..t].",
            "greedy: generate(**processor_outputs, do_sample=False, max_new_tokens=8), equal to an argmax loop "
            "without cache; top1_margins: logit(top1) - logit(top2) per step.",
        ],
        "prompts": prompts,
    }


def main():
    torch.set_num_threads(1)  # one reduction order, so reruns give the same bits
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    OUT.mkdir(parents=True, exist_ok=True)
    for stale in list(OUT.glob("*.npy")):
        stale.unlink()
    build_model()
    write_json(OUT / "reference.json", reference_outputs())
    print(f"wrote {OUT.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
