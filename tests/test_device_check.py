"""The GPU check's own logic, run on this CPU with small random models (the GPU run: scripts/device-check.sh)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

def test_device_check_runs_every_step_and_writes_its_report(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dynchat", "device-check", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    lossless, ceiling = report["lossless"], report["ceiling"]
    assert "error" not in lossless and "error" not in ceiling
    assert set(lossless["identical_to_plain"].values()) == {lossless["prompts"]}     # float32 on a CPU: exact
    assert sorted(ceiling["target_forward_ms_by_tokens"]) == ["1", "17", "2", "5", "9"]
    methods = ceiling["methods"]
    # the target drafting for itself: every draft token is accepted
    assert methods["self-draft-k3"]["mean_accepted_length"] > 3.5 and methods["plain"]["speedup"] == 1.0
