"""How many CPU threads a serving engine takes: on a machine of 4 cores or fewer a small target leaves
one core to the web server, a large one takes them all; DYNCHAT_THREADS wins over both."""
import os

import pytest
import torch

from dynchat.presets.config import ConfigError
from dynchat.presets.threads import ALL_CORES_FROM_BYTES, set_cpu_threads


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("DYNCHAT_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_small_target_leaves_a_core_to_the_server_and_a_large_one_takes_every_core(two_cores):
    assert set_cpu_threads(serving=True) == 1                                   # not loaded yet: the small case
    assert set_cpu_threads(serving=True, step_bytes=34_000_000) == 1            # the demo target
    assert set_cpu_threads(serving=True, step_bytes=97_000_000) == 2            # SmolLM2 on its 4-bit blocks
    assert ALL_CORES_FROM_BYTES <= 97_000_000


def test_dynchat_threads_wins_and_is_checked(two_cores, monkeypatch):
    monkeypatch.setenv("DYNCHAT_THREADS", "1")
    assert set_cpu_threads(serving=True, step_bytes=500_000_000) == 1
    monkeypatch.setenv("DYNCHAT_THREADS", "two")
    with pytest.raises(ConfigError, match="DYNCHAT_THREADS must be a positive whole number"):
        set_cpu_threads(serving=True)


def test_an_engine_knows_the_bytes_its_step_streams():
    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    engine = load_engine(get_preset("demo"))
    params = sum(p.numel() * p.element_size() for p in engine.target.parameters())
    assert 0.5 * params < engine.step_bytes <= params          # every matrix once; the embedding a row per token
