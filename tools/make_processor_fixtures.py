#!/usr/bin/env python3
"""Writes tests/fixtures/images/clip-processor/: a Qwen3-VL model directory's config files whose
preprocessor_config.json carries CLIP's image_mean / image_std (not Qwen's 0.5) and a rescale_factor of its own,
and the pixel_values transformers' image processor gives for photo_67x45.png with it. tests/unit-image.cpp
checks that kvlite honours every value (it once ignored image_mean / image_std silently). Deterministic.

    /opt/kvdev/bin/python tools/make_processor_fixtures.py
"""
import json
import shutil
from pathlib import Path

import numpy as np
import transformers
from transformers import AutoImageProcessor

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "tests" / "fixtures" / "images"
OUT = IMAGES / "clip-processor"

PREPROCESSOR = {
    "size": {"longest_edge": 8192, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # CLIP's
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 0.00392156862745098,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "fixtures" / "vl" / "tiny-qwen3-vl" / "config.json", OUT / "config.json")
    (OUT / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    processor = AutoImageProcessor.from_pretrained(str(OUT))
    assert list(processor.image_mean) == PREPROCESSOR["image_mean"], processor.image_mean
    result = processor(images=str(IMAGES / "photo_67x45.png"), return_tensors="pt")
    pixel_values = result["pixel_values"].numpy().astype(np.float32)
    np.save(OUT / "photo_67x45.pixel_values.npy", pixel_values)
    (OUT / "expected.json").write_text(json.dumps({
        "transformers": transformers.__version__, "image": "photo_67x45.png",
        "image_grid_thw": [int(v) for v in result["image_grid_thw"][0]],
        "pixel_values_file": "photo_67x45.pixel_values.npy"}, indent=2) + "\n")
    print("wrote", OUT.relative_to(ROOT), pixel_values.shape)


if __name__ == "__main__":
    main()
