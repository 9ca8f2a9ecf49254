"""models.yaml validation names the exact problem."""
from __future__ import annotations

import pytest

from dynchat.presets.config import ConfigError, get_preset, load_presets, parse


def write(tmp_path, text):
    p = tmp_path / "models.yaml"
    p.write_text(text)
    return p


def test_shipped_file_is_valid_and_demo_is_local(monkeypatch):
    monkeypatch.delenv("DYNCHAT_PRESET", raising=False)
    presets, default = load_presets()
    assert default == "smollm2-135m-int4"      # the published 4-bit blocks, as llama.cpp multiplies them
    demo = presets["demo"]
    assert demo.target.endswith("data/models/demo-target") and demo.assistant.endswith("data/models/demo-draft")
    assert {"llama-3.1-8b", "qwen3-8b", "gemma-2-9b-uag"} <= set(presets)
    assert presets["llama-3.1-8b"].eagle3 == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert presets["llama-3.1-8b"].modes == ["baseline", "lookup", "assistant", "eagle3"]
    assert presets["demo-vllm"].modes == ["baseline", "assistant", "eagle3"]      # vLLM: its servers


@pytest.mark.parametrize("text, message", [
    ("presets: {a: {target: org/m, colour: red}}", "unknown key(s) colour"),
    ("presets: {a: {assistant: org/m}}", "`target` is required"),
    ("presets: {a: {target: org/m, dtype: float8}}", "dtype 'float8' is not one of"),
    ("presets: {a: {target: org/m, device: tpu}}", "device 'tpu'"),
    ("presets: {a: {target: ./nowhere}}", "local path './nowhere' does not exist"),
    ("presets: {a: {target: data/models/missing}}", "does not exist"),
    ("default: b\npresets: {a: {target: org/m}}", "default preset 'b' is not defined"),
    ("presets: {a: {target: org/m, generation: {speed: 3}}}", "unknown generation setting"),
    ("presets: {a: {target: org/m, generation: {assistant_start_after: -1}}}", "assistant_start_after must be an integer >= 0"),
    ("presets: {a: {target: org/m, generation: {lookup_branches: sometimes}}}", "lookup_branches must be true or false"),
    ("colour: 1\npresets: {a: {target: org/m}}", "unknown top-level key(s) colour"),
    ("presets: []", "`presets` must be a non-empty mapping"),
    ("- just\n- a list", "top level must be a mapping"),
    ("presets: {a: {target: org/m}", "not valid YAML"),
    ("presets: {a: {target: org/m, replies: no/such/folder}}", "replies 'no/such/folder' is not a folder"),
    ("presets: {a: {target: org/m, engine: vllm, vllm: {urls: {lookup: 'http://x'}}}}", "vllm.urls maps modes"),
])
def test_errors_name_the_problem(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_presets(write(tmp_path, text))
    assert message in str(e.value)


def test_hub_ids_are_kept_and_local_paths_resolved(tmp_path):
    (tmp_path / "m").mkdir()
    presets, default = parse({"presets": {"a": {"target": "m", "assistant": "org/small"}}}, tmp_path)
    assert presets["a"].target == str(tmp_path / "m") and presets["a"].assistant == "org/small"
    assert default == "a"


def test_environment_overrides(tmp_path, monkeypatch):
    path = write(tmp_path, "default: a\npresets: {a: {target: org/m}, b: {target: org/n}}")
    monkeypatch.setenv("DYNCHAT_MODELS", str(path))
    monkeypatch.setenv("DYNCHAT_PRESET", "b")
    assert get_preset().name == "b"
    monkeypatch.setenv("DYNCHAT_PRESET", "zzz")
    with pytest.raises(ConfigError, match="DYNCHAT_PRESET='zzz': no such preset"):
        get_preset()
    monkeypatch.delenv("DYNCHAT_PRESET")
    with pytest.raises(ConfigError, match="no such preset 'c'"):
        get_preset("c")


def test_a_presets_head_or_draft_can_be_swapped_from_the_command_line(tmp_path, monkeypatch):
    """`bench --preset P --eagle3 DIR` measures a freshly trained head with everything else of P."""
    from argparse import Namespace

    from dynchat.presets.config import preset_from_flags

    (tmp_path / "new-head").mkdir()
    monkeypatch.chdir(tmp_path)
    flags = dict(preset="smollm2-135m-int4", target=None, assistant=None, eagle3=None)
    shipped = preset_from_flags(Namespace(**flags))
    swapped = preset_from_flags(Namespace(**{**flags, "eagle3": "new-head"}))
    assert swapped.eagle3 == str(tmp_path / "new-head") != shipped.eagle3
    assert (swapped.target, swapped.quantization, swapped.generation) == \
        (shipped.target, shipped.quantization, shipped.generation)
    with pytest.raises(ConfigError, match="--eagle3: local path './missing' does not exist"):
        preset_from_flags(Namespace(**{**flags, "eagle3": "./missing"}))


def test_a_small_server_leaves_a_core_to_a_local_browser_but_a_space_keeps_both(monkeypatch):
    """On 4 cores or fewer the app's model work leaves one core free when the browser may share the
    machine; a Space's browsers are remote, so it keeps every core; DYNCHAT_THREADS wins over both."""
    import os

    import torch

    from dynchat.engine.decoder import Decoder
    from dynchat.presets.threads import set_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("DYNCHAT_THREADS", raising=False)
    monkeypatch.setattr(Decoder, "prompt_threads", None)
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("SPACE_ID", raising=False)
        assert set_cpu_threads(serving=True) == 1
        assert Decoder.prompt_threads == 2          # ... but a prompt's prefill, while the page waits, takes both
        torch.set_num_threads(2)
        monkeypatch.setenv("SPACE_ID", "someone/dynchat")
        assert set_cpu_threads(serving=True) == 2 and Decoder.prompt_threads is None
        monkeypatch.setenv("DYNCHAT_THREADS", "1")
        assert set_cpu_threads(serving=True) == 1 and Decoder.prompt_threads is None
        monkeypatch.delenv("DYNCHAT_THREADS")
        monkeypatch.delenv("SPACE_ID")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
        torch.set_num_threads(8)            # a larger machine keeps torch's count, for prefill too
        assert set_cpu_threads(serving=True) == 8 and Decoder.prompt_threads is None
    finally:
        torch.set_num_threads(before)
