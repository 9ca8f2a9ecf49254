"""The GPU check's own logic, run on this CPU with small random models (the GPU run: scripts/device-check.sh)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

def test_the_dry_run_says_what_travels_and_runs_every_step_on_the_cpu(tmp_path):
    """`scripts/device-check.sh --dry-run`, as a session runs it before spending device time."""
    proc = subprocess.run(["bash", "scripts/device-check.sh", "--dry-run"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OUT": str(tmp_path)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    travel = json.loads(proc.stdout.splitlines()[0])["travel"]
    assert travel["limit_mib"] == 64 and travel["mib"] > 1 and travel["fits"] == (travel["mib"] <= 64)
    report = json.loads((tmp_path / "device_check.json").read_text())
    lossless, ceiling = report["lossless"], report["ceiling"]
    assert "error" not in lossless and "error" not in ceiling
    assert set(lossless["identical_to_plain"].values()) == {lossless["prompts"]}     # float32 on a CPU: exact
    reads = lossless["host_reads_per_target_forward"]
    assert reads["plain"] <= 1.0 and reads["eagle3-chain-4"] <= 2.0 and reads["eagle3-tree-4x5-16"] <= 3.0
    assert sorted(ceiling["target_forward_ms_by_tokens"]) == ["1", "17", "2", "5", "9"]
    methods = ceiling["methods"]
    # the target drafting for itself: every draft token is accepted
    assert methods["self-draft-k3"]["mean_accepted_length"] > 3.5 and methods["plain"]["speedup"] == 1.0
