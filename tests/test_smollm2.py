"""The default preset on the real model: SmolLM2-135M-Instruct with its own EAGLE-3 head and draft.

Greedy output must be token-identical to Transformers' own `generate()` in every mode, through
the chat template, multi-turn history included, and a reply ends at the chat's end-of-turn token.
"""
from __future__ import annotations

import pytest
import torch

from dynchat.engine.decoder import run
from dynchat.engine.eagle_drafter import TreeShape
from dynchat.engine.policies import make_policy

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "How do I boil an egg?",
    "Write a haiku about rain.",
    "Write a Python function that adds two numbers.",
    "What is 12 times 12?",
    "Summarize: The shop opens at nine and closes at five, except on Sundays when it is closed.",
    "Rewrite this more politely: Give me the report.",
    "Tell me a fun fact about octopuses.",
]
MULTI_TURN = [{"role": "user", "content": "What is a good name for a dog?"},
              {"role": "assistant", "content": "How about Max, Bella or Charlie?"},
              {"role": "user", "content": "Which one suits a small white dog?"}]


def hf_greedy(engine, ids: list[int], max_new: int) -> list[int]:
    x = torch.tensor([ids])
    out = engine.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=engine.eos_token_ids, pad_token_id=engine.eos_token_ids[0])
    return out[0, len(ids):].tolist()


def test_default_preset_is_smollm2_with_all_modes(smollm2_engine, monkeypatch):
    from dynchat.presets.config import load_presets

    monkeypatch.delenv("DYNCHAT_PRESET", raising=False)
    assert load_presets()[1] == "smollm2-135m"
    assert smollm2_engine.modes == ["baseline", "lookup", "assistant", "eagle3"]
    assert smollm2_engine.tokenizer.convert_ids_to_tokens(smollm2_engine.eos_token_ids) == ["<|im_end|>"]
    run(smollm2_engine.decoder("baseline"), smollm2_engine.encode("Hi"), 2)
    # logged with every turn: the published 4-bit blocks, multiplied in float32 by default
    assert smollm2_engine.weights == "q4_1 blocks, float32 arithmetic"


def test_greedy_is_token_identical_to_transformers_generate_in_every_mode(smollm2_engine):
    engine = smollm2_engine
    accepted = {"lookup": 0, "assistant": 0, "eagle3": 0}
    for prompt in PROMPTS + [MULTI_TURN]:
        ids = engine.encode(prompt)
        reference = hf_greedy(engine, ids, 40)
        assert run(engine.decoder("baseline"), ids, 40)[0] == reference, prompt
        for mode in ("lookup", "assistant", "eagle3"):
            out, summary = run(engine.decoder(mode, tree=None), ids, 40, policy=make_policy("constant", 3))
            assert out == reference, (mode, prompt)
            accepted[mode] += summary.accepted_tokens
    # the draft and the head were trained for this target: most of their proposals are taken
    assert accepted["assistant"] > 40 and accepted["eagle3"] > 40, accepted
    assert accepted["lookup"] > 10, accepted         # drafted from the conversation and the shipped replies


def test_eagle3_tree_and_the_preset_defaults_are_lossless(smollm2_engine):
    engine = smollm2_engine
    ids = engine.encode(PROMPTS[1])
    reference = run(engine.decoder("baseline"), ids, 64)[0]
    assert run(engine.decoder("eagle3", tree=TreeShape(2, 4, 8)), ids, 64)[0] == reference
    from dynchat.presets.config import preset_policy

    assert engine.preset.default_mode() == "lookup" and len(engine.replies) >= 8000
    for mode in ("lookup", "assistant", "eagle3"):
        policy = make_policy(*preset_policy(engine.preset, None, None, mode))
        assert run(engine.decoder(mode), ids, 64, policy=policy)[0] == reference, mode


def test_multi_turn_history_goes_through_the_chat_template(smollm2_engine):
    engine = smollm2_engine
    ids = engine.encode(MULTI_TURN)
    text = engine.tokenizer.decode(ids)
    assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "Max, Bella or Charlie" in text


def test_a_short_answer_stops_at_end_of_turn(smollm2_engine):
    engine = smollm2_engine
    out, summary = run(engine.decoder("eagle3", tree=None), engine.encode(PROMPTS[0]), 100,
                       policy=make_policy("constant", 4))
    assert len(out) < 30 and out[-1] in engine.eos_token_ids
    assert "Paris" in engine.decode(out)
