"""The embedded demo models: they load offline, draft losslessly, and their drafts are mostly accepted."""
from __future__ import annotations

from conftest import ROOT

from dynchat.engine.decoder import run
from dynchat.engine.policies import make_policy
from dynchat.presets.config import get_preset
from dynchat.presets.loading import load_engine

MODELS = ROOT / "data" / "models"


def test_demo_preset_loads_offline_and_chats():
    engine = load_engine(get_preset("demo"))
    assert engine.modes == ["baseline", "lookup", "assistant", "eagle3"]
    assert engine.target.config.num_hidden_layers >= 10
    assert sum(p.numel() for p in engine.assistant.parameters()) <= 1.5e6
    ids = engine.encode("What does the function json.dumps do?")
    base, _ = run(engine.decoder("baseline"), ids, 32)
    spec, s = run(engine.decoder("assistant"), ids, 32)
    assert base == spec and s.accepted_tokens > 0
    text = engine.decode(base)
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)


def test_demo_eagle3_head_is_lossless_and_accepted():
    engine = load_engine(get_preset("demo"))
    for prompt in ("What does the function json.dumps do?", "The os module provides"):
        ids = engine.encode(prompt, raw=prompt.startswith("The"))
        base, _ = run(engine.decoder("baseline"), ids, 48)
        for tree in (None, __import__("dynchat.engine.eagle_drafter", fromlist=["TreeShape"]).TreeShape(2, 4, 8)):
            out, s = run(engine.decoder("eagle3", tree=tree), ids, 48)
            assert out == base and s.mean_accepted_length > 1.5, (prompt, tree, s.mean_accepted_length)


def test_demo_other_tokenizer_draft_is_lossless_and_accepted():
    engine = load_engine(get_preset("demo-other-tokenizer"))
    assert engine.assistant_tokenizer_differs and len(engine.assistant_tokenizer) == 3072
    before = {k: v.clone() for k, v in engine.assistant.state_dict().items()}
    accepted = 0
    for prompt in ("What does the function json.dumps do?", "The os module provides a portable way of"):
        ids = engine.encode(prompt, raw=prompt.startswith("The"))
        base, _ = run(engine.decoder("baseline"), ids, 64)
        out, s = run(engine.decoder("assistant"), ids, 64)
        assert out == base
        accepted += s.accepted_tokens
    assert accepted >= 15
    assert all(__import__("torch").equal(v, engine.assistant.state_dict()[k]) for k, v in before.items())


def test_demo_assistant_is_lossless_and_mostly_accepted():
    engine = load_engine(get_preset("demo"))
    for prompt in ("What does the function json.dumps do?", "The os module provides"):
        ids = engine.encode(prompt, raw=prompt.startswith("The"))
        base, _ = run(engine.decoder("baseline"), ids, 48)
        out, s = run(engine.decoder("assistant", lookup=False), ids, 48, policy=make_policy("constant", 3))
        assert out == base and s.acceptance_rate >= 0.5, (prompt, s.acceptance_rate)

