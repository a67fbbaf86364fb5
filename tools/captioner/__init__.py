"""The tiny Qwen3-VL scene captioner shipped under models/ (tools/train_captioner.py, tools/eval_captioner.py)."""
