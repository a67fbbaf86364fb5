#!/usr/bin/env python3
"""kvlite serve against the official `openai` Python client, on loopback: the client a vLLM user already has
captions the example images (streamed and not, with stream_options.include_usage), lists the model, gets OpenAI's
error types (400 before a stream starts, 401 without the key, 404 for an unknown model), and SIGTERM drains the
server while the client's pooled connection is open: the request in flight finishes, the server exits at once.

    tests/serve_openai_client.py BUILD_DIR      (from the repository root)

The client comes from the project-local .venv-test/ (tools/install-test-client.sh, run by `make deps` / `make
test`): without it, exit 77 (ctest: skipped), saying so -- except where CI=true, where that is a failure.
"""
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PYTHON = os.path.join(ROOT, ".venv-test", "bin", "python")

try:
    import openai
except ImportError:
    if os.path.exists(VENV_PYTHON) and os.path.realpath(sys.prefix) != os.path.realpath(os.path.dirname(
            os.path.dirname(VENV_PYTHON))):
        os.execv(VENV_PYTHON, [VENV_PYTHON] + sys.argv)  # the project's venv has it
    if os.environ.get("CI") == "true":
        print("FAILED: the openai package is not installed and CI=true: run tools/install-test-client.sh")
        sys.exit(1)
    print("skipped: the openai package is not installed (tools/install-test-client.sh puts it in .venv-test/)")
    sys.exit(77)

MODEL = "kvlite-captioner-bf16"
KEY = "kvlite-test-key"


def start_server(build):
    env = dict(os.environ, KVLITE_API_KEY=KEY)  # the key from the environment, as a deployment passes it
    server = subprocess.Popen([os.path.join(build, "kvlite"), "serve", os.path.join(ROOT, "models", MODEL),
                               "--port", "0", "--backend", "cpu", "--shutdown-timeout", "20"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in server.stdout:
        if line.startswith("kvlite serve:") and "http://127.0.0.1:" in line:
            return server, int(line.split("http://127.0.0.1:")[1].split("/")[0])
    raise RuntimeError("kvlite serve did not start")


def main():
    build = sys.argv[1]
    server, port = start_server(build)
    failures = 0

    def check(ok, what):
        nonlocal failures
        failures += not ok
        print(f"{'ok' if ok else 'FAILED'}: {what}")

    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        served = [m.id for m in client.models.list().data]
        check(served == [MODEL], f"models.list: {served}")
        check(client.models.retrieve(MODEL).id == MODEL, "models.retrieve")
        with open(os.path.join(ROOT, "examples", "images", "captions.txt")) as f:
            cases = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        for image, expected in cases:
            with open(os.path.join(ROOT, "examples", "images", image), "rb") as f:
                url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "Describe this image."}]}]
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
            text = reply.choices[0].message.content
            usage = None
            streamed = ""
            for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}):
                if chunk.choices:
                    streamed += chunk.choices[0].delta.content or ""
                elif chunk.usage is not None:
                    usage = chunk.usage
            ok = (text == expected and streamed == expected and reply.choices[0].finish_reason == "stop"
                  and usage is not None and usage.completion_tokens == reply.usage.completion_tokens
                  and usage.prompt_tokens == reply.usage.prompt_tokens)
            check(ok, f"{image}: {text!r} / streamed {streamed!r} (usage {reply.usage}, streamed usage {usage})")

        def refused(error_type, what, **kwargs):
            try:
                client.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  **kwargs})
                check(False, f"{what} was accepted")
            except error_type as error:
                check(True, f"{what}: {type(error).__name__} ({error.status_code}): {error.message}")

        refused(openai.NotFoundError, "an unknown model", model="gpt-4")
        refused(openai.BadRequestError, "temperature 9", temperature=9)
        refused(openai.BadRequestError, "tool_choice required without tools", tool_choice="required")
        refused(openai.BadRequestError, "a tool name kvlite cannot write (refused, never ignored)",
                tools=[{"type": "function", "function": {"name": "a b", "parameters": {"type": "object"}}}])

        # Structured output as the client sends it: response_format json_schema, and tools with tool_choice required
        schema = {"type": "object", "properties": {"shape": {"enum": ["circle", "square", "triangle", "star"]},
                                                   "count": {"type": "integer", "minimum": 1, "maximum": 3}},
                  "required": ["shape", "count"]}
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe the scene."}], max_tokens=64, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "scene", "schema": schema, "strict": True}})
        try:
            value = json.loads(reply.choices[0].message.content)
            ok = (set(value) == {"shape", "count"} and value["shape"] in schema["properties"]["shape"]["enum"]
                  and 1 <= value["count"] <= 3)
        except ValueError:
            ok = False
        check(ok, f"response_format json_schema: {reply.choices[0].message.content!r}")
        tools = [{"type": "function", "function": {"name": "grasp", "description": "Grasp an object", "parameters": {
            "type": "object", "properties": {"object": {"enum": ["circle", "square"]}}, "required": ["object"]}}}]
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick it up."}],
                                               max_tokens=200, temperature=0, tools=tools, tool_choice="required")
        message = reply.choices[0].message
        calls = message.tool_calls or []
        ok = (reply.choices[0].finish_reason == "tool_calls" and len(calls) >= 1 and message.content is None
              and all(c.type == "function" and c.function.name == "grasp"
                      and json.loads(c.function.arguments)["object"] in ("circle", "square") for c in calls))
        check(ok, f"tools with tool_choice required: {[(c.function.name, c.function.arguments) for c in calls]}")
        refused(openai.BadRequestError, "presence_penalty 1", presence_penalty=1.0)
        refused(openai.BadRequestError, "a streamed prompt longer than the context (400 before the stream)",
                messages=[{"role": "user", "content": "a " * 20000}], stream=True)
        try:
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
            check(False, "a wrong API key was accepted")
        except openai.AuthenticationError as error:
            check(True, f"a wrong API key: AuthenticationError ({error.status_code})")

        # SIGTERM while a request streams on the client's pooled connection (and the pool holds others idle):
        # the request finishes whole, and the server exits as soon as it has.
        slow = {}

        def stream_long():
            text = ""
            for chunk in client.completions.create(model=MODEL, prompt="The", max_tokens=200, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text if chunk.choices else ""
                slow.setdefault("first", time.monotonic())
            slow["text"] = text

        thread = threading.Thread(target=stream_long)
        thread.start()
        while "first" not in slow and thread.is_alive():
            time.sleep(0.01)
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        drain = time.monotonic() - start
        thread.join(timeout=60)
        check(code == 0, f"SIGTERM: exit status {code}")
        check("text" in slow and len(slow["text"]) > 0, f"the request streaming at SIGTERM finished "
                                                        f"({len(slow.get('text', ''))} characters)")
        check(drain < 10, f"SIGTERM drained in {drain:.2f} s with the client's pooled connections open")
        print(f"{len(cases)} images through the openai {openai.__version__} client, {failures} failures")
        return 0 if failures == 0 else 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
