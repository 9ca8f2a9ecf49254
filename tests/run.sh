#!/usr/bin/env bash
# The README's test command: installs what the suite needs on a fresh machine, then runs it.
# Debian's chromium drives the real-browser test (Playwright's own browser download does not
# work offline); Python packages come from requirements*.txt, vLLM from scripts/install-vllm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium; the browser test will fail in CI"
  fi
fi
python -m pip install -q -r requirements.txt -r requirements-dev.txt
# vLLM in its own venv for the `engine: vllm` tests (tests/test_vllm.py); required here, not skipped
bash scripts/install-vllm.sh
export DYNCHAT_REQUIRE_VLLM=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m ruff check .
python -m pytest -q -p no:cacheprovider "$@"
