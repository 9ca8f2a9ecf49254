#!/usr/bin/env bash
# The GPU check, for a machine with one GPU and no network, from the repository root (about 8 minutes):
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
  python -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" \
    "transformers>=5.24,<6" "huggingface_hub>=1.0,<2" "tokenizers>=0.22" "safetensors>=0.4"
  du -sh "$WHEELS"
  exit 0
fi
OUT=${OUT:-data/bench/gpu}
mkdir -p "$OUT"
if [ -d "$WHEELS" ]; then
  python -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || echo "could not install the carried wheels"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"
timeout 200 python -m dynchat device-check --device "${DEVICE:-cuda}" --out "$OUT" || echo "device-check stopped early"
