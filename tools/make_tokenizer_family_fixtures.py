#!/usr/bin/env python3
"""Make the tokenizer-family fixtures: tests/fixtures/tokenizers/<family>/{tokenizer.json,cases.json}.

    /opt/kvdev/bin/python tools/make_tokenizer_family_fixtures.py

kvlite reads tokenizer.json of every family it targets; tests/unit-tokenizer-families.cpp checks it id for id
against Hugging Face `tokenizers` through the files written here (Python runs only here, never in make test).

The real tokenizer.json files of these families are 2 to 33 MB and are not vendored in a reachable package,
so each family is a FAITHFUL STAND-IN: a small BPE trained with `tokenizers` on the corpus of
tools/make_fixtures.py, then wired exactly as the family's own tokenizer.json is (normalizer, pre-tokenizer,
model flags byte_fallback / fuse_unk / unk_token / ignore_merges, decoder, post-processor, added tokens with
their lstrip / rstrip / normalized / special flags). Only the vocabulary and merges are ours.

  smollm2        SmolLM2 (GPT-2 style): Digits(individual) then ByteLevel(use_regex) pre-tokenizer
  phi-4-mini     Phi-4-mini (o200k style): Split(o200k regex) then ByteLevel(use_regex false)
  mistral-v0.3   Mistral v0.3 (LlamaConverter, legacy=false): Metaspace(prepend_scheme first, split false)
                 pre-tokenizer, Replace/ByteFallback/Fuse/Strip decoder, byte_fallback, [INST] tokens
  phi-3.5        Phi-3.5-mini (Llama-2 legacy conversion): Prepend + Replace normalizers, no pre-tokenizer,
                 Replace/ByteFallback/Fuse/Strip decoder, byte_fallback, added tokens with rstrip
  gemma          Gemma 2/3: Replace(" " -> "▁") normalizer, Split(" ", MergedWithPrevious), Replace/
                 ByteFallback/Fuse decoder, byte_fallback, <bos> template
  mistral-v0.3-real, mistral-v0.1-real
                 REAL vocabularies (32,768 and 32,000 pieces): Mistral's SentencePiece models from the
                 mistral-common wheel on PyPI, converted as transformers' LlamaConverter does, wired as the
                 Hugging Face repositories' files are (v0.3: legacy=false Metaspace; v0.1: the Llama-2 legacy
                 Prepend + Replace normalizers that Phi-3.5-mini's file also has). Needs
                 `pip install --no-deps mistral-common==1.13.1`. Written as tokenizer.tar.xz (tokenizer.json +
                 tokenizer_config.json), which CMake unpacks into the build directory.
  components-a   no family: the rest of the components (NFKC, Lowercase, Strip, regex Replace; Whitespace,
                 Punctuation, Digits contiguous, Split with every behaviour and invert; Metaspace always +
                 split; RobertaProcessing; decoder Strip / Replace / ByteFallback / Fuse sequence)
  components-b   no family: NFC + Strip(right) normalizers, WhitespaceSplit + Metaspace(never) + Split(String, Removed,
                 invert) + TemplateProcessing with a suffix, decoder Metaspace(never)

Llama-3.x and Qwen2.5/3 (byte-level BPE with a Split regex) are covered by tools/make_fixtures.py, and on
their REAL files by tools/make_real_tokenizer_fixtures.py.
Everything is seeded; running the script twice gives byte-identical files.
"""
import json
import random
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "tokenizers"
sys.path.insert(0, str(REPO_ROOT / "tools"))
from make_fixtures import build_corpus  # noqa: E402  (the shared training corpus)

SPM = "\u2581"  # ▁, SentencePiece's space

O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_level(add_prefix_space, trim_offsets, use_regex):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets,
            "use_regex": use_regex}


def template(prefix, suffix=()):
    single = [{"SpecialToken": {"id": t, "type_id": 0}} for t in prefix]
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    single += [{"SpecialToken": {"id": t, "type_id": 0}} for t in suffix]
    pair = single + [{"Sequence": {"id": "B", "type_id": 1}}]
    return {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": {t: {"id": t, "ids": [None], "tokens": [t]} for t in list(prefix) + list(suffix)}}


SPM_DECODER_LLAMA = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": SPM}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def added(content, special=True, lstrip=False, rstrip=False, normalized=None, single_word=False):
    return {"content": content, "special": special, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": (not special) if normalized is None else normalized, "single_word": single_word}


FAMILIES = {
    "smollm2": {
        "kind": "byte_level", "vocab_size": 900, "specials_first": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "model": {"dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False},
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level(False, True, True)]},
        "post_processor": byte_level(True, False, True),
        "decoder": byte_level(True, True, True),
        "added_tokens": [added("<|endoftext|>"), added("<|im_start|>"), added("<|im_end|>"), added("<repo_name>"),
                         added("<file_sep>")],
        "bos": "<|im_start|>", "eos": "<|im_end|>",
    },
    "phi-4-mini": {
        "kind": "byte_level", "vocab_size": 900, "specials_first": [],
        "model": {"dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False},
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": O200K_PATTERN}, "behavior": "Isolated", "invert": False},
            byte_level(False, False, False)]},
        "post_processor": byte_level(False, True, False),
        "decoder": byte_level(True, True, True),
        "added_tokens": [added("<|endoftext|>"), added("<|system|>"), added("<|end|>"), added("<|user|>"),
                         added("<|assistant|>"), added("<|tool|>"), added("<|/tool|>"), added("<|tool_call|>"),
                         added("<|tag|>")],
        "bos": "<|endoftext|>", "eos": "<|endoftext|>",
    },
    "mistral-v0.3": {
        "kind": "spm", "vocab_size": 700, "specials_first": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]",
                                                           "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"],
        "model": {"dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False},
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": SPM, "prepend_scheme": "first", "split": False},
        "post_processor": template(["<s>"]),
        "decoder": SPM_DECODER_LLAMA,  # transformers' LlamaConverter with legacy=false
        "added_tokens": [added("<unk>"), added("<s>"), added("</s>"), added("[INST]"), added("[/INST]"),
                         added("[TOOL_CALLS]"), added("[AVAILABLE_TOOLS]")],
        "bos": "<s>", "eos": "</s>",
    },
    "phi-3.5": {
        "kind": "spm", "vocab_size": 700, "specials_first": ["<unk>", "<s>", "</s>"],
        "model": {"dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False},
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPM}, {"type": "Replace", "pattern": {"String": " "}, "content": SPM}]},
        "pre_tokenizer": None,
        "post_processor": template(["<s>"]),
        "decoder": SPM_DECODER_LLAMA,
        # Phi-3.5-mini-instruct: the chat tokens strip the whitespace after them (rstrip), <|endoftext|> not.
        "added_tokens": [added("<unk>"), added("<s>"), added("</s>", rstrip=True),
                         added("<|endoftext|>"), added("<|assistant|>", rstrip=True),
                         added("<|placeholder1|>", rstrip=True), added("<|system|>", rstrip=True),
                         added("<|end|>", rstrip=True), added("<|user|>", rstrip=True)],
        "bos": "<s>", "eos": "<|endoftext|>",
    },
    "gemma": {
        "kind": "spm", "vocab_size": 700, "specials_first": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
                                                           "<start_of_turn>", "<end_of_turn>"],
        "model": {"dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False},
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPM},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": template(["<bos>"]),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPM}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        # Gemma 2/3 mark their chat and image tokens special; the tab/whitespace runs are plain added tokens
        # that are matched as written (normalized false).
        "added_tokens": [added("<pad>"), added("<eos>"), added("<bos>"), added("<unk>"), added("<mask>"),
                         added("<start_of_turn>"), added("<end_of_turn>"), added("<start_of_image>"),
                         added("<image_soft_token>"), added("\t\t", special=False, normalized=False),
                         added(SPM * 4, special=False, normalized=False)],
        "bos": "<bos>", "eos": "<eos>",
    },
    # REAL vocabularies: Mistral's own SentencePiece models, shipped in the `mistral-common` wheel on PyPI
    # (pip install --no-deps mistral-common==1.13.1), converted as transformers' LlamaConverter does
    # (SentencePieceExtractor for vocab + merges; control pieces become special added tokens).
    "mistral-v0.3-real": {
        "kind": "sentencepiece", "spm": "mistral_instruct_tokenizer_240323.model.v3",  # Mistral 7B v0.3
        "model": {"dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False},
        "normalizer": None,  # legacy=false
        "pre_tokenizer": {"type": "Metaspace", "replacement": SPM, "prepend_scheme": "first", "split": False},
        "post_processor": template(["<s>"]),
        "decoder": SPM_DECODER_LLAMA,
        "bos": "<s>", "eos": "</s>",
    },
    "mistral-v0.1-real": {
        "kind": "sentencepiece", "spm": "tokenizer.model.v1",  # Mistral 7B v0.1: the Llama-2 legacy pipeline
        "model": {"dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False},
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPM}, {"type": "Replace", "pattern": {"String": " "}, "content": SPM}]},
        "pre_tokenizer": None,
        "post_processor": template(["<s>"]),
        "decoder": SPM_DECODER_LLAMA,
        "bos": "<s>", "eos": "</s>",
    },
    "components-a": {
        "kind": "spm", "vocab_size": 600, "specials_first": ["<unk>", "<s>", "</s>"],
        "model": {"dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": True},
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Strip", "strip_left": True, "strip_right": True},
            {"type": "NFKC"}, {"type": "Lowercase"},
            {"type": "Replace", "pattern": {"Regex": "[0-9]{4,}"}, "content": "####"},
            {"type": "Replace", "pattern": {"String": "``"}, "content": "\""}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Whitespace"},
            {"type": "Punctuation", "behavior": "Isolated"},
            {"type": "Digits", "individual_digits": False},
            {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithNext", "invert": False},
            {"type": "Split", "pattern": {"Regex": "'"}, "behavior": "MergedWithPrevious", "invert": False},
            {"type": "Split", "pattern": {"Regex": "[aeiou]+"}, "behavior": "Contiguous", "invert": True},
            {"type": "Metaspace", "replacement": SPM, "prepend_scheme": "always", "split": True}]},
        "post_processor": {"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 1],
                           "trim_offsets": True, "add_prefix_space": False},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": SPM, "prepend_scheme": "always", "split": True},
            {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 0, "stop": 1}]},
        "added_tokens": [added("<unk>"), added("<s>"), added("</s>"),
                         added("<mask>", lstrip=True), added("[sw]", special=False, single_word=True),
                         added("Hello", special=False, normalized=True),
                         added("<raw>", special=False, normalized=False, lstrip=True, rstrip=True)],
        "bos": "<s>", "eos": "</s>",
    },
    "components-b": {
        "kind": "spm", "vocab_size": 600, "specials_first": ["<unk>", "<s>", "</s>"],
        "model": {"dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": False, "ignore_merges": False},
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "Strip", "strip_left": False, "strip_right": True}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"},
            {"type": "Split", "pattern": {"String": "."}, "behavior": "Removed", "invert": False},
            {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": True},
            {"type": "Metaspace", "replacement": SPM, "prepend_scheme": "never", "split": False}]},
        "post_processor": template(["<s>"], ["</s>"]),
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": SPM, "prepend_scheme": "never", "split": False},
            {"type": "Fuse"}, {"type": "Strip", "content": "x", "start": 2, "stop": 1}]},
        "added_tokens": [added("<unk>"), added("<s>"), added("</s>"), added("<sep>", rstrip=True)],
        "bos": "<s>", "eos": "</s>",
    },
}


def convert_sentencepiece(family):
    """A real SentencePiece BPE model from the mistral-common wheel, as transformers converts it."""
    import importlib.resources

    from tokenizers import Tokenizer, models
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    spec = FAMILIES[family]
    path = str(importlib.resources.files("mistral_common") / "data" / spec["spm"])
    extracted = SentencePieceExtractor(path).extract(models.BPE)
    vocab, merges = extracted["vocab"], extracted["merges"]
    # LlamaConverter names ids 0-2 by the tokenizer's own unk/bos/eos; these models spell them the same.
    assert [t for t, i in sorted(vocab.items(), key=lambda x: x[1])[:3]] == ["<unk>", "<s>", "</s>"]
    specials = ["<unk>", "<s>", "</s>"] + [a.content for a in extracted["additional_special_tokens"]
                                           if a.special and a.content not in ("<unk>", "<s>", "</s>")]
    post = json.loads(json.dumps(spec["post_processor"]))
    for name, entry in post["special_tokens"].items():
        entry["ids"] = [vocab[name]]
    out = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab[c], **added(c)} for c in specials],
        "normalizer": spec["normalizer"], "pre_tokenizer": spec["pre_tokenizer"], "post_processor": post,
        "decoder": spec["decoder"],
        "model": {"type": "BPE", **spec["model"], "vocab": vocab, "merges": [list(m) for m in merges]},
    }
    spec["added_tokens"] = [added(c) for c in specials]
    text = json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n"  # compact: 1.3 MB
    Tokenizer.from_str(text)
    return text


def train(family):
    """Train the family's vocabulary and return its tokenizer.json object wired like the real family."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    spec = FAMILIES[family]
    if spec["kind"] == "sentencepiece":
        return convert_sentencepiece(family)
    corpus = build_corpus()
    if spec["kind"] == "byte_level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(vocab_size=spec["vocab_size"], min_frequency=2, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM, prepend_scheme="always", split=True)
        if family == "components-a":  # its normalizer lowercases: train on what the model will see
            corpus = [t.lower() for t in corpus]
        # A small alphabet, so that rarer characters (CJK, emoji) go through byte fallback or <unk>.
        trainer = trainers.BpeTrainer(vocab_size=spec["vocab_size"], min_frequency=2, show_progress=False,
                                      limit_alphabet=90, special_tokens=[])
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    data = json.loads(tokenizer.to_str())
    trained = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])

    # The vocabulary in the family's order: its leading special tokens, the 256 byte tokens of byte_fallback
    # families, then what training learned.
    vocab = {}
    for content in spec["specials_first"]:
        vocab[content] = len(vocab)
    if spec["model"]["byte_fallback"]:
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in trained:
        if token not in vocab:
            vocab[token] = len(vocab)
    if family == "components-a":  # a vocabulary word no merge builds: ignore_merges emits it whole
        vocab[SPM + "xylophone"] = len(vocab)
    added_tokens = []
    for entry in spec["added_tokens"]:
        content = entry["content"]
        if content not in vocab:
            vocab[content] = len(vocab)
        added_tokens.append({"id": vocab[content], **entry})
    post = json.loads(json.dumps(spec["post_processor"]))
    if post and post["type"] == "TemplateProcessing":
        for name, entry in post["special_tokens"].items():
            entry["ids"] = [vocab[name]]
    out = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": spec["normalizer"],
        "pre_tokenizer": spec["pre_tokenizer"],
        "post_processor": post,
        "decoder": spec["decoder"],
        "model": {"type": "BPE", **spec["model"], "vocab": vocab, "merges": data["model"]["merges"]},
    }
    text = json.dumps(out, indent=1, ensure_ascii=False) + "\n"
    Tokenizer.from_str(text)  # must load
    return text


def case_strings(family):
    spec = FAMILIES[family]
    specials = [e["content"] for e in spec["added_tokens"] if e["special"]]
    plain = [e["content"] for e in spec["added_tokens"] if not e["special"]]
    a, b = specials[1], specials[-1]
    cases = [
        "", "Hello world", " Hello world", "Hello  world", "hello", "  leading and trailing  ",
        "The lighthouse keeper climbed the spiral stairs every evening at dusk.",
        "A completely unseen sentence about zebras, quizzical jazz and wobbly xylophones.",
        "UPPER lower MiXeD CamelCase snake_case kebab-case",
        "I can't, you won't, they're, we've, I'm, she'll, he'd",
        "12 123 1234 12345 1234567 3.14159 -42 0x1F 1,024.5 2024-07-26 a1b22c333",
        "٣٤٥ ① Ⅻ ½ ² ¹²³",
        " ", "   ", "\t", "\n", "\n\n\n", "a  b   c    d", "word     ", "\tindented\twith\ttabs\t\t",
        "line one\nline two\n\nline four", "windows\r\nline\r\nendings\r\n", "mixed \t \n \r\n  end",
        "\u00a0non-breaking\u2003em-space\u3000ideographic",
        "def f(x):\n    return x**2 + 1\n", '{"key": [1, 2, 3], "nested": {"ok": true}}',
        "Hello, world! How are you? Fine... thanks; really: yes. ``quote'' --- (a) [b] {c}",
        "机器学习是人工智能的一个分支。", "日本語の文章です。カタカナ ひらがな", "안녕하세요 Привет мир مرحبا",
        "😀", "I love it 😂🚀🎉 so much", "👍🏽 ❤️ 🇫🇷 👩‍💻",
        "e\u0301", "cafe\u0301 vs caf\u00e9", "A\u030a n\u0303 u\u0308 c\u0327", "\u212b \u2126 \ufb01 ＡＢＣ１２３ ㍿",
        "İstanbul ΣΑΣ Straße ǅ",
        # invalid-looking: spellings of pieces of the machinery itself
        "<0xE2><0x82> <0x41> <unk> \\xff\\xfe \ufffd \u2581\u2581two\u2581marks \u2581",
        "<s> </s> <s", "[INST] not special [/INST", "<|im_start|", "Ġ Ċ âĢĻ",
        "\x00\x01\x7f control",
        a, f"{a}hello{b}", f"before {a} middle {b} after", f"{a}{a}{b}", f"  {a}  spaced  {b}  ",
        f"{a}\n\nnewlines after", f"text{b}\n",
        " xylophone xylophones",
    ]
    for token in plain:
        cases += [token, f"x{token}y", f"a {token} b", f" {token}  {token} "]
    if family == "components-a":
        cases += ["<mask>", "a   <mask> b", "[sw] x[sw] [sw]y x [sw] y", "HELLO hello Hello", "a<raw>b  <raw>  c"]
    if family == "components-b":
        cases += ["a.b.c 1.2.3 x. .y", "<sep>   next", "trailing   "]
    return cases


def hf_decode(raw, ids, skip):
    """Tokenizer.decode, or None where `tokenizers` itself panics (its Strip decoder indexes out of bounds on
    a token shorter than its stop count); kvlite returns the stripped text there and the test skips it."""
    try:
        return raw.decode(ids, skip_special_tokens=skip)
    except BaseException as error:  # pyo3_runtime.PanicException derives from BaseException
        if type(error).__name__ != "PanicException":
            raise
        return None


def decode_cases(family, raw, cases):
    """Id runs a decoder must get right: slices that cut characters, lone byte-fallback tokens, specials."""
    out = []
    vocab = raw.get_vocab()
    runs = []
    for text in ["😀", "机器学习", "I love it 😂🚀", "Größe", " Hello world", "a  b"]:
        ids = raw.encode(text, add_special_tokens=False).ids
        for begin, end in [(0, 1), (1, len(ids)), (0, len(ids) - 1), (len(ids) - 1, len(ids))]:
            if 0 <= begin < end <= len(ids):
                runs.append(ids[begin:end])
    for names in (["<0xE2>", "<0x82>", "<0xAC>"], ["<0xE2>", "<0x82>"], ["<0x41>", "<0xFF>", "<0x42>"],
                  ["<0xF0>"], ["<0x20>", "<0x41>"]):
        if all(n in vocab for n in names):
            runs.append([vocab[n] for n in names])
    specials = [e["content"] for e in FAMILIES[family]["added_tokens"] if e["special"]]
    word = raw.encode("Hello world", add_special_tokens=False).ids
    runs.append([vocab[specials[1]]] + word + [vocab[specials[-1]]])
    runs.append(word + [vocab[specials[0]]] + word)
    if "<0xE2>" in vocab:
        runs.append([vocab["<0xE2>"]] + word + [vocab["<0x82>"], vocab["<0xAC>"]])
    # Long runs of one short token: a streaming decoder's context must outlast a Strip's start after Fuse
    # (components-b strips two leading 'x'; the libFuzzer harness found "x" * 33 + "\x01" streaming wrong).
    # and runs of <0xXX> tokens longer than the streaming decoder holds (64): emoji and control characters that
    # a byte-fallback vocabulary spells byte by byte (the harness found "\x01" + 62 NULs + "━nd" wrong).
    for text in ["x" * 33 + "\x01", "   three spaces", "x", "\U0001F99C" * 40 + " ok", "\x01" + "\x00" * 62 + "\u2501nd",
                 "a" + "\ufffd" * 30 + "b"]:
        runs.append(raw.encode(text, add_special_tokens=False).ids)
    for ids in runs:
        out.append({"ids": ids, "decoded": hf_decode(raw, ids, False),
                    "decoded_skip_special": hf_decode(raw, ids, True)})
    return out


def make_family(family):
    import tokenizers
    from tokenizers import Tokenizer

    directory = FIXTURES / family
    directory.mkdir(parents=True, exist_ok=True)
    text = train(family)
    spec = FAMILIES[family]
    config = {"bos_token": spec["bos"], "eos_token": spec["eos"],
              "model_max_length": 8192, "tokenizer_class": "PreTrainedTokenizerFast"}
    config_text = json.dumps(config, indent=1) + "\n"
    if spec["kind"] == "sentencepiece":
        # The real 32k vocabularies are 1.3-1.4 MB of JSON: kept as tokenizer.tar.xz (a fifth of that), which
        # tests/CMakeLists.txt unpacks into the build directory.
        from make_real_tokenizer_fixtures import write_archive
        write_archive(directory / "tokenizer.tar.xz", {"tokenizer.json": text.encode("utf-8"),
                                                       "tokenizer_config.json": config_text.encode("utf-8")})
    else:
        (directory / "tokenizer.json").write_text(text, encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    raw = Tokenizer.from_str(text)
    cases = []
    for case in case_strings(family):
        ids = raw.encode(case, add_special_tokens=False).ids
        ids_special = raw.encode(case, add_special_tokens=True).ids
        cases.append({"text": case, "ids": ids, "ids_with_special": ids_special,
                      "decoded": hf_decode(raw, ids_special, False),
                      "decoded_skip_special": hf_decode(raw, ids_special, True)})
    truth = {
        "family": family,
        "generator": "tools/make_tokenizer_family_fixtures.py",
        "tokenizers_version": tokenizers.__version__,
        "stand_in": FAMILIES[family]["kind"] != "sentencepiece",
        "source": ("mistral-common 1.13.1 mistral_common/data/" + FAMILIES[family]["spm"]
                   if FAMILIES[family]["kind"] == "sentencepiece" else "trained here"),
        "vocab_size": raw.get_vocab_size(with_added_tokens=True),
        "notes": ["ids / ids_with_special: tokenizers.Tokenizer.encode(text, add_special_tokens=False / True).ids",
                  "decoded / decoded_skip_special: Tokenizer.decode(ids_with_special, skip_special_tokens=False / "
                  "True)",
                  "decode_cases: Tokenizer.decode of id runs (slices cutting characters, byte-fallback runs)"],
        "cases": cases,
        "decode_cases": decode_cases(family, raw, cases),
    }
    (directory / "cases.json").write_text(json.dumps(truth, indent=1, ensure_ascii=False) + "\n",
                                          encoding="utf-8")


def main():
    random.seed(0)
    families = sys.argv[1:] or list(FAMILIES)
    for family in families:
        make_family(family)
        print("wrote", FIXTURES / family)


if __name__ == "__main__":
    main()
