#!/usr/bin/env python3
"""Make kvlite's chat-template fixtures with transformers' own Jinja machinery.

    /opt/kvdev/bin/python tools/make_chat_template_fixtures.py

Writes tests/fixtures/chat_templates/cases.json from the real templates in the same folder (<family>.jinja, the
text each model ships; see SOURCES below). Every expected output is rendered by transformers'
`render_jinja_template` (jinja2's ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, its tojson,
raise_exception, strftime_now), and the variables the template saw are recorded next to it, in order, so that
tests/unit-chat-template.cpp renders the same template over the same variables and compares bytes. A case
whose template raises records the error instead (kvlite must raise too; raise_exception's message must match).

The second half, "interpreter", is one small template per construct kvlite's interpreter supports, rendered by
the same compiled environment: expected outputs, or the error jinja2 raises (with its line for syntax errors).

strftime_now is pinned to 2024-07-26 12:00 (the C++ test pins the same instant) so that the output does not
depend on the day the fixtures were made. Deterministic: running it twice gives the same file.
"""

import datetime
import json
import sys
from pathlib import Path

import jinja2
import transformers
from transformers.utils import chat_template_utils as ctu

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT = REPO_ROOT / "tests" / "fixtures" / "chat_templates"

# Where each template's text comes from (the model repository's tokenizer_config.json chat_template, as
# vendored in public repositories; kvlite's own bundled tokenizers already carried two of them).
SOURCES = {
    "qwen2.5": ("Qwen/Qwen2.5-*-Instruct tokenizer_config.json", "<|endoftext|>", "<|im_end|>", None),
    "qwen3": ("Qwen/Qwen3-0.6B (llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja)", None, "<|im_end|>", None),
    "qwen3-vl": ("Qwen/Qwen3-VL-8B-Instruct (its GGUF's tokenizer.chat_template: 5,292 bytes, SHA-256 3636d0f0bd6bef02"
                 "654cdffdc447b79cb2cef8ab02cc75267345946291a489e4)", None, "<|im_end|>", None),
    "llama3.1": ("meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json", "<|begin_of_text|>", "<|eot_id|>", None),
    "llama3.2": ("meta-llama/Llama-3.2-3B-Instruct (llama.cpp models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja)",
                 "<|begin_of_text|>", "<|eot_id|>", None),
    "mistral-v0.3": ("mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json (tags joined by newlines; every tag "
                     "strips them)", "<s>", "</s>", "<unk>"),
    "gemma2": ("google/gemma-2-2b-it (llama.cpp models/templates/google-gemma-2-2b-it.jinja)", "<bos>", "<eos>", "<unk>"),
    "gemma3": ("google/gemma-3-*-it tokenizer_config.json", "<bos>", "<eos>", "<unk>"),
    "phi3.5": ("microsoft/Phi-3.5-mini-instruct (llama.cpp models/templates/microsoft-Phi-3.5-mini-instruct.jinja)",
               "<s>", "<|endoftext|>", "<unk>"),
    "phi4-mini": ("microsoft/Phi-4-mini-instruct tokenizer_config.json", "<|endoftext|>", "<|endoftext|>", "<|endoftext|>"),
    "smollm2": ("HuggingFaceTB/SmolLM2-*-Instruct tokenizer_config.json", "<|im_start|>", "<|im_end|>", "<|endoftext|>"),
}

NOW = datetime.datetime(2024, 7, 26, 12, 0, 0)
NOW_UNIX = 1721995200  # 2024-07-26 12:00:00 UTC

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                              "parameters": {"type": "object", "properties": {}}}}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [SYSTEM, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Tell me a joke."}],
    "multi_turn_no_system": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye!"}],
    "whitespace_unicode": [{"role": "user", "content": "  padded \t\n  text with \"quotes\" and 'apostrophes'  \n"},
                           {"role": "assistant", "content": "\n héllo 世界 🎉 \\ back\\slash "},
                           {"role": "user", "content": "ok\r\n"}],
    "tool_call": [SYSTEM, {"role": "user", "content": "What's the weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "call12345", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                  {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "22 degrees, sunny"},
                  {"role": "assistant", "content": "It is 22 degrees and sunny in Paris."}],
    "tool_call_no_system": [{"role": "user", "content": "Weather and time in Rome?"},
                            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                                {"id": "callabcde", "type": "function",
                                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                                {"id": "callfghij", "type": "function",
                                 "function": {"name": "get_time", "arguments": {}}}]},
                            {"role": "tool", "tool_call_id": "callabcde", "content": "18 degrees"},
                            {"role": "tool", "tool_call_id": "callfghij", "content": "14:05"}],
    "images": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}]}],
    "images_system": [{"role": "system", "content": [{"type": "text", "text": "Describe images briefly."}]},
                      {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                                   {"type": "text", "text": " and "}, {"type": "image"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Both are cats."}]},
                      {"role": "user", "content": [{"type": "text", "text": "Sure?"}]}],
    "thinking": [{"role": "user", "content": "Solve x+1=3"},
                 {"role": "assistant", "content": "<think>\nx = 3 - 1\n</think>\n\nx = 2"},
                 {"role": "user", "content": "And x+2=5?"}],
    "reasoning_field": [{"role": "user", "content": "Why is the sky blue?"},
                        {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Short light scatters more."}],
    "not_alternating": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
    "assistant_last": [{"role": "user", "content": "Start"}, {"role": "assistant", "content": "  Continued  "}],
    "empty": [],
}
# Which conversations also run with the tools list.
WITH_TOOLS = {"user", "system_user", "tool_call", "tool_call_no_system"}


def render(template, context):
    compiled = ctu._compile_jinja_template(template)
    compiled.environment.globals["strftime_now"] = lambda fmt: NOW.strftime(fmt)
    return compiled.render(**context)


def outcome(thunk):
    try:
        return {"expected": thunk()}
    except jinja2.exceptions.TemplateSyntaxError as e:
        return {"error": "syntax", "message": e.message, "line": e.lineno}
    except jinja2.exceptions.TemplateError as e:  # raise_exception, undefined, security
        return {"error": type(e).__name__, "message": str(e)}
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
        return {"error": type(e).__name__, "message": str(e)}


def family_cases():
    cases = []
    for family, (_, bos, eos, unk) in SOURCES.items():
        template = (OUT / f"{family}.jinja").read_text()
        for name, messages in CONVERSATIONS.items():
            for tools in ([None, [WEATHER_TOOL, TIME_TOOL]] if name in WITH_TOOLS else [None]):
                for add_generation_prompt in (False, True):
                    thinking_options = [None, True, False] if family.startswith("qwen3") else [None]
                    vision_ids = [False, True] if family == "qwen3-vl" and name.startswith("images") else [False]
                    for enable_thinking, add_vision_id in [(t, v) for t in thinking_options for v in vision_ids]:
                        # as apply_chat_template passes them: special_tokens_map, only the tokens that are set
                        kwargs = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk)) if v is not None}
                        if enable_thinking is not None:
                            kwargs["enable_thinking"] = enable_thinking
                        if add_vision_id:
                            kwargs["add_vision_id"] = True
                        # transformers' own path, then the variables it gives the template (same steps as
                        # render_jinja_template: plain data, reasoning aliases, tools, documents, kwargs)
                        chat = ctu._alias_reasoning_fields(ctu._plain_template_data(json.loads(json.dumps(messages))))
                        context = {"messages": chat, "tools": ctu._plain_template_data(tools), "documents": None,
                                   "add_generation_prompt": add_generation_prompt, **kwargs}

                        def via_transformers():
                            ctu._compile_jinja_template(template).environment.globals["strftime_now"] = lambda f: NOW.strftime(f)
                            rendered, _ = ctu.render_jinja_template(
                                conversations=[json.loads(json.dumps(messages))], tools=tools, chat_template=template,
                                add_generation_prompt=add_generation_prompt, **kwargs)
                            return rendered[0]

                        truth = outcome(via_transformers)
                        again = outcome(lambda: render(template, context))
                        assert truth == again, (family, name, truth, again)
                        label = f"{family} {name}{' tools' if tools else ''} gen={int(add_generation_prompt)}"
                        if enable_thinking is not None:
                            label += f" thinking={int(enable_thinking)}"
                        if add_vision_id:
                            label += " add_vision_id"
                        cases.append({"family": family, "name": label, "context": context, **truth})
    return cases


# One template per construct; contexts are small. Expected values are whatever jinja2 renders.
INTERPRETER = [
    ("text only", "plain text\n", {}),
    ("output", "{{ x }}|{{ 1 }}|{{ 1.5 }}|{{ 'a' }}|{{ none }}|{{ true }}|{{ [1, 'b', none] }}|{{ {'k': 1} }}|{{ (1, 2) }}",
     {"x": "v"}),
    ("float repr", "{{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1/3 }} {{ 2.0 }} {{ 1e-5 }} {{ 123456789.0 }} {{ -0.0 }} {{ 10/4 }}", {}),
    ("arithmetic", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ -3 + 1 }}", {}),
    ("string ops", "{{ 'a' + 'b' }} {{ 'ab' * 3 }} {{ 'x' ~ 1 ~ none }} {{ [1] + [2] }}", {}),
    ("comparison", "{{ 1 < 2 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ [1,2] == [1,2] }} {{ 1 != 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }}", {}),
    ("logic", "{{ true and 'x' }} {{ false or 'y' }} {{ not none }} {{ 0 or '' }} {{ x and x.y }}", {"x": None}),
    ("in", "{{ 'a' in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'cat' }} {{ 'q' in missing }}", {}),
    ("ternary", "{{ 'yes' if x else 'no' }} {{ 'only' if false }}|{{ 1 if none else 2 if true else 3 }}", {"x": 1}),
    ("if elif else", "{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %}", {"x": 2}),
    ("for loop vars", "{% for i in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
     "{{ loop.first }}{{ loop.last }}{{ loop.length }}:{{ i }};{% endfor %}", {"items": ["a", "b", "c"]}),
    ("for previtem nextitem cycle", "{% for i in [1,2,3] %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('x','y') }} {% endfor %}", {}),
    ("for else", "{% for i in [] %}x{% else %}empty{% endfor %}", {}),
    ("for filter", "{% for i in range(10) if i is odd %}{{ i }}{{ loop.last }} {% endfor %}", {}),
    ("for unpack items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d|items %}{{ k }}{% endfor %}",
     {"d": {"b": 1, "a": 2}}),
    ("for dict", "{% for k in d %}{{ k }}{% endfor %}", {"d": {"z": 1, "y": 2}}),
    ("for string", "{% for c in 'héllo' %}[{{ c }}]{% endfor %}", {}),
    ("break continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("set scope", "{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}"
     "{% if true %}{% set y = 3 %}{% endif %}{{ y }}", {}),
    ("set tuple", "{% set a, b = [1, 2] %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}", {}),
    ("namespace", "{% set ns = namespace(n=0, s='') %}{% for i in [1,2,3] %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", {}),
    ("block set", "{% set body %}\n  inner {{ 1 }}\n{% endset %}[{{ body }}]{% set up | upper %}abc{% endset %}{{ up }}", {}),
    ("macro", "{% macro m(a, b='d', c=none) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ m(a=3, c=4) }}", {}),
    ("macro call caller", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}"
     "{% call wrap('b') %}bold {{ 1 + 1 }}{% endcall %}", {}),
    ("call with args", "{% macro each(xs) %}{% for x in xs %}{{ caller(x) }}{% endfor %}{% endmacro %}"
     "{% call(item) each([1, 2]) %}<{{ item }}>{% endcall %}", {}),
    ("macro globals", "{% set g = 5 %}{% macro m() %}{{ g }}{{ outer }}{% endmacro %}{{ m() }}", {"outer": "o"}),
    ("generation", "a{% generation %}b{{ 1 }}{% endgeneration %}c", {}),
    ("filter block", "{% filter upper %}hi {{ 'there' }}{% endfilter %}", {}),
    ("comments", "a{# note #}b\n{# line #}\nc", {}),
    ("whitespace control", "a  {{- 'b' -}}  c\n  {%- if true -%}  d  {%- endif -%}\n e", {}),
    ("trim and lstrip blocks", "<ul>\n    {% for i in [1, 2] %}\n    <li>{{ i }}</li>\n    {% endfor %}\n</ul>\n", {}),
    ("lstrip plus", "x\n    {%+ if true %}y{% endif %}\n  {# c #}\nz", {}),
    ("trailing newline dropped", "line\n\n", {}),
    ("crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n", {}),
    ("attribute subscript", "{{ d.a }} {{ d['a'] }} {{ l[0] }} {{ l[-1] }} {{ l.1 }} {{ d.missing }}|{{ l[10] }}|{{ d.get('a') }}"
     " {{ d.get('q', 'dflt') }} {{ d.get('q') }}", {"d": {"a": "A"}, "l": [1, 2]}),
    ("slicing", "{{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[::2] }} {{ s[1:3] }} {{ s[::-1] }} {{ l[-2:] }} {{ l[5:] }}",
     {"l": [1, 2, 3, 4], "s": "héllo"}),
    ("dict methods", "{{ d.keys()|list }} {{ d.values()|list }} {{ d.items()|list }}", {"d": {"x": 1, "y": [2]}}),
    ("string methods", "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxaxx'.strip('x') }}|{{ 'a,b,,c'.split(',') }}"
     "|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}"
     "|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}|{{ 'hello world'.title() }}|{{ 'hELLO'.capitalize() }}"
     "|{{ 'banana'.count('a') }}|{{ 'banana'.find('n') }}|{{ '-'.join(['a', 'b']) }}|{{ 'a/b/c'.rsplit('/', 1) }}",
     {"s": "  pad  "}),
    ("tests", "{{ x is defined }}{{ y is undefined }}{{ none is none }}{{ 's' is string }}{{ {} is mapping }}{{ [] is sequence }}"
     "{{ 's' is iterable }}{{ 1 is number }}{{ 1 is integer }}{{ 1.0 is integer }}{{ 1.0 is float }}{{ true is boolean }}"
     "{{ true is true }}{{ 0 is false }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 1 is equalto 1 }}"
     "{{ 2 is eq 3 }}{{ x is not none }}{{ y is iterable }}{{ {} is iterable }}{{ 'a' is sequence }}{{ 5 is gt 3 }}"
     "{{ 'ab' is lower }}{{ 1 is in [1] }}{{ x is sameas none }}", {"x": 1}),
    ("filters text", "{{ '  a  '|trim }}|{{ 'xax'|trim('x') }}|{{ 'ab'|upper }}|{{ 'AB'|lower }}|{{ 'hello wORLD'|capitalize }}"
     "|{{ 'hello wORLD-x'|title }}|{{ 'aXa'|replace('a', 'b') }}|{{ 5|string }}|{{ '<a&b>'|e }}|{{ 'x'|safe }}", {}),
    ("filters numbers", "{{ '42'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ '1.5'|float }} {{ -3|abs }}"
     " {{ 2.567|round(2) }} {{ 2.5|round }} {{ 2.1|round(method='ceil') }} {{ [3, 1, 2]|sum }} {{ [3, 1, 2]|min }} {{ [3, 1, 2]|max }}", {}),
    ("filters sequences", "{{ [1, 2]|length }} {{ 'héllo'|length }} {{ {'a': 1}|count }} {{ [1, 2]|join(',') }} {{ [1, 2]|first }}"
     " {{ [1, 2]|last }} {{ 'ab'|list }} {{ [1, 1, 2]|unique|list }} {{ ['b', 'A', 'a']|sort }} {{ [1, 2]|reverse|list }}"
     " {{ 'abc'|reverse }} {{ x|default('d') }} {{ ''|default('e', true) }} {{ none|d('n') }} {{ [{'n': 'x'}, {'n': 'y'}]|join('+', attribute='n') }}", {}),
    ("selectattr map", "{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }}"
     " {{ ms|rejectattr('role', 'equalto', 'user')|list|length }} {{ ms|selectattr('flag')|list|length }}"
     " {{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3]|reject('even')|list }} {{ ['a', 'b']|map('upper')|list }}"
     " {{ ms|map(attribute='missing', default='-')|list }} {{ ms|selectattr('role', 'in', ['system'])|list|length }}",
     {"ms": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1", "flag": True},
             {"role": "user", "content": "u2"}]}),
    ("tojson", "{{ d|tojson }}\n{{ d|tojson(indent=2) }}\n{{ 'é\"\\n\\u0001'|tojson }} {{ [1.5, none, true, []]|tojson }}"
     " {{ {}|tojson(indent=4) }}", {"d": {"b": 1, "a": {"x": [1, 2], "y": "é"}}}),
    ("dictsort indent", "{{ {'b': 1, 'a': 2}|dictsort }}|{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}", {}),
    ("dict global", "{{ dict(a=1, b='x') }} {{ dict(a=1).a }}", {}),
    ("range", "{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(5, 0, -2)|list }}", {}),
    ("strftime_now", "{{ strftime_now('%d %b %Y') }} {{ strftime_now('%Y-%m-%d') }}", {}),
    ("undefined prints empty", "[{{ missing }}] [{{ missing|trim }}] [{{ missing|length }}] [{{ missing|list }}]", {}),
    ("undefined attribute error", "line one\n{{ missing.attr }}", {}),
    ("undefined add error", "{{ missing + 1 }}", {}),
    ("raise_exception", "a\n{{ raise_exception('Stop here: ' ~ x) }}", {"x": 3}),
    ("type error", "{{ 'a' + 1 }}", {}),
    ("tojson undefined error", "{{ missing|tojson }}", {}),
    ("namespace underscore error", "{% set ns = namespace(_x=1) %}", {}),
    ("list append refused", "{% set l = [] %}{{ l.append(1) }}", {}),
    ("syntax error unclosed if", "a\nb\n{% if x %}never closed", {}),
    ("syntax error bad expression", "ok\n{{ 1 + }}", {}),
    ("syntax error unknown tag end", "{% endfor %}", {}),
    ("division by zero", "{{ 1 // 0 }}", {}),
    ("string escapes", "{{ 'tab\\there' }}|{{ \"q\\\"\" }}|{{ '\\u00e9\\x41' }}|{{ 'a' 'b' }}", {}),
    ("nested data", "{% for m in messages %}{% for p in m.content %}{{ p.type }}:{{ p.text|default('-') }};{% endfor %}{% endfor %}",
     {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t"}]}]}),
    ("is mapping vs iterable", "{% for c in [s, l, d] %}{{ c is string }}{{ c is mapping }}{{ c is iterable }}{{ c is sequence }};{% endfor %}",
     {"s": "x", "l": [1], "d": {"a": 1}}),
    ("loop in macro in loop", "{% macro r(xs) %}{% for x in xs %}{{ loop.index }}{{ x }}{% endfor %}{% endmacro %}"
     "{% for i in [[1, 2], [3]] %}({{ r(i) }}{{ loop.index }}){% endfor %}", {}),
]


def interpreter_cases():
    cases = []
    for name, template, context in INTERPRETER:
        result = outcome(lambda: render(template, context))
        cases.append({"name": name, "template": template, "context": context, **result})
    return cases


def main():
    if jinja2.__version__ != "3.1.6":
        print(f"note: jinja2 {jinja2.__version__}, the fixtures were first made with 3.1.6", file=sys.stderr)
    data = {
        "made_by": "tools/make_chat_template_fixtures.py",
        "versions": {"transformers": transformers.__version__, "jinja2": jinja2.__version__,
                     "python": sys.version.split()[0]},
        "now_unix": NOW_UNIX,
        "templates": {family: {"file": f"{family}.jinja", "source": source} for family, (source, *_) in SOURCES.items()},
        "cases": family_cases(),
        "interpreter": interpreter_cases(),
    }
    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    (OUT / "cases.json").write_text(text)
    errors = sum("error" in c for c in data["cases"])
    print(f"wrote {OUT / 'cases.json'}: {len(data['cases'])} template cases ({errors} raise), "
          f"{len(data['interpreter'])} interpreter cases")


if __name__ == "__main__":
    main()
