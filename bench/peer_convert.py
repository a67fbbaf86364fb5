#!/usr/bin/env python3
"""llama.cpp's convert_hf_to_gguf.py for bench/peer-cpu.sh, with one change: a BPE tokenizer whose pre-tokenizer
hash the converter does not know gets the pre-tokenizer named by PEER_TOKENIZER_PRE instead of an error.

The peer benchmark's checkpoints are random weights with the real shapes (tools/make_random_checkpoint.py); where no
real tokenizer is vendored (Llama 3) they carry a fixture tokenizer, whose hash no converter lists. llama-bench never
tokenizes (it feeds token ids), so the pre-tokenizer's name only has to be one llama.cpp loads.

    PEER_TOKENIZER_PRE=llama-bpe python3 bench/peer_convert.py LLAMA_CPP_DIR MODEL_DIR --outtype bf16 --outfile X
"""
import logging
import os
import sys
from pathlib import Path

llama_cpp = Path(sys.argv.pop(1)).resolve()
sys.path.insert(0, str(llama_cpp))
sys.path.insert(1, str(llama_cpp / "gguf-py"))
os.environ.setdefault("NO_LOCAL_GGUF", "1")  # gguf-py is on sys.path already

import convert_hf_to_gguf  # noqa: E402
from conversion import base  # noqa: E402

known = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        fallback = os.environ.get("PEER_TOKENIZER_PRE")
        if not fallback:
            raise
        logging.getLogger("peer_convert").warning("unknown pre-tokenizer hash: using %r (PEER_TOKENIZER_PRE)", fallback)
        return fallback


base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv[0] = str(llama_cpp / "convert_hf_to_gguf.py")
convert_hf_to_gguf.main()
