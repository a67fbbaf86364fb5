#!/usr/bin/env python3
"""Make kvlite's external-truth fixtures with Hugging Face `tokenizers` and `transformers`.

kvlite's C++ tests compare against files made here, so that the expected values come from the reference
implementation rather than from us. Nothing in `make test` runs Python: the outputs are committed under
tests/fixtures/ and this script only regenerates them (see tools/README.md for the environment).

    tools/make_fixtures.py                  # everything
    tools/make_fixtures.py tokenizers       # step 1: tests/fixtures/tokenizers/{llama3,qwen2}/
    tools/make_fixtures.py models           # step 2: tests/fixtures/models/tiny-{llama3,qwen2,qwen3}/

Step 1 trains two small byte-level BPE tokenizers on a built-in corpus, each wired exactly like the real
family (normalizer, pre-tokenizer regex, ByteLevel settings, post-processor, decoder, added tokens, chat
template), then records what transformers' AutoTokenizer does with them (cases.json).

Step 2 builds three tiny random models with transformers' own classes, saves them with save_pretrained
(safetensors; one model per dtype: BF16, F32, F16) and records float32 reference outputs (reference.json and
logits_<k>.npy): logits, greedy continuations, prompt log-probs and the perplexity guide's sliding window.

Everything is seeded; running the script twice gives byte-identical files.
"""

import argparse
import copy
import json
import math
import random
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures"

# ---------------------------------------------------------------------------------------------------------
# Tokenizer families: every setting below is copied from the real tokenizer.json / tokenizer_config.json
# (Meta-Llama-3.1-8B-Instruct and Qwen2.5-*-Instruct / Qwen3), only the vocabulary is ours.
# ---------------------------------------------------------------------------------------------------------

# Llama 3 (meta-llama/llama3 tokenizer.py pat_str; the same string sits in the Split of Llama-3.x
# tokenizer.json): digits are cut in runs of at most three.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 / Qwen2.5 / Qwen3 (transformers' tokenization_qwen2.PRETOKENIZE_REGEX and the Split in their
# tokenizer.json): identical to Llama 3's except that digits are cut one at a time.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Meta-Llama-3.1-8B-Instruct's chat template, verbatim. It has a fixed date ("26 Jul 2024") unless the
# caller passes date_string, so it renders the same on any day (Llama 3.2's calls strftime_now instead).
LLAMA3_CHAT_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen2.5-*-Instruct's chat template, verbatim (a default system message when none is given).
QWEN2_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _byte_level(add_prefix_space, trim_offsets, use_regex):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets,
            "use_regex": use_regex}


def _split(pattern):
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


FAMILIES = {
    "llama3": {
        "vocab_size": 1500,  # trained BPE entries (256 bytes + merges); added tokens come after
        "merges_as_strings": True,  # "a b", as in Meta's files (tokenizers >= 0.20 writes ["a", "b"])
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence",
                          "pretokenizers": [_split(LLAMA3_PATTERN), _byte_level(False, True, False)]},
        # Llama-3.1's post-processor: a no-op ByteLevel, then BOS in front of every sequence.
        "post_processor": {"type": "Sequence", "processors": [
            _byte_level(True, False, True),
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": None,  # filled in
                                                      "tokens": ["<|begin_of_text|>"]}}}]},
        "decoder": _byte_level(True, True, True),
        "model_flags": {"dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                        "ignore_merges": True},
        # (content, special) in id order, as in Llama-3.1 (whose reserved tokens we leave out).
        "added_tokens": [("<|begin_of_text|>", True), ("<|end_of_text|>", True),
                         ("<|start_header_id|>", True), ("<|end_header_id|>", True),
                         ("<|eom_id|>", True), ("<|eot_id|>", True), ("<|python_tag|>", True)],
        "chat_template": LLAMA3_CHAT_TEMPLATE,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    },
    "qwen2": {
        "vocab_size": 1400,
        "merges_as_strings": False,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence",
                          "pretokenizers": [_split(QWEN2_PATTERN), _byte_level(False, False, False)]},
        "post_processor": _byte_level(False, False, False),
        "decoder": _byte_level(False, False, False),
        "model_flags": {"dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                        "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                        "ignore_merges": False},
        # Qwen2.5-VL's special tokens, then the tool/think markers that real Qwen files add as NON-special
        # tokens (matched whole when encoding, kept when decoding with skip_special_tokens).
        "added_tokens": [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                         ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
                         ("<|image_pad|>", True), ("<|video_pad|>", True),
                         ("<tool_call>", False), ("</tool_call>", False), ("<think>", False),
                         ("</think>", False)],
        "chat_template": QWEN2_CHAT_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
    },
}

# ---------------------------------------------------------------------------------------------------------
# The training corpus: written here so that the vocabulary never depends on a download.
# ---------------------------------------------------------------------------------------------------------

PROSE = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. He didn't mind the wind, and he'd
long ago stopped counting the steps: there were one hundred and twelve of them, or so the old logbook said.
When the lamp was lit, its beam swept across the harbour, the fishing boats, and the sleeping town.
It's a quiet life, she wrote in her letter, but we're happy here, and you'll always be welcome.
They've repaired the bridge; I'm told the new road will open in the spring. We'll see.
Scientists measured the temperature of the lake at dawn and at noon, and the difference surprised them.
A small model can still learn a great deal from a large amount of text, if the text is clean and varied.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
"Where are you going?" asked the child. "To the market," her father said, "and then home again."
Memory is the scarce resource: weights, activations and the key-value cache all compete for it.
Each request gets its own pages, and pages are returned to the pool as soon as the request finishes.
The recipe calls for 250 g of flour, 3 eggs, 1.5 cups of milk and a pinch of salt (about 0.5 g).
On 2024-07-26 the train left at 09:45 and arrived at 13:07, which is 3 hours and 22 minutes later.
Prices rose by 4.7% in March; the index went from 1,024.5 to 1,072.66 points.
Call +1 (555) 010-9999 or write to help@example.com before 31/12/2025.
I can't believe it isn't raining. You shouldn't have. They'd've known. Y'all're late. It's HIS book, isn't IT?
Rock 'n' roll, ma'am, o'clock, the dogs' bowls and the cat's toy.
    Indented lines keep their spaces,
\tand tabs are kept as well.
Lines can end with Windows newlines.\r\nLike this one.\r\n
Multiple   spaces    between     words and trailing spaces   
"""

CODE = """\
def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Cache:
    def __init__(self, capacity=1024):
        self.capacity = capacity
        self.items = {}

    def get(self, key, default=None):
        return self.items.get(key, default)

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
    std::vector<float> logits(32000, 0.0f);
    for (size_t i = 0; i < logits.size(); ++i) {
        logits[i] = static_cast<float>(i) * 1e-3f;
    }
    printf("%d tokens, argmax=%zu\\n", argc, logits.size() - 1);
    return 0;
}

{"name": "kvlite", "version": "0.1.0", "layers": [0, 1, 2], "dtype": "bfloat16", "ok": true}
SELECT id, name FROM users WHERE age >= 18 AND city = 'Paris' ORDER BY name;
x = a**2 + b**2 - 2*a*b*cos(theta)  # law of cosines
if (x != y && y <= z || !flag) { return -1; } else { x += 0x1F; y >>= 2; }
let total = items.iter().map(|v| v * 2).sum::<u64>();
<html><body><p class="note">Hello &amp; welcome</p></body></html>
"""

MULTILINGUAL = """\
机器学习是人工智能的一个分支。我们今天去公园散步，天气很好。
这个模型可以在小显卡上运行，内存不够时会提前告诉你。
日本語の文章も少し入れておきます。東京は雨でした。ありがとうございます。
カタカナとひらがなと漢字が混ざっています。
Le café est très bon, mais la crème brûlée est meilleure. Où est la gare ? À bientôt, Hélène !
Über den Wolken muss die Freiheit wohl grenzenlos sein. Größe, Straße, Äpfel, Öl, Übung.
El niño comió piña en el año nuevo. ¿Cómo estás? ¡Muy bien, señora!
Ação, coração, não, São Paulo. Þetta er íslenska. Łódź, Kraków, żółć. Čeština: příliš žluťoučký kůň.
Tiếng Việt có nhiều dấu: người, được, những, thường.
Привет, мир! Это пример текста на русском языке. Москва, Санкт-Петербург, ёлка.
Україна, Київ, їжак, ґанок. Български език.
مرحبا بالعالم. هذه جملة باللغة العربية. شكرا جزيلا.
שלום עולם. Γειά σου κόσμε, αλφάβητο. नमस्ते दुनिया। 안녕하세요 세계.
Emoji: 😀 😂 🚀 🎉 👍🏽 ❤️ 🇫🇷 🇯🇵 👩‍💻 👨‍👩‍👧‍👦 ✨ 🔥 ✅
Combining marks: e\u0301 a\u0300 o\u0302 n\u0303 u\u0308 c\u0327 A\u030a, Zalgo: Z\u0351\u0317a\u0346l\u0350g\u0313o\u0334
Symbols: © ® ™ € £ ¥ ° ± × ÷ ≤ ≥ ≠ ∞ √ π Σ → ← ↑ ↓ • … — – « » “ ” ‘ ’
"""

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact memory token model layer cache kernel page block "
         "request batch prompt answer image vision text model weight scale value query key").split()
MORE_WORDS = ("agréable über señor déjà naïve façade coöperate résumé 北京 上海 学习 東京 大阪 "
              "Москва Київ مدينة κόσμος").split()


def build_corpus():
    """The training corpus: fixed passages plus seeded synthetic sentences (numbers, dates, word mixes)."""
    rng = random.Random(20240726)
    lines = (PROSE + CODE + MULTILINGUAL).splitlines(keepends=True)
    texts = [PROSE, CODE, MULTILINGUAL] * 6
    for _ in range(1500):
        words = [rng.choice(WORDS if rng.random() < 0.85 else MORE_WORDS) for _ in range(rng.randint(3, 12))]
        sentence = " ".join(words).capitalize()
        kind = rng.random()
        if kind < 0.2:
            sentence += f" {rng.randint(0, 10**rng.randint(1, 7))}"
        elif kind < 0.3:
            sentence += f" {rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        elif kind < 0.4:
            sentence += f" {rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f}"
        elif kind < 0.5:
            sentence = f"{rng.choice(['I', 'You', 'We', 'They', 'She'])}'{rng.choice(['ll', 've', 're', 'd', 's', 'm'])} " + sentence.lower()
        texts.append(sentence + rng.choice([".", "!", "?", ",", ";", ":", "...", ".\n", "\n\n", "\r\n", "\t"]))
        if rng.random() < 0.3:
            texts.append(rng.choice(lines))
    return texts


# ---------------------------------------------------------------------------------------------------------
# Step 1: tokenizers
# ---------------------------------------------------------------------------------------------------------

# Byte-level spellings (Ġ is the space byte) of the vocabulary-only words added to both families.
MERGELESS_WORDS = ["Ġxylophones", "Ġquizzical", "zebra"]


def train_tokenizer(family):
    """Train the family's byte-level BPE and return its tokenizer.json text with the real settings."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            trainers)

    spec = FAMILIES[family]
    pattern = LLAMA3_PATTERN if family == "llama3" else QWEN2_PATTERN
    tokenizer = Tokenizer(models.BPE())
    if spec["normalizer"] is not None:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec["vocab_size"], min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tokenizer.train_from_iterator(build_corpus(), trainer=trainer)

    # Replace every pipeline stage with the exact JSON of the real files (the Python setters do not expose
    # all the flags, e.g. trim_offsets), then add the special tokens after the learned vocabulary.
    data = json.loads(tokenizer.to_str())
    model = data["model"]
    vocab = model["vocab"]
    # Whole words that no merge builds. A trained vocabulary never has them (every entry is the result of
    # its own merge), but converted ones do (Llama 3's comes from tiktoken ranks): with ignore_merges=true
    # (llama3) such a pre-token is emitted as one id, with ignore_merges=false (qwen2) merges decide.
    for word in MERGELESS_WORDS:
        vocab[word] = len(vocab)
    data["model"] = {"type": "BPE", **spec["model_flags"], "vocab": vocab, "merges": model["merges"]}
    data["normalizer"] = spec["normalizer"]
    data["pre_tokenizer"] = spec["pre_tokenizer"]
    data["post_processor"] = None
    data["decoder"] = spec["decoder"]
    data["added_tokens"] = []
    tokenizer = Tokenizer.from_str(json.dumps(data))

    for content, special in spec["added_tokens"]:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                           special=special)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])

    data = json.loads(tokenizer.to_str())
    post = copy.deepcopy(spec["post_processor"])
    if family == "llama3":
        bos = spec["bos_token"]
        post["processors"][1]["special_tokens"][bos]["ids"] = [tokenizer.token_to_id(bos)]
    data["post_processor"] = post
    if spec["merges_as_strings"]:
        data["model"]["merges"] = [f"{left} {right}" for left, right in data["model"]["merges"]]
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    Tokenizer.from_str(text)  # must still load
    return text


def tokenizer_config(family, tokenizer_json):
    """tokenizer_config.json in the shape of the real family's file."""
    spec = FAMILIES[family]
    data = json.loads(tokenizer_json)
    added = {str(t["id"]): {"content": t["content"], "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": t["special"]} for t in data["added_tokens"]}
    if family == "llama3":  # Meta-Llama-3.1-8B-Instruct
        return {
            "added_tokens_decoder": added,
            "bos_token": spec["bos_token"],
            "chat_template": spec["chat_template"],
            "clean_up_tokenization_spaces": True,
            "eos_token": spec["eos_token"],
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    return {  # Qwen2.5-*-Instruct
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, special in spec["added_tokens"]
                                      if special and c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": spec["chat_template"],
        "clean_up_tokenization_spaces": False,
        "eos_token": spec["eos_token"],
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def case_strings(family):
    """(category, text) pairs covering what a byte-level BPE can get wrong."""
    specials = [c for c, _ in FAMILIES[family]["added_tokens"]]
    first, second = specials[1], specials[2]
    cases = [
        ("empty", ""),
        ("prose", "Hello world"),
        ("prose", "The lighthouse keeper climbed the spiral stairs every evening at dusk."),
        ("prose", "A completely unseen sentence about zebras, quizzical jazz and wobbly xylophones."),
        ("mergeless_vocab", "zebra quizzical xylophones"),
        ("mergeless_vocab", " xylophones zebra zebras"),
        ("prose", " leading space"),
        ("prose", "trailing space "),
        ("prose", "UPPER lower MiXeD CamelCase snake_case kebab-case"),
        ("contractions", "I can't, you won't, they're, we've, I'm, she'll, he'd"),
        ("contractions", "IT'S HIS, WE'LL SEE, YOU'VE, THEY'D, I'M, SHE'S"),
        ("contractions", "rock 'n' roll, the dogs' bowls, o'clock, 's alone, ''"),
        ("numbers", "1"),
        ("numbers", "12 123 1234 12345 123456 1234567"),
        ("numbers", "3.14159 -42 +7 1e-5 0x1F 1,024.5 50%"),
        ("numbers", "2024-07-26 09:45 v2.15.0"),
        ("numbers", "a1b22c333d4444"),
        ("numbers", "٣٤٥ ① Ⅻ ½ ²"),
        ("whitespace", " "),
        ("whitespace", "   "),
        ("whitespace", "a  b   c    d"),
        ("whitespace", "word     "),
        ("whitespace", "\t"),
        ("whitespace", "\tindented\twith\ttabs"),
        ("whitespace", "    four spaces of indent"),
        ("whitespace", "\n"),
        ("whitespace", "\n\n\n"),
        ("whitespace", "line one\nline two\n\nline four"),
        ("whitespace", "windows\r\nline\r\nendings\r\n"),
        ("whitespace", "mixed \t \n \r\n  end"),
        ("whitespace", "  \n  indented after newline"),
        ("whitespace", "\u00a0non-breaking\u2003em-space\u3000ideographic"),
        ("code", "def f(x):\n    return x**2 + 1\n"),
        ("code", "for (int i = 0; i < n; ++i) { sum += a[i]; }"),
        ("code", '{"key": [1, 2, 3], "nested": {"ok": true}}'),
        ("code", "if (a != b && c <= d || !e) x >>= 2;"),
        ("code", "<html><body class=\"x\">&amp;</body></html>"),
        ("punctuation", "Hello, world! How are you? Fine... thanks; really: yes."),
        ("punctuation", "!!!??? ... --- *** ### @@@"),
        ("punctuation", "\"quoted\" 'single' (parens) [brackets] {braces}"),
        ("chinese", "机器学习是人工智能的一个分支。"),
        ("chinese", "我们今天去公园散步，天气很好。量子计算"),
        ("japanese", "日本語の文章です。東京は雨でした。"),
        ("japanese", "カタカナ ひらがな 漢字"),
        ("latin_accents", "Le café est très bon, crème brûlée, Hélène, déjà vu"),
        ("latin_accents", "Größe Straße Äpfel Öl Übung; niño piña señor; ação coração; Łódź żółć"),
        ("latin_accents", "Tiếng Việt: người, được, những"),
        ("cyrillic", "Привет, мир! Это пример текста."),
        ("cyrillic", "Україна, Київ, їжак, ґанок"),
        ("arabic", "مرحبا بالعالم. شكرا جزيلا."),
        ("other_scripts", "שלום Γειά σου नमस्ते 안녕하세요"),
        ("emoji", "😀"),
        ("emoji", "I love it 😂🚀🎉 so much"),
        ("emoji", "👍🏽 ❤️ 🇫🇷 👩‍💻 👨‍👩‍👧‍👦"),
        ("combining", "e\u0301"),
        ("combining", "cafe\u0301 vs caf\u00e9"),
        ("combining", "A\u030a n\u0303 u\u0308 c\u0327 o\u0302"),
        ("combining", "Z\u0351\u0317a\u0346l\u0350g\u0313o\u0334"),
        ("combining", "\u212b \u2126 \ufb01"),  # NFC maps Angstrom and Ohm to letters; NFC keeps the fi ligature
        ("special_tokens", first),
        ("special_tokens", f"{first}hello{second}"),
        ("special_tokens", f"before {first} middle {second} after"),
        ("special_tokens", f"{first}{first}{second}"),
        ("special_tokens", f"not special: <|{first[2:-2]}| and |{first[2:-2]}|>"),
        ("special_tokens", f"{specials[0]}text"),
    ]
    non_special = [c for c, special in FAMILIES[family]["added_tokens"] if not special]
    if non_special:
        cases.append(("added_non_special", f"{non_special[0]}\n{{\"name\": \"f\"}}\n{non_special[1]}"))
        cases.append(("added_non_special", f"{non_special[2]}\nreasoning\n{non_special[3]}\n\nanswer"))
    else:
        cases.append(("added_tokens", "<|eom_id|><|python_tag|>call()"))
    return cases


CHAT_CONVERSATIONS = [
    ("user_only", [{"role": "user", "content": "What is the capital of France?"}]),
    ("system_user", [{"role": "system", "content": "You are a terse assistant."},
                     {"role": "user", "content": "Name three primes."}]),
    ("multi_turn", [{"role": "system", "content": "Answer in one sentence."},
                    {"role": "user", "content": "Hello!"},
                    {"role": "assistant", "content": "Hi, how can I help?"},
                    {"role": "user", "content": "Tell me about lighthouses."}]),
    ("whitespace_content", [{"role": "user", "content": "  padded question with trailing newline\n\n"}]),
    ("multilingual", [{"role": "user", "content": "你好！Привет! ¿Qué tal? 😀"}]),
]


def tokenizer_cases(family, directory):
    """Run transformers' AutoTokenizer on the saved files and record what it does."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    raw = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    cases = []
    for category, text in case_strings(family):
        ids = tok.encode(text, add_special_tokens=False)
        ids_special = tok.encode(text, add_special_tokens=True)
        # The plain tokenizers library must agree with transformers (same file, same pipeline).
        assert raw.encode(text, add_special_tokens=False).ids == ids, (family, text)
        assert raw.encode(text, add_special_tokens=True).ids == ids_special, (family, text)
        decoded = tok.decode(ids, skip_special_tokens=False)
        cases.append({
            "category": category,
            "text": text,
            "ids": ids,
            "ids_with_special": ids_special,
            "tokens": tok.convert_ids_to_tokens(ids),
            "decoded": decoded,
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            "roundtrip": decoded == text,
        })
    # Decoding id runs that cut a character's UTF-8 bytes apart, as a streaming detokenizer sees them: each
    # maximal invalid byte run becomes one U+FFFD.
    decode_cases = []
    for text in ["😀", "机器学习", "I love it 😂🚀", "Größe"]:
        ids = tok.encode(text, add_special_tokens=False)
        for begin, end in [(0, 1), (1, len(ids)), (0, len(ids) - 1), (len(ids) - 1, len(ids))]:
            if 0 <= begin < end <= len(ids) and (begin, end) != (0, len(ids)):
                piece = ids[begin:end]
                decode_cases.append({"from_text": text, "ids": piece,
                                     "decoded": tok.decode(piece, skip_special_tokens=False)})
    chats = []
    for name, messages in CHAT_CONVERSATIONS:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids == tok.encode(text, add_special_tokens=False), (family, name)
        chats.append({"name": name, "messages": messages, "add_generation_prompt": True, "text": text,
                      "ids": ids})
    return {
        "family": family,
        "generator": "tools/make_fixtures.py",
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "vocab_size": len(tok),
        "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
        "pad_token": tok.pad_token, "pad_token_id": tok.pad_token_id,
        "added_tokens": [{"id": tok.convert_tokens_to_ids(c), "content": c, "special": s}
                         for c, s in FAMILIES[family]["added_tokens"]],
        "notes": [
            "ids: tokenizer.encode(text, add_special_tokens=False); ids_with_special: add_special_tokens=True.",
            "decoded / decoded_skip_special: tokenizer.decode(ids, skip_special_tokens=False / True).",
            "roundtrip: decoded == text (false where the normalizer changed the text, e.g. NFC).",
            "decode_cases: tokenizer.decode(ids) of slices of encode(from_text) that split UTF-8 sequences.",
            "chat.text: apply_chat_template(messages, tokenize=False, add_generation_prompt=True); "
            "chat.ids: the same with tokenize=True (== encode(text, add_special_tokens=False)).",
        ],
        "cases": cases,
        "decode_cases": decode_cases,
        "chat": chats,
    }


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(family, directory):
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_json = train_tokenizer(family)
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    write_json(directory / "tokenizer_config.json", tokenizer_config(family, tokenizer_json))


def make_tokenizers():
    for family in FAMILIES:
        directory = FIXTURES / "tokenizers" / family
        write_tokenizer_files(family, directory)
        write_json(directory / "cases.json", tokenizer_cases(family, directory))
        print(f"wrote {directory.relative_to(REPO_ROOT)}")


# ---------------------------------------------------------------------------------------------------------
# Step 2: tiny random models and their float32 reference outputs
# ---------------------------------------------------------------------------------------------------------

# Each model is stored in a different dtype so that kvlite's BF16, F32 and F16 loaders all read a real file.
# Shapes are tiny but not degenerate: GQA (4 query heads over 2 KV heads), an intermediate size that is not a
# power of two, and for qwen3 a head_dim (32) that is not hidden_size / num_attention_heads (16).
MODELS = {
    "tiny-llama3": {
        "family": "llama3",
        "dtype": "bfloat16",
        "seed": 1001,
        "config": dict(
            hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            # Llama-3.1's scaling with original_max_position_embeddings shrunk to 64, so that at head_dim 16
            # the fixture's short prompts see all three regimes: high frequencies kept, low ones divided by
            # factor, and the smoothed band between (wavelengths 16..64).
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}),
        # Llama-3.1-Instruct: eos is any of end_of_text, eom_id, eot_id.
        "bos": "<|begin_of_text|>", "eos": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "pad": None,
    },
    "tiny-qwen2": {
        "family": "qwen2",
        "dtype": "float32",
        "seed": 1002,
        "config": dict(
            hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
            use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Qwen2.5-Instruct: config eos is im_end; generation stops on im_end or endoftext.
        "bos": "<|endoftext|>", "eos": ["<|im_end|>"], "generation_eos": ["<|im_end|>", "<|endoftext|>"],
        "pad": "<|endoftext|>",
    },
    "tiny-qwen3": {
        "family": "qwen2",
        "dtype": "float16",
        "seed": 1003,
        "config": dict(
            hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "bos": "<|endoftext|>", "eos": ["<|im_end|>"], "generation_eos": ["<|im_end|>", "<|endoftext|>"],
        "pad": "<|endoftext|>",
    },
}

PLAIN_PROMPTS = [
    ("plain_short", "The quick brown fox jumps over the lazy dog."),
    ("plain_mixed", "It's 4.7% café! 🚀"),
]
CHAT_PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
GREEDY_NEW_TOKENS = 16

# About 300 tokens for the perplexity guide's sliding window (context 64, stride 32: 9-10 windows).
PERPLEXITY_TEXT = """\
The harbour was quiet when the fishing boats came home. Each evening the keeper lit the lamp, wrote the \
weather in the logbook and counted the ships that passed: twelve on Monday, nine on Tuesday, and only three \
when the storm arrived. "We'll wait," he said. "The sea doesn't care about our plans."
def mean(values):
    return sum(values) / len(values) if values else 0.0
Memory is the scarce resource: weights, activations and the key-value cache all compete for it, and every \
request needs its own pages. When a request finishes, its pages go back to the pool. In the town, the \
baker mixed 250 g of flour with water, salt and yeast at four in the morning. \
Le café est très bon. Привет, мир! 机器学习 😀
"""
PERPLEXITY_CONTEXT = 64
PERPLEXITY_STRIDE = 32


def randomize_weights(model, seed):
    """Seeded weights large enough that logits are far from flat (transformers' init uses std 0.02).

    Norm gains and biases are random too (not 1 and 0), so a runtime that skips one of them gets different
    numbers.
    """
    import torch
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                parameter.copy_(0.2 * noise)
            else:  # embeddings (also the tied lm_head of the qwen models) and every projection
                parameter.copy_(0.25 * noise)


def build_model(name, directory):
    """Create the model with transformers' own class, randomize it and save it in its on-disk dtype."""
    import torch
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    spec = MODELS[name]
    tokenizer_dir = FIXTURES / "tokenizers" / spec["family"]
    vocab = json.loads((tokenizer_dir / "cases.json").read_text(encoding="utf-8"))["vocab_size"]
    token_ids = {t["content"]: t["id"] for t in
                 json.loads((tokenizer_dir / "cases.json").read_text(encoding="utf-8"))["added_tokens"]}
    eos = [token_ids[t] for t in spec["eos"]]
    config_class, model_class = {
        "tiny-llama3": (LlamaConfig, LlamaForCausalLM),
        "tiny-qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "tiny-qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[name]
    config = config_class(vocab_size=vocab, bos_token_id=token_ids[spec["bos"]],
                          eos_token_id=eos if len(eos) > 1 else eos[0],
                          pad_token_id=token_ids[spec["pad"]] if spec["pad"] else None, **spec["config"])
    torch.manual_seed(spec["seed"])
    model = model_class(config)
    randomize_weights(model, spec["seed"])
    generation_eos = [token_ids[t] for t in spec.get("generation_eos", spec["eos"])]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=generation_eos,
        pad_token_id=config.pad_token_id)
    model = model.to(getattr(torch, spec["dtype"]))
    if directory.exists():
        shutil.rmtree(directory)
    model.save_pretrained(str(directory))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / file, directory / file)


def w8a8_probe_rows(seed):
    """Activation rows for a bit-exact check of a W8A8 reimplementation's int8 rounding per token against
    compressed-tensors': random rows, a zero row, a wide dynamic range, all negative, and values on exact quarter
    steps (ties in x / scale). [6, 320] float32, seeded."""
    import torch
    rows = 3.0 * torch.randn(6, 320, generator=torch.Generator().manual_seed(seed))
    rows[1] = 0.0
    rows[2] *= torch.logspace(-6, 2, 320)
    rows[3] = -rows[3].abs()
    rows[4] = torch.round(rows[4] * 4) / 4
    return rows


def run_cases(cases, make_case, out):
    """main() of the per-case fixture scripts: the cases named on the command line (all by default), each made
    by make_case(name) under out."""
    import torch
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(cases)
    for name in names:
        if name not in cases:
            sys.exit(f"unknown case {name}; cases: {', '.join(cases)}")
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        make_case(name)


def greedy_without_cache(model, input_ids, new_tokens, eos_ids):
    """Argmax decoding with a full forward per step: a cross-check of generate() and the top-1 margins."""
    import torch
    ids = input_ids.clone()
    margins = []
    for _ in range(new_tokens):
        with torch.no_grad():
            last = model(ids).logits[0, -1]
        top = torch.topk(last, 2)
        margins.append(float(top.values[0] - top.values[1]))
        next_id = int(top.indices[0])
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
        if next_id in eos_ids:
            break
    return ids[0, input_ids.shape[1]:].tolist(), margins


def perplexity_guide(model, input_ids):
    """The loop of transformers' guide "Perplexity of fixed-length models", with the exact NLL beside it.

    The guide weights each window's mean loss by (valid labels - 1) because of the label shift; that is right
    for the first window only (later windows' first target is not the window's first token), so its average
    is slightly off. The exact figure scores every token after the first exactly once, with the context its
    window gives it.
    """
    import torch
    seq_len = input_ids.size(1)
    nll_sum = 0.0
    n_tokens = 0
    prev_end_loc = 0
    windows = []
    token_nll = [None] * seq_len
    for begin_loc in range(0, seq_len, PERPLEXITY_STRIDE):
        end_loc = min(begin_loc + PERPLEXITY_CONTEXT, seq_len)
        trg_len = end_loc - prev_end_loc
        window_ids = input_ids[:, begin_loc:end_loc]
        target_ids = window_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = model(window_ids, labels=target_ids)
            neg_log_likelihood = outputs.loss
        num_valid_tokens = (target_ids != -100).sum().item()
        batch_size = target_ids.size(0)
        num_loss_tokens = num_valid_tokens - batch_size
        nll_sum += neg_log_likelihood * num_loss_tokens
        n_tokens += num_loss_tokens

        # Exact: the positions whose label survives the shift, each scored once.
        log_probs = torch.log_softmax(outputs.logits[0].float(), dim=-1)
        first_scored = max(1, window_ids.size(1) - trg_len)
        window_nll = 0.0
        for j in range(first_scored, window_ids.size(1)):
            value = -float(log_probs[j - 1, window_ids[0, j]])
            token_nll[begin_loc + j] = value
            window_nll += value
        windows.append({"begin": begin_loc, "end": end_loc, "trg_len": trg_len,
                        "loss": float(neg_log_likelihood), "guide_weight": num_loss_tokens,
                        "scored_from": begin_loc + first_scored,
                        "scored_tokens": window_ids.size(1) - first_scored, "nll_sum": window_nll})
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    avg_nll = nll_sum / n_tokens
    ppl = torch.exp(avg_nll)
    assert all(v is not None for v in token_nll[1:]), "every token after the first is scored once"
    exact_avg_nll = sum(token_nll[1:]) / (seq_len - 1)
    return {
        "context_length": PERPLEXITY_CONTEXT, "stride": PERPLEXITY_STRIDE,
        "guide_avg_nll": float(avg_nll), "guide_ppl": float(ppl), "guide_tokens": n_tokens,
        "exact_avg_nll": exact_avg_nll, "exact_ppl": math.exp(exact_avg_nll),
        "exact_tokens": seq_len - 1,
        "windows": windows,
        "token_nll": token_nll,
    }


def reference_outputs(name, directory):
    """Load the saved model in float32 and record its outputs; logits go to logits_<k>.npy."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = MODELS[name]
    tok = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    eos_ids = set(model.generation_config.eos_token_id)

    prompts = []
    inputs = [(n, "text", t, tok.encode(t, add_special_tokens=True)) for n, t in PLAIN_PROMPTS]
    chat_text = tok.apply_chat_template(CHAT_PROMPT, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.apply_chat_template(CHAT_PROMPT, tokenize=True, add_generation_prompt=True, return_dict=False)
    inputs.append(("chat", "chat", chat_text, chat_ids))
    for k, (prompt_name, kind, text, ids) in enumerate(inputs):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids).logits[0].float()  # [T, vocab]
        np.save(directory / f"logits_{k}.npy", logits.numpy().astype(np.float32), allow_pickle=False)
        log_probs = torch.log_softmax(logits, dim=-1)
        prompt_logprobs = [float(log_probs[t - 1, ids[t]]) for t in range(1, len(ids))]
        with torch.no_grad():
            generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=GREEDY_NEW_TOKENS)
        new_ids = generated[0, len(ids):].tolist()
        check_ids, margins = greedy_without_cache(model, input_ids, GREEDY_NEW_TOKENS, eos_ids)
        assert check_ids == new_ids, (name, prompt_name, new_ids, check_ids)
        entry = {"name": prompt_name, "kind": kind, "text": text}
        if kind == "chat":
            entry["messages"] = CHAT_PROMPT
            entry["how"] = "apply_chat_template(messages, add_generation_prompt=True)"
        else:
            entry["how"] = "tokenizer.encode(text, add_special_tokens=True)"
        entry.update({
            "input_ids": ids,
            "logits_file": f"logits_{k}.npy",
            "logits_shape": list(logits.shape),
            "prompt_logprobs": prompt_logprobs,
            "greedy": {"max_new_tokens": GREEDY_NEW_TOKENS, "new_ids": new_ids,
                       "stopped_at_eos": bool(new_ids) and new_ids[-1] in eos_ids,
                       "text": tok.decode(new_ids, skip_special_tokens=False),
                       "top1_margins": margins},
        })
        prompts.append(entry)

    encodings = tok(PERPLEXITY_TEXT, return_tensors="pt")
    perplexity = perplexity_guide(model, encodings.input_ids)
    perplexity = {"text": PERPLEXITY_TEXT, "how": "tokenizer(text) (add_special_tokens=True)",
                  "input_ids": encodings.input_ids[0].tolist(), **perplexity}
    return {
        "model": name,
        "generator": "tools/make_fixtures.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "dtype_on_disk": spec["dtype"],
        "reference_dtype": "float32",
        "attn_implementation": "eager",
        "vocab_size": model.config.vocab_size,
        "eos_token_ids": sorted(eos_ids),
        "notes": [
            "Outputs of AutoModelForCausalLM.from_pretrained(dir, dtype=float32, attn_implementation='eager'): "
            "the on-disk weights widened to float32, computed on CPU.",
            "logits_<k>.npy: float32 [T, vocab], row t = logits after input_ids[0..t].",
            "prompt_logprobs[t-1] = log_softmax(logits[t-1])[input_ids[t]] for t = 1..T-1.",
            "greedy: model.generate(do_sample=False, max_new_tokens=16), stopping at eos_token_ids; "
            "top1_margins: logit(top1) - logit(top2) at each step (small margins = fragile argmax).",
            "perplexity: transformers' guide loop (guide_*) and the exact token-weighted NLL (exact_*); "
            "token_nll[p] = -log p(input_ids[p] | window context), null for p = 0.",
        ],
        "prompts": prompts,
        "perplexity": perplexity,
    }


def make_models():
    import torch
    import transformers
    torch.set_num_threads(1)  # one reduction order, so reruns give the same bits
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for name in MODELS:
        directory = FIXTURES / "models" / name
        build_model(name, directory)
        write_json(directory / "reference.json", reference_outputs(name, directory))
        print(f"wrote {directory.relative_to(REPO_ROOT)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="*", metavar="{tokenizers,models}",
                        help="what to make (default: everything)")
    args = parser.parse_args()
    steps = args.steps or ["tokenizers", "models"]
    unknown = set(steps) - {"tokenizers", "models"}
    if unknown:
        parser.error(f"unknown step(s) {sorted(unknown)}; choose from tokenizers, models")
    if "tokenizers" in steps:
        make_tokenizers()
    if "models" in steps:
        make_models()


if __name__ == "__main__":
    sys.exit(main())
