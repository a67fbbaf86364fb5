#!/usr/bin/env python3
"""Scenes for tests/unit-cpu-dtypes.cpp: 200 new pictures for the captioner, to compare greedy captions of the
CPU engine in BF16 against the F32 engine (issue 16).

    /opt/kvdev/bin/python tools/make_dtype_scenes.py      # ~5 s; the output is deterministic

Draws the first 200 scenes of stream SEED with tools/captioner/scenes.py (the training script's streams are
seed * 10 + 1..4 = 20241..20244 and 11, tools/eval_captioner.py's default 7: these scenes are new to the
captioner) and writes to tests/fixtures/captioner/scenes/:

    scene_NNN.jpg   128 x 128 RGB, JPEG quality 92 (a third of PNG's bytes: 0.5 MB in all; the test compares
                    two engines on the same decoded pixels, so the artefacts cost nothing there)
    captions.txt    "<file>\\t<caption>" per line: the generator's exact caption, for the accuracy the test
                    prints beside the agreement
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from captioner import common, scenes  # noqa: E402

SEED = 1616
COUNT = 200
OUT = common.REPO_ROOT / "tests" / "fixtures" / "captioner" / "scenes"


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, scene in enumerate(scenes.scenes(SEED, COUNT)):
        name = f"scene_{i:03d}.jpg"
        scenes.render(scene).save(OUT / name, "JPEG", quality=92)
        lines.append(f"{name}\t{scene.caption}\n")
    (OUT / "captions.txt").write_text("".join(lines))
    print(f"wrote {COUNT} scenes of stream {SEED} to {OUT}")


if __name__ == "__main__":
    main()
