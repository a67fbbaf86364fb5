#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer harnesses (tests/fuzz/corpus/<harness>/) from the repository's own
fixtures, in each harness's input layout (see tests/fuzz/fuzz_<harness>.cpp). Deterministic; standard library
only. Run from anywhere: python3 tools/make_fuzz_corpus.py"""
import base64, json, os, shutil, struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")


def read(*parts):
    with open(os.path.join(ROOT, *parts), "rb") as f:
        return f.read()


def write(harness, name, data):
    d = os.path.join(OUT, harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None):
    header, blobs, offset = {}, b"", 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs += data
        offset += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + blobs


def text_field(s, cap):  # fuzz::Bytes::text: a length byte (mod cap + 1), then the bytes
    s = s[:cap]
    return bytes([len(s)]) + s


# Every harness's folder this script writes is made anew; the folders other scripts write (quant_formats:
# tools/make_awq_gptq_fixtures.py) are left as they are.
OTHER_SCRIPTS_FOLDERS = {"quant_formats"}
if os.path.isdir(OUT):
    for name in os.listdir(OUT):
        if name not in OTHER_SCRIPTS_FOLDERS:
            shutil.rmtree(os.path.join(OUT, name))

# safetensors: small well-formed files, and the fixture model's first bytes (header intact, data cut)
write("safetensors", "f32_2x3", safetensors([("a", "F32", [2, 3], struct.pack("<6f", *range(6)))]))
write("safetensors", "mixed", safetensors([("w", "BF16", [4], b"\x80\x3f" * 4), ("s", "F8_E4M3", [3], b"\x38\x40\x48"),
                                           ("q", "I32", [1, 2], struct.pack("<2i", 7, -7))], {"format": "pt"}))
write("safetensors", "empty_tensor", safetensors([("e", "F16", [0, 5], b"")]))
model = read("tests", "fixtures", "models", "tiny-qwen3", "model.safetensors")
write("safetensors", "tiny_qwen3_head", model[:8 + struct.unpack("<Q", model[:8])[0] + 64])

# config + plan: knobs, max_model_len (u32), utilization byte, card size (u32) and shift byte, then config.json
configs = {"tiny_llama": ("tests", "fixtures", "configs", "tiny-llama.json"),
           "tiny_qwen3_vl": ("tests", "fixtures", "configs", "tiny-qwen3-vl.json"),
           "qwen3_4b": ("models", "qwen3-4b", "config.json"),
           "llama_w4a16": ("models", "llama-3.1-8b-instruct-w4a16", "config.json"),
           "qwen3_vl_fp8": ("models", "qwen3-vl-4b-instruct-fp8", "config.json"),
           "captioner_w4a16": ("models", "kvlite-captioner-w4a16", "config.json")}
# issue 39's families (after the first six, whose knobs stay as they were): sliding windows, soft-caps, gemma3's
# nested text_config with class defaults, phi3's fused projections
family_configs = {"gemma2_2b": ("tests", "fixtures", "configs", "families", "gemma-2-2b", "config.json"),
           "gemma3_4b": ("tests", "fixtures", "configs", "families", "gemma-3-4b-it", "config.json"),
           "gemma3_tiny": ("tests", "fixtures", "families", "gemma3_text", "config.json"),
           "ministral_8b": ("tests", "fixtures", "configs", "families", "ministral-8b-instruct-2410", "config.json"),
           "phi4_mini": ("tests", "fixtures", "configs", "families", "phi-4-mini-instruct", "config.json"),
           "qwen2_swa_tiny": ("tests", "fixtures", "families", "qwen2-swa", "config.json")}
for i, (name, path) in enumerate(sorted(configs.items()) + sorted(family_configs.items())):
    knobs = bytes([i % 16]) + struct.pack("<I", 2048 << (i % 3)) + bytes([200]) + struct.pack("<I", 8192) + bytes([20])
    write("config_plan", name, knobs + read(*path))
# RoPE scaling types (rope_scaling / rope_parameters layouts: yarn, longrope, dynamic), knobs apart from the above
rope_configs = {"qwen2_5_7b_yarn": ("models", "qwen2.5-7b-instruct-yarn", "config.json"),
                "rope_llama_longrope": ("tests", "fixtures", "rope", "models", "llama-longrope", "config.json"),
                "rope_qwen2_dynamic": ("tests", "fixtures", "rope", "models", "qwen2-dynamic", "config.json")}
for i, (name, path) in enumerate(sorted(rope_configs.items())):
    knobs = bytes([(i + 3) % 16]) + struct.pack("<I", 4096 << i) + bytes([200]) + struct.pack("<I", 8192) + bytes([20])
    write("config_plan", name, knobs + read(*path))
# RoPE per family: gemma3's rope_parameters per layer type (linear on the global layers), phi3's partial rotary
# with longrope
family_rope_configs = {"gemma3_linear_tiny": ("tests", "fixtures", "families", "gemma3_text-linear", "config.json"),
                       "phi3_longrope_tiny": ("tests", "fixtures", "families", "phi3-longrope", "config.json")}
for i, (name, path) in enumerate(sorted(family_rope_configs.items())):
    knobs = bytes([(i + 7) % 16]) + struct.pack("<I", 64 << i) + bytes([200]) + struct.pack("<I", 8192) + bytes([20])
    write("config_plan", name, knobs + read(*path))

# tokenizer.json load: tokenizer_config.json's first 64 bytes as a text field, then tokenizer.json
for family, path in [("qwen2", ("tests", "fixtures", "tokenizers", "qwen2")), ("llama3", ("tests", "fixtures", "tokenizers", "llama3")),
                     ("captioner", ("models", "kvlite-captioner-bf16"))]:
    config = read(*path, "tokenizer_config.json")
    write("tokenizer_load", family, text_field(b"{}", 64) + read(*path, "tokenizer.json"))
    write("tokenizer_load", family + "_config", text_field(config, 64) + read(*path, "tokenizer.json"))
# the tokenizer-family stand-ins (tools/make_tokenizer_family_fixtures.py): every other pipeline component
for family in ["smollm2", "phi-4-mini", "mistral-v0.3", "phi-3.5", "gemma", "components-a", "components-b"]:
    write("tokenizer_load", family, text_field(b"{}", 64) + read("tests", "fixtures", "tokenizers", family, "tokenizer.json"))

# tokenize: a selector byte (qwen2 / llama3), then text
texts = {"ascii": b"The quick brown fox jumps over the lazy dog. 1234567890 !?",
         "mixed": "Grüße, 世界! Ça va? 😀 👩‍👩‍👧 e\u0301 \u3000tab\tnew\nline".encode(),
         "special": b"<|im_start|>user\nhi<|im_end|> <|begin_of_text|><|eot_id|>",
         "spaces": b"   leading and trailing   \n\n\n",
         "bad_utf8": b"ok \xff\xfe \xc3 \xe2\x82 done"}
for i, (name, t) in enumerate(sorted(texts.items())):
    for selector in (0, 1):
        write("tokenize", f"{name}_{selector}", bytes([selector]) + t)
# selectors 2..8: the tokenizer-family stand-ins (fuzz_tokenize.cpp's kFamilies)
for selector in range(2, 9):
    for name in ("mixed", "special"):
        write("tokenize", f"{name}_{selector}", bytes([selector]) + texts[name])

# image: the small decode fixtures of every format
for name in ["gray_23x19.png", "pnm_19x13.ppm", "orient_6_40x24.jpg", "rle_27x15.tga", "anim_29x21.gif",
             "alpha_50x40.png", "photo_67x45.png", "tall_31x97.bmp", "photo_300x200.jpg"]:
    write("image", name, read("tests", "fixtures", "images", name))

# chat: family byte, message count, (role, content) text fields, add_generation_prompt byte, then placement bytes
def chat(family, messages, tail=b"\x01\x02\x01\x10\x10\x40\x00\x00\x00"):
    out = bytes([family, len(messages)])
    for role, content in messages:
        out += text_field(role.encode(), 12) + text_field(content.encode(), 200)
    return out + bytes([1]) + tail
write("chat", "qwen_user", chat(0, [("user", "Describe this image. <|vision_start|><|image_pad|><|vision_end|>")]))
write("chat", "qwen_system", chat(0, [("system", "You are terse."), ("user", "hi"), ("assistant", "hello"), ("user", "again")]))
write("chat", "llama_dated", chat(1, [("system", "  Be brief.  "), ("user", " \u3000spaces\u2028 ")]))
write("chat", "llama_empty", chat(1, []))

# vision input: image count, then per image grid_t, grid_h, grid_w, tokens, row-size choice, value count (u32)
def vision(images):
    out = bytes([len(images) - 1])
    for t, h, w, tokens, values in images:
        out += bytes([t, h + 2, w + 2, tokens + 4, 1]) + struct.pack("<I", values) + b"\x00"
    return out
write("vision_input", "one_good", vision([(1, 4, 6, 6, 24 * 1536)]))
write("vision_input", "two_good", vision([(1, 4, 4, 4, 16 * 1536), (1, 2, 6, 3, 12 * 1536)]))
write("vision_input", "tokens_off", vision([(1, 4, 6, 60, 24 * 1536)]))
write("vision_input", "short_pixels", vision([(1, 4, 6, 6, 100)]))
# kvlite serve's request reader: the route (0 chat, 1 completions), then the body
def request(route, body):
    return bytes([route]) + json.dumps(body).encode()
scene = "data:image/png;base64," + base64.b64encode(read("examples", "images", "scene_1.png")).decode()
write("serve_request", "chat_text", request(0, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                                "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
                                                "stop": ["x", "y"], "stream": True}))
write("serve_request", "chat_image", request(0, {"model": "kvlite-captioner-bf16", "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": scene}}, {"type": "text", "text": "Describe this image."}]}],
    "stream_options": {"include_usage": True}}))
write("serve_request", "chat_bad_image", request(0, {"messages": [{"role": "system", "content": "be terse"}, {
    "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}],
    "n": 1}))
write("serve_request", "completion", request(1, {"prompt": "a small", "max_tokens": 5, "stop": "z", "min_p": 0.1,
                                                 "repetition_penalty": 1.2}))
write("serve_request", "completion_other_model", request(1, {"prompt": "x", "max_completion_tokens": 3, "model": "other"}))
# the request-to-engine path: a route byte (bit 0 completions; bits 1-3 the max_tokens cap - 1; bits 4-5 when the
# token callback ends the request), then the body
def engine_request(route, body):
    return bytes([route]) + json.dumps(body).encode()
write("serve_engine", "chat_text", engine_request(0x06, {"messages": [{"role": "system", "content": "be brief"},
                                                                     {"role": "user", "content": "hi"}], "max_tokens": 3,
                                                        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3,
                                                        "stop": ["x", "y"]}))
write("serve_engine", "chat_logprobs", engine_request(0x10, {"messages": [{"role": "user", "content": "a b c"}],
                                                            "logprobs": True, "min_p": 0.2, "repetition_penalty": 1.3}))
write("serve_engine", "chat_image", engine_request(0x02, {"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        read("tests", "fixtures", "images", "gray_23x19.png")).decode()}}, {"type": "text", "text": "what?"}]}]}))
write("serve_engine", "completion", engine_request(0x0f, {"prompt": "once upon", "max_tokens": 8, "ignore_eos": True,
                                                          "stop": "z", "stream": True}))
write("serve_engine", "completion_logprobs", engine_request(0x21, {"prompt": "x", "logprobs": 0, "seed": -1,
                                                                   "max_completion_tokens": 2, "model": "tiny-llama3"}))

# preprocessor_config.json: a byte for the image size, then the file
for name, path in [("captioner", ("models", "kvlite-captioner-bf16")), ("qwen3_vl_fp8", ("models", "qwen3-vl-4b-instruct-fp8"))]:
    write("processor_config", name, bytes([0x35]) + read(*path, "preprocessor_config.json"))
write("processor_config", "clip_values", bytes([0x0c]) + json.dumps({
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 0.00392156862745098, "do_resize": True, "resample": 3}).encode())
write("processor_config", "older_keys", bytes([0xf0]) + json.dumps({
    "size": {"shortest_edge": 3136, "longest_edge": 12845056}, "min_pixels": 3136, "max_pixels": 1003520,
    "image_mean": 0.5, "image_std": 0.5, "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}).encode())

# the C API: a program of calls, each an op byte (its low bits the call, its high bits NULLs) and argument bytes
def c_program(*calls):
    return b"".join(bytes([op]) + bytes(args) for op, args in calls)
write("c_api", "generate", c_program((0x10, [0x3f, 0, 0, 2, 0, 4, 0, 6, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8, 4, 1, 0x05, 3, 0, 9, 2,
                                            5, 104, 101, 108, 108, 111, 2, 1, 0]),
                                    (0x00, [0, 1, 2, 3, 4, 5, 6, 7, 8, 3, 1, 0, 5] + list(b"hello"))))
write("c_api", "chat", c_program((0x11, [0x20, 9, 9, 9, 9, 9, 9, 9, 9, 7, 0, 0, 5, 2] + [4] + list(b"user") + [2] + list(b"hi") +
                                  [6] + list(b"system") + [1] + list(b"x") + [3, 1, 0])))
write("c_api", "batching", c_program((0x12, [0x20, 1, 2, 3, 4, 5, 6, 7, 8, 4, 1, 0, 4, 10, 20, 30, 40, 2, 2, 1, 0, 7, 9]),
                                     (0x32, [0x00, 1, 1, 1, 1, 1, 1, 1, 1, 2, 0, 0, 2, 1, 2, 1, 1, 1, 0, 0])))
write("c_api", "tokens", c_program((0x03, [5] + list(b"hello") + [3, 20, 1, 40, 9, 60]), (0x13, [0, 0])))
write("c_api", "plan_open", c_program((0x04, [0, 0xff, 0, 1, 0, 2, 0, 4, 0, 6, 8, 10, 0, 12, 14, 3, 1, 1, 0]),
                                      (0x15, [1, 0x20, 4, 2, 0, 1, 0, 2, 1]), (0x05, [1, 0, 2, 0, 1, 0])))
write("c_api", "images", c_program((0x06, [4, 1, 2, 3, 4, 8, 8, 8, 1]), (0x26, [0, 12, 12, 8, 6, 3]),
                                   (0x06, [0, 20, 22, 4])))
write("c_api", "score_logits", c_program((0x07, [4] + list(b"a bc") + [12, 8, 3, 1, 2, 3]), (0x08, [4] + list(b"user") +
                                         [2] + list(b"yo") + [20, 4]), (0x09, [])))

# chat_template: byte 0 even: the rest is a template (the real ones of tests/fixtures/chat_templates and the
# interpreter's construct cases); odd: byte 1 picks a real template, the rest is a message-list JSON.
chat_fixtures = json.loads(read("tests", "fixtures", "chat_templates", "cases.json"))
for family in sorted(chat_fixtures["templates"]):
    write("chat_template", "template_" + family, b"\x00" + read("tests", "fixtures", "chat_templates", family + ".jinja"))
for k, case in enumerate(chat_fixtures["interpreter"]):
    write("chat_template", "construct_%02d" % k, b"\x00" + case["template"].encode())
seen = set()
for k, case in enumerate(chat_fixtures["cases"]):
    family, messages = case["family"], json.dumps(case["context"]["messages"], ensure_ascii=False)
    if (family, messages) in seen or len(seen) >= 40:
        continue
    seen.add((family, messages))
    index = sorted(chat_fixtures["templates"]).index(family)
    write("chat_template", "messages_%02d" % len(seen), b"\x01" + bytes([index]) + messages.encode())

# grammar: byte 0 even: GBNF after byte 1 (a walk seed); odd: a JSON schema. The example schema, the shapes an app
# asks for, and GBNF with each construct.
grammars = [
    'root ::= greeting " " name ( "!" | "." )?\ngreeting ::= "hi" | "hello"\nname ::= [A-Z] [a-z]{1,3}\n',
    'root ::= "a"{2,4} "b"* ("c" "d")+ [^x-z]? .\n',
    'root ::= item ("," item)*\nitem ::= [0-9]+ | "\\"" [^"\\\\]* "\\""   # a comment\n',
    'root ::= ( "move(" [0-9] "," [0-9] ")" | "stop" )\n',
    'root ::= "caf" [\\u00E0-\\u00FF] "!" [\\x41-\\x5A]{3}\n',
]
schemas = [
    read("examples", "schemas", "shapes.json").decode(),
    '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name"]}',
    '{"type": "array", "items": {"type": ["number", "boolean", "null"]}, "maxItems": 4}',
    '{"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,4}$"}',
    '{"type": "string", "format": "date-time"}',
    '{"anyOf": [{"type": "integer", "minimum": -40, "maximum": 125}, {"enum": ["a", null, true]}, {"const": {"k": [1]}}]}',
    '{"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}}, "$ref": "#/$defs/node"}',
    '{"type": "object", "additionalProperties": {"type": "string", "maxLength": 4}}',
    '{"type": "array", "prefixItems": [{"type": "number"}, {"enum": ["m", "cm"]}], "items": false}',
    '{"type": "object"}',
]
for kind, prefix, texts in (("gbnf", b"\x00\x07", grammars), ("schema", b"\x01\x03", schemas)):
    for k, text in enumerate(texts):
        write("grammar", "%s_%02d" % (kind, k), prefix + text.encode())

print("wrote", sum(len(f) for _, _, f in os.walk(OUT)), "seed inputs under", os.path.relpath(OUT, ROOT))
