#!/usr/bin/env bash
# The GPU check, for a machine with one GPU and no network, from the repository root (the check itself is capped at 200 s):
#   bash scripts/device-check.sh            # writes data/bench/gpu/ (OUT=... to change)
# It runs `python -m dynchat device-check` (lossless in every mode on the device in bfloat16; the
# engine's ceiling with random Llama-3.1-8B-shaped weights, the target drafting for itself) and the
# bench on the demo preset. The device image has torch 2.11 and transformers 5.17: wheels of what the
# project pins differently are made beforehand, where the package index is reachable, with
#   bash scripts/device-check.sh --wheels   # into .device-wheels/ (gitignored; carry it to the device)
# Before a device run, here:
#   bash scripts/device-check.sh --dry-run  # the size of what travels, and the check's steps on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device-wheels
if [ "${1:-}" = "--dry-run" ]; then
  exec timeout 300 python -m dynchat device-check --dry-run --out "${OUT:-bench-out/device-dry-run}"
fi
LEFT_BEHIND=$(python -c "from dynchat.bench.device_check import LEFT_BEHIND; print(' '.join(LEFT_BEHIND))")
if [ "${1:-}" = "--slim" ]; then
  git rm -r -q --cached $LEFT_BEHIND
  for p in $LEFT_BEHIND; do echo "/$p/" >> .git/info/exclude; done
  echo "untracked for the device run (still on disk): $LEFT_BEHIND; run --unslim afterwards, before any commit"
  exit 0
fi
if [ "${1:-}" = "--unslim" ]; then
  for p in $LEFT_BEHIND; do grep -vxF "/$p/" .git/info/exclude > .git/info/exclude.new || true
    mv .git/info/exclude.new .git/info/exclude; done
  git reset -q -- $LEFT_BEHIND
  git status --short | head
  exit 0
fi
if [ "${1:-}" = "--wheels" ]; then
  # for the image's Python 3.12: the versions installed here of what the project pins past the image
  # (torch 2.11, transformers 5.17, huggingface_hub 1.33), and what those need that the image lacks or
  # has too old; the image's own numpy, pyyaml, tqdm, typer... serve the rest
  pins=$(python -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in \
('transformers', 'huggingface_hub', 'tokenizers', 'safetensors')))")
  rm -rf "$WHEELS"
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
    $pins httpx2 httpcore2 truststore kernels tomlkit "click>=8.4.2" "regex>=2025.10.22" "hf-xet>=1.6"
  du -sh "$WHEELS"
  exit 0
fi
OUT=${OUT:-data/bench/gpu}
mkdir -p "$OUT"
# The device image's torch lives in a virtual environment (/opt/torch/.venv), not in the first python3
# on PATH; it is called by its own path (a symlink to it would lose the environment). On a fresh
# machine its first `import torch` has taken over 5 minutes (2026-12-04): that is timed and printed.
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
  for candidate in /opt/*/.venv/bin/python3 /opt/*/bin/python3; do
    [ -x "$candidate" ] && PY=$candidate && break
  done
fi
echo "python: $PY"
have=$("$PY" -c "import importlib.metadata as m; print(m.version('transformers'))" 2>/dev/null || echo none)
carried=$(ls "$WHEELS"/transformers-*.whl 2>/dev/null | sed 's/.*transformers-\([^-]*\)-.*/\1/')
if [ -n "$carried" ] && [ "$have" != "$carried" ]; then   # into a folder of their own: the environment stays as it was
  echo "transformers $have here; the carried wheels bring $carried"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/dynchat-wheels "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/dynchat-wheels${PYTHONPATH:+:$PYTHONPATH} || echo "could not install the carried wheels"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SECONDS=0
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"
echo "imported torch and transformers in ${SECONDS} s" | tee -a "$OUT/versions.txt"
timeout 200 "$PY" -m dynchat device-check --device "${DEVICE:-cuda}" --out "$OUT" || echo "device-check stopped early"
