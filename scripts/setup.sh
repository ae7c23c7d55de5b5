#!/usr/bin/env bash
# Create .venv/ and install deltaserve with its test extra. Idempotent: re-runs only when pyproject.toml changed.
# The CPU torch wheel is installed first and pinned, so pip never pulls a multi-GB CUDA build.
# On a GPU machine, install the torch build you need into .venv before running this (TORCH_SPEC="" skips the pin).
set -euo pipefail
cd "$(dirname "$0")/.."
# The chat page's browser test drives Debian's chromium: install it when missing and we are root (else it skips).
if [[ ! -x /usr/bin/chromium && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 ||
    echo "setup: could not install chromium; tests/test_chat_page.py will skip" >&2
fi
TORCH_SPEC="${TORCH_SPEC-torch==2.13.0}"
stamp=".venv/.setup-stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) ${TORCH_SPEC}"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then exit 0; fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [[ -n "$TORCH_SPEC" ]]; then
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  constraint="$(mktemp)"; echo "$TORCH_SPEC" > "$constraint"
  .venv/bin/python -m pip install -q -c "$constraint" -e ".[test]"
  rm -f "$constraint"
else
  .venv/bin/python -m pip install -q -e ".[test]"
fi
.venv/bin/python -c "from deltaserve.ops.cpu_kernels import kernels; kernels()"   # build the CPU kernels once
echo "$want" > "$stamp"
