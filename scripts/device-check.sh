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
timeout 360 python -m dynchat device-check --device "${DEVICE:-cuda}" --out "$OUT" || echo "device-check stopped early"
timeout 150 python -m dynchat bench --preset demo --device "${DEVICE:-cuda}" --dtype bfloat16 --repeats 1 --limit 8 \
  --max-new-tokens 96 --out "$OUT/demo" > "$OUT/demo-bench.txt" 2>&1 || echo "the demo bench stopped early"
tail -n 25 "$OUT/demo-bench.txt"
