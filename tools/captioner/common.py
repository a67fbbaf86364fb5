"""What the captioner's training and evaluation share: the tokenizer, the chat template, the processor files,
the prompt, pixel values, and greedy captioning with transformers.

Every image the captioner sees in training is SIDE x SIDE (scenes.SIDE), so every prompt has the same length:
batches need no padding on the prompt side, and pixel values can be computed here in bulk (checked equal to
the processor's own output by check_pixel_values).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from . import scenes

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))
import make_fixtures  # noqa: E402  (the Qwen2 pre-tokenizer regex and pipeline settings)

PROMPT = "Describe this image."
PATCH, MERGE, TEMPORAL = 16, 2, 2
# Min and max pixel counts of the processor: a SIDE x SIDE scene is kept as it is; other images are scaled
# to about the same area (smart_resize), so that any picture gives a few dozen image tokens.
MIN_PIXELS = MAX_PIXELS = scenes.SIDE * scenes.SIDE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"

# ChatML as Qwen3-VL writes it (no default system turn): a message's content is a string or a list of parts,
# {"type": "image"} becoming the vision markup (the processor expands <|image_pad|> to the image's tokens).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '" + IMAGE_MARKUP + "' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PREPROCESSOR = {
    "size": {"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "merge_size": MERGE,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def write_json(path, obj):
    Path(path).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------

def train_tokenizer(seed, corpus_scenes=20000, vocab_size=384):
    """Byte-level BPE trained on captions (and the prompt), with Qwen2's pre-tokenizer, NFC normalizer,
    ByteLevel post-processor and decoder, and the Qwen special tokens after the learned vocabulary.

    Returns (tokenizer.json text, tokenizer_config.json object)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    qwen2 = make_fixtures.FAMILIES["qwen2"]
    corpus = [scene.caption for scene in scenes.scenes(seed, corpus_scenes)]
    corpus += [PROMPT, "user\n", "assistant\n", "system\n"] * 100
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(make_fixtures.QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(corpus, trainer=trainer)

    # The exact JSON of Qwen's files for every pipeline stage (the Python setters do not expose every flag).
    data = json.loads(tokenizer.to_str())
    model = data["model"]
    data["model"] = {"type": "BPE", **qwen2["model_flags"], "vocab": model["vocab"], "merges": model["merges"]}
    data["normalizer"] = qwen2["normalizer"]
    data["pre_tokenizer"] = qwen2["pre_tokenizer"]
    data["post_processor"] = None
    data["decoder"] = qwen2["decoder"]
    data["added_tokens"] = []
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.add_special_tokens([AddedToken(content, single_word=False, lstrip=False, rstrip=False,
                                             normalized=False, special=True) for content in SPECIAL_TOKENS])
    data = json.loads(tokenizer.to_str())
    data["post_processor"] = qwen2["post_processor"]
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    Tokenizer.from_str(text)  # must still load

    added = {str(t["id"]): {"content": t["content"], "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": True} for t in data["added_tokens"]}
    config = {  # the shape of Qwen3-VL-*-Instruct's tokenizer_config.json
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 256,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return text, config


# ---------------------------------------------------------------------------------------------------------
# Processor, prompt and pixel values
# ---------------------------------------------------------------------------------------------------------

def load_processor(model_dir):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=Qwen3VLVideoProcessor(), chat_template=CHAT_TEMPLATE)


def chat_text(processor):
    """The prompt text before the processor expands the image: one user turn, the image then PROMPT."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_inputs(processor, image):
    """The processor's model inputs for one image (a PIL image or a path)."""
    return processor(text=[chat_text(processor)], images=[image], return_tensors="pt")


def pixel_values(images):
    """Pixel values of SIDE x SIDE uint8 images [B, SIDE, SIDE, 3] as the Qwen3-VL processor lays them out:
    [B * patches, 3 * TEMPORAL * PATCH * PATCH], rows in 2 x 2 merge-window order, each row channel, frame,
    y, x. The size is kept (smart_resize of SIDE x SIDE within the budget is SIDE x SIDE), so no resampling."""
    x = torch.as_tensor(images).permute(0, 3, 1, 2).float()  # [B, 3, H, W]
    x = (x * (1 / 255) - 0.5) / 0.5
    b, g = x.shape[0], scenes.SIDE // (PATCH * MERGE)
    x = x.reshape(b, 3, g, MERGE, PATCH, g, MERGE, PATCH)           # c, bh, ih, y, bw, iw, x
    x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)                           # bh, bw, ih, iw, c, y, x
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, TEMPORAL, -1, -1)  # the still image as 2 frames
    return x.reshape(b * (g * MERGE) ** 2, 3 * TEMPORAL * PATCH * PATCH).contiguous()


def check_pixel_values(processor, images):
    """pixel_values() must equal what the processor computes from the same images."""
    ours = pixel_values(np.stack([np.asarray(image) for image in images]))
    theirs = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    difference = float((ours - theirs).abs().max())
    assert difference < 1e-6, f"pixel values differ from the processor's by {difference}"


# ---------------------------------------------------------------------------------------------------------
# Greedy captioning with transformers
# ---------------------------------------------------------------------------------------------------------

def batch_inputs(prompt, images):
    """Model inputs for SIDE x SIDE images sharing one prompt (the processor's outputs for one of them)."""
    b = len(images)
    grid = prompt["image_grid_thw"]
    return {
        "input_ids": prompt["input_ids"].expand(b, -1),
        "attention_mask": prompt["attention_mask"].expand(b, -1),
        "mm_token_type_ids": prompt["mm_token_type_ids"].expand(b, -1),
        "pixel_values": pixel_values(np.stack([np.asarray(image) for image in images])),
        "image_grid_thw": grid.expand(b, -1),
    }


@torch.no_grad()
def caption_images(model, processor, images, max_new_tokens=40, batch_size=64):
    """Greedy captions (model.generate, do_sample=False) of SIDE x SIDE images, decoded without specials."""
    prompt = prompt_inputs(processor, images[0])
    captions = []
    for start in range(0, len(images), batch_size):
        chunk = images[start:start + batch_size]
        inputs = batch_inputs(prompt, chunk)
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        new = out[:, inputs["input_ids"].shape[1]:]
        captions += processor.tokenizer.batch_decode(new, skip_special_tokens=True)
    return [c.strip() for c in captions]
