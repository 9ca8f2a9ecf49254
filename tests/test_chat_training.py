"""The chat-data pipeline end to end on the demo target: prompts and responses with captured
features, a truncated draft trained on them and loaded by the engine (heads train on
prepare-features' output: tests/test_head_training.py)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT

from dynchat.engine.decoder import run
from dynchat.engine.policies import make_policy
from dynchat.presets.config import Preset
from dynchat.presets.loading import load_engine

pytestmark = pytest.mark.slow

TARGET = ROOT / "data" / "models" / "demo-target"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from dynchat.train.chat_data import build

    work = tmp_path_factory.mktemp("chat-data")
    build(TARGET, work, n_template=10, n_magpie=0, n_follow_up=2, temperatures={0.0: 0, 0.7: 4}, max_new=16,
          batch=8, shard_size=8)
    return work


def test_shards_hold_features_aligned_with_tokens(work):
    from dynchat.train.chat_data import load_shards

    items, n_prompts, layers = load_shards([work])
    assert n_prompts == 12 and len(items) == 12 + 4 and layers == [2, 5, 7]
    prompts = [json.loads(line)["messages"] for line in (work / "prompts.jsonl").read_text().splitlines()]
    assert sum(len(m) == 3 for m in prompts) == 2          # the two-turn follow-ups
    for it in items:
        n = len(it["tokens"])
        assert it["features"].shape == (n, 3 * 256) and it["normed"].shape == (n, 256) and n > it["prompt_len"]
    # the captured features are the target's own: recompute one sequence's in a plain forward
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    it = items[0]
    with torch.no_grad():
        out = target(input_ids=torch.tensor([it["tokens"]]), output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    assert torch.allclose(it["features"].float(), expected, rtol=0.02, atol=0.05)


def test_trained_draft_loads_and_decodes_losslessly(work, tmp_path):
    from dynchat.train.draft_chat import DraftPlan
    from dynchat.train.draft_chat import train as train_draft

    draft_dir = tmp_path / "draft"
    train_draft(TARGET, [work], draft_dir, DraftPlan(layers=2, steps=2, batch_size=2, seq_len=64, draft_vocab=300))
    draft_config = json.loads((draft_dir / "config.json").read_text())
    assert draft_config["dynchat_shared_embedding"] and draft_config["num_hidden_layers"] == 2

    engine = load_engine(Preset(name="t", target=str(TARGET), assistant=str(draft_dir)))
    # the draft borrows the target's embedding and proposes from its 300 tokens only
    assert engine.assistant.get_input_embeddings().weight.data_ptr() == engine.target.get_input_embeddings().weight.data_ptr()
    assert engine.assistant.draft_vocab_ids.numel() == 300
    ids = engine.encode("What is the os module for?")
    base, _ = run(engine.decoder("baseline"), ids, 40)
    out, s = run(engine.decoder("assistant", tree=None), ids, 40, policy=make_policy("constant", 3))
    assert out == base and s.draft_tokens > 0


def test_draft_trainer_reads_several_work_dirs_from_the_command_line(work, tmp_path, capsys):
    """Data made by several prepare-chat-data runs trains one draft; each prompt of each dir is
    either trained on or held out, never both."""
    import shutil

    from dynchat.cli import main
    from dynchat.train.chat_data import load_shards, split

    second = tmp_path / "second"
    shutil.copytree(work, second)
    items, n_prompts, _ = load_shards([work, second])
    assert n_prompts == 24 and len(items) == 32
    trained, held = split(items, 4)
    assert {it["prompt_index"] for it in trained}.isdisjoint({it["prompt_index"] for it in held}) and held
    assert {it["temperature"] for it in held} == {0.0, 0.7}          # held out of the sampled set too
    out = tmp_path / "draft"
    assert main(["train-draft-chat", "--target", str(TARGET), "--work-dir", str(work), str(second), "--out", str(out),
                 "--steps", "1", "--batch-size", "1", "--layers", "2", "--draft-vocab", "300"]) == 0
    card = (out / "README.md").read_text()
    assert card.count("prepare-chat-data") == 2 and str(second) in card      # how each dir was made
