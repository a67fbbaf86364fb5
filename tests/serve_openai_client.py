#!/usr/bin/env python3
"""kvlite serve against the official `openai` Python client, on loopback: the client a vLLM user already has
captions the example images (streamed and not), lists the model and gets OpenAI's error types.

    tests/serve_openai_client.py BUILD_DIR      (from the repository root)

Exit 77 (ctest: skipped) when the `openai` package is absent: it is a dev-environment package (PyPI), never a
need of `make test`.
"""
import base64
import os
import subprocess
import sys

try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (pip install openai); curl and C++ clients cover the server")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    build = sys.argv[1]
    model = os.path.join(ROOT, "models", "kvlite-captioner-bf16")
    server = subprocess.Popen([os.path.join(build, "kvlite"), "serve", model, "--port", "0", "--backend", "cpu"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        for line in server.stdout:
            if line.startswith("kvlite serve:") and "http://127.0.0.1:" in line:
                port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
                break
        if port is None:
            print("kvlite serve did not start")
            return 1
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        served = [m.id for m in client.models.list().data]
        assert served == ["kvlite-captioner-bf16"], served
        failures = 0
        with open(os.path.join(ROOT, "examples", "images", "captions.txt")) as f:
            cases = [line.rstrip("\n").split("\t") for line in f if line.strip()]
        for image, expected in cases:
            with open(os.path.join(ROOT, "examples", "images", image), "rb") as f:
                url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "Describe this image."}]}]
            reply = client.chat.completions.create(model="kvlite-captioner-bf16", messages=messages, max_tokens=64)
            text = reply.choices[0].message.content
            streamed = "".join(chunk.choices[0].delta.content or ""
                               for chunk in client.chat.completions.create(model="kvlite-captioner-bf16",
                                                                           messages=messages, max_tokens=64,
                                                                           stream=True)
                               if chunk.choices)
            ok = text == expected and streamed == expected and reply.choices[0].finish_reason == "stop"
            failures += not ok
            print(f"{image}: {'ok' if ok else 'WRONG'}  {text!r} / streamed {streamed!r} (usage {reply.usage})")
        try:
            client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
            print("an unknown model was accepted")
            failures += 1
        except openai.NotFoundError as error:
            print(f"unknown model: NotFoundError ({error.status_code})")
        try:
            client.chat.completions.create(model="kvlite-captioner-bf16", messages=[{"role": "user", "content": "hi"}],
                                           temperature=9)
            print("temperature 9 was accepted")
            failures += 1
        except openai.BadRequestError as error:
            print(f"temperature 9: BadRequestError ({error.status_code}): {error.message}")
        print(f"{len(cases)} images through the openai client, {failures} failures")
        return 0 if failures == 0 else 1
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
