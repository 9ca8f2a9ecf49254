"""The SmolLM2 presets on the real model: SmolLM2-135M-Instruct with its own EAGLE-3 head and draft.

On the published blocks in float32 arithmetic (`smollm2-135m`), greedy output must be token-identical
to Transformers' own `generate()` in every mode, through
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


def test_the_default_preset_runs_the_published_blocks_as_llama_cpp_does_and_every_mode_is_lossless(monkeypatch):
    """What a newcomer meets: the same published file, in integer dot products (int4 x int8 activations),
    lookup mode; each mode's greedy output is that preset's own plain decoding, token for token."""
    from dynchat.engine.native import library
    from dynchat.presets.config import load_presets
    from dynchat.presets.loading import load_engine

    monkeypatch.delenv("DYNCHAT_PRESET", raising=False)
    presets, default = load_presets()
    preset = presets[default]
    assert default == "smollm2-135m-int4" and preset.generation["mode"] == "lookup"
    assert preset.target == presets["smollm2-135m"].target and preset.quantization == "int4" and preset.int_dot
    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    engine = load_engine(preset)
    from dynchat.engine.reply_shards import load_replies

    held_out = len(engine.held_out_replies)          # shipped replies kept out of lookup's index ...
    assert held_out >= 40 and len(engine.replies) + held_out == len(load_replies(preset.replies, 0.0))
    engine.warm_up()                                 # ... calibrate its estimates before the first reply
    assert engine.lookup_calibration.seen.sum() > 1000 and engine.held_out_replies is None
    for prompt in (PROMPTS[1], MULTI_TURN):
        ids = engine.encode(prompt)
        base, _ = run(engine.decoder("baseline"), ids, 48)
        assert engine.weights == "int4 x int8 activations"
        for mode in ("lookup", "assistant", "eagle3"):
            assert run(engine.decoder(mode), ids, 48, policy=make_policy("throughput"))[0] == base, (mode, prompt)


def test_the_float32_arithmetic_preset_has_all_modes(smollm2_engine):
    assert smollm2_engine.modes == ["baseline", "lookup", "assistant", "eagle3"]
    assert smollm2_engine.tokenizer.convert_ids_to_tokens(smollm2_engine.eos_token_ids) == ["<|im_end|>"]
    run(smollm2_engine.decoder("baseline"), smollm2_engine.encode("Hi"), 2)
    # logged with every turn: the published 4-bit blocks, multiplied in float32 arithmetic
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


def test_lookup_replay_models_what_a_larger_reply_index_buys(smollm2_folder, capsys):
    """The replay tool walks held-out replies against shares of the shipped index: more of the target's
    own replies indexed, more of a held-out reply drafted (docs/benchmarks.md reads its figures)."""
    from pathlib import Path

    from dynchat.bench.lookup_replay import main
    from dynchat.presets.config import get_preset

    replies = Path(__file__).resolve().parents[1] / "data" / "responses" / "smollm2"
    assert main(["--target", get_preset("smollm2-135m").target, "--replies", str(replies),
                 "--holdout", "s3-t0-013", "--limit", "40", "--index-fractions", "0,1"]) == 0
    out = capsys.readouterr().out
    speedups = [float(line.split()[2]) for line in out.splitlines() if line.startswith("modelled speedup")]
    assert len(speedups) == 2 and out.count("replaying 40") == 2, out
    assert speedups[1] > speedups[0] > 1.0, out
