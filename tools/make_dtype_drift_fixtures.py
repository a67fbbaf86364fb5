#!/usr/bin/env python3
"""How far transformers' own 16-bit runs of the tiny fixture models land from their float32 logits.

A GPU computes in bf16 or f16 activations; its logits cannot match the float32 reference exactly, and a test
that says how close is close enough needs a yardstick that is not ours. This script gives it: for every model
under tests/fixtures/models/ and every prompt of its reference.json, the same model loaded by transformers in
bfloat16 and in float16 (eager attention, on the CPU), and the relative max difference of its logits from the
float32 logits the fixture already holds (logits_<k>.npy):

    drift = max |logits_16 - logits_32| / max |logits_32|        (over the prompt's [T, vocab] logits)

Writes tests/fixtures/models/<name>/dtype_drift.json. The GPU tests (tests/unit-cuda-engine.cpp) allow the
CUDA engine in each dtype a small multiple of the drift transformers shows in that dtype on that prompt.
Deterministic (CPU, fixed inputs); a few seconds.

    /opt/kvdev/bin/python tools/make_dtype_drift_fixtures.py
"""
import json
import pathlib

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"


def relative_max_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))) / np.max(np.abs(want)))


def main() -> None:
    torch.manual_seed(0)
    for directory in sorted(MODELS.iterdir()):
        reference_path = directory / "reference.json"
        if not reference_path.exists():
            continue
        reference = json.loads(reference_path.read_text())
        result = {
            "model": directory.name,
            "generator": "tools/make_dtype_drift_fixtures.py",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "notes": [
                "drift[dtype][k] = max |logits - logits_k.npy| / max |logits_k.npy| for prompt k, where logits come "
                "from AutoModelForCausalLM.from_pretrained(dir, dtype=<dtype>, attn_implementation='eager') on the "
                "CPU, widened to float32",
            ],
            "drift": {},
        }
        for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, attn_implementation="eager")
            model.eval()
            drifts = []
            for prompt in reference["prompts"]:
                want = np.load(directory / prompt["logits_file"])
                with torch.no_grad():
                    got = model(torch.tensor([prompt["input_ids"]])).logits[0].float().numpy()
                drifts.append(round(relative_max_diff(got, want), 7))
            result["drift"][name] = drifts
            print(f"{directory.name} {name}: {drifts}")
        (directory / "dtype_drift.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
