#!/usr/bin/env python3
"""External truth for tests/unit-captioner.cpp: transformers' logits of the bundled captioner, per format.

    /opt/kvdev/bin/python tools/make_captioner_fixtures.py        # ~10 s; rerun after tools/train_captioner.py

For each model directory under models/ (kvlite-captioner-bf16, -fp8, -w4a16) it takes one example image
(examples/images/, a different one per format), builds the captioning prompt exactly as caption_image does (the
chat template, the image, "Describe this image.", the assistant turn) followed by the image's expected caption
and <|im_end|>, and runs transformers' Qwen3VLForConditionalGeneration on it in float32 with eager attention:
the quantized Linears dequantized by their reference libraries (tools/eval_captioner.py reference_model). It
writes to tests/fixtures/captioner/:

    reference.json      per format: the model directory, the image, the token ids with the image as ONE
                        <|image_pad|> (kvlite expands it), the expanded length, the logits file; versions
    logits_<format>.npy float32 [expanded tokens, vocab]: every position, so the test checks the prompt, the
                        image tokens and each step of the caption (teacher-forced)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import eval_captioner  # noqa: E402
from captioner import common  # noqa: E402

OUT = common.REPO_ROOT / "tests" / "fixtures" / "captioner"
EXAMPLES = common.REPO_ROOT / "examples" / "images"
IMAGE_FOR_FORMAT = {"bf16": "scene_1.png", "fp8": "scene_3.png", "w4a16": "scene_5.png"}


@torch.no_grad()
def main():
    import PIL
    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    expected = dict(line.split("\t") for line in (EXAMPLES / "captions.txt").read_text(encoding="utf-8").splitlines())
    OUT.mkdir(parents=True, exist_ok=True)
    reference = {"transformers": transformers.__version__, "torch": torch.__version__, "pillow": PIL.__version__,
                 "formats": {}}
    for kind, image_name in IMAGE_FOR_FORMAT.items():
        model_dir = common.REPO_ROOT / "models" / eval_captioner.FORMATS[kind]
        processor = common.load_processor(model_dir)
        model = eval_captioner.reference_model(model_dir)
        image = PIL.Image.open(EXAMPLES / image_name).convert("RGB")
        text = common.chat_text(processor) + expected[image_name] + "<|im_end|>"
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        logits = model(**inputs).logits[0].float().numpy()
        expanded = inputs["input_ids"][0].tolist()
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        collapsed = [t for i, t in enumerate(expanded) if t != pad or expanded[i - 1] != pad]
        np.save(OUT / f"logits_{kind}.npy", logits.astype(np.float32))
        reference["formats"][kind] = {
            "model": f"models/{model_dir.name}", "image": f"examples/images/{image_name}",
            "caption": expected[image_name], "ids": collapsed, "expanded_tokens": len(expanded),
            "logits_file": f"logits_{kind}.npy"}
        print(f"{kind}: {image_name}, {len(expanded)} tokens ({len(collapsed)} with the image collapsed), "
              f"logits {logits.shape}")
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
