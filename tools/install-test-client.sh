#!/usr/bin/env bash
# Installs the official `openai` Python client (PyPI; not in Debian) into the project-local .venv-test/, pinned by
# tools/requirements-test.txt, for tests/serve_openai_client.py. Idempotent: a venv already made from the same
# requirements is left alone. Needs python3-venv (tools/install-deps.sh installs it).
# Without PyPI it warns and exits 0 (the test then skips, saying so) -- except where CI=true: a CI run that
# cannot install the client fails here, so the test never skips in CI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-test"
requirements="$root/tools/requirements-test.txt"
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
fail() {
  if [ "${CI:-}" = true ]; then echo "kvlite: $1 (CI=true: failing, the openai client test must not skip)" >&2; exit 1; fi
  echo "kvlite: warning: $1; tests/serve_openai_client.py will skip" >&2
  exit 0
}
echo "kvlite: installing the openai client into .venv-test/ (tools/requirements-test.txt)"
rm -rf "$venv"
/usr/bin/env python3 -m venv "$venv" >/dev/null 2>&1 || fail "python3 -m venv failed (Debian: python3-venv)"
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$requirements" >/dev/null 2>&1 ||
  { rm -rf "$venv"; fail "pip could not install tools/requirements-test.txt from PyPI"; }
"$venv/bin/python" -c "import openai" || { rm -rf "$venv"; fail "openai does not import in .venv-test/"; }
echo "$want" > "$stamp"
