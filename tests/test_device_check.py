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
    # room left for the carried wheels (--wheels: ~26 MiB)
    assert travel["slim_fits"] and travel["slim_mib"] - travel["wheels_mib"] < 36
    report = json.loads((tmp_path / "device_check.json").read_text())
    lossless, ceiling = report["lossless_float32"], report["ceiling"]
    assert "error" not in lossless and "error" not in ceiling
    assert set(lossless["identical_to_plain"].values()) == {lossless["prompts"]}     # float32: exact
    assert set(lossless["tokens_agreeing_before_parting"].values()) == {1.0}
    reads = lossless["host_reads_per_target_forward"]
    assert reads["plain"] <= 1.0 and reads["eagle3-chain-4"] <= 2.0 and reads["eagle3-tree-4x5-16"] <= 3.0
    assert sorted(ceiling["target_forward_ms_by_tokens"]) == ["1", "17", "2", "5", "9"]
    methods = ceiling["methods"]
    for context in (128, 512):
        row = f"ctx{context}/eagle3-" + "{}-accept-{}"
        assert methods[f"ctx{context}/plain"]["speedup"] == 1.0
        # scripted acceptance: rate 1 accepts every draft (a chain of 4: 5 tokens a round but the last)
        assert methods[row.format("chain-k4", 1)]["mean_accepted_length"] > 4.5
        assert methods[row.format("tree-4x5-16", 1)]["mean_accepted_length"] > 4.5
        assert 1.5 < methods[row.format("chain-k4", 0.7)]["mean_accepted_length"] < 3.5
        for name, m in methods.items():
            if "chain" in name:
                assert m["host_reads_per_target_forward"] <= 2.0, name
            if "tree" in name:
                assert m["host_reads_per_target_forward"] <= 3.0, name


def test_slim_leaves_out_what_the_check_never_reads_and_unslim_restores_the_index(tmp_path):
    """--slim untracks the files the device run does not need (they stay on disk); --unslim undoes it."""
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)

    def run(*args):
        return subprocess.run(["bash", "scripts/device-check.sh", *args], cwd=clone, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(clone)}, timeout=120)

    def tracked():
        return subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=clone, capture_output=True,
                              text=True, check=True).stdout.split()

    before = tracked()
    assert run("--slim").returncode == 0
    slim = tracked()
    assert not any(n.startswith(("data/models/smollm2-", "data/responses/", "docs/")) for n in slim)
    assert "data/models/demo-target/model.safetensors" in slim and (clone / "data/models/smollm2-eagle3").is_dir()
    assert run("--unslim").returncode == 0
    assert tracked() == before
    assert subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout == ""
