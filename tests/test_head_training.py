"""Head training from a reply corpus: features recomputed from token ids (the target's own, resumable
by chunk), held-out prompts kept apart, a new head that starts as the target's layer, and a trained
or continued head the engine loads and decodes losslessly with."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import ROOT

from dynchat.engine.reply_shards import write_shard

TARGET = ROOT / "data" / "models" / "demo-target"


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def replies(tmp_path_factory, target):
    """A small reply corpus of the demo target: 8 first-stage prompts (greedy; 3 also sampled, one of
    them a held-out prompt), 2 two-turn second-stage prompts."""
    from transformers import AutoTokenizer

    from dynchat.train.responses import generate_batch

    folder = tmp_path_factory.mktemp("replies")
    tok = AutoTokenizer.from_pretrained(TARGET)
    first = [[{"role": "user", "content": q}] for q in (
        "What is the os module for?", "How do I read a file?", "Explain a for loop.", "What is a list?",
        "Write a function that adds two numbers.", "What does git commit do?", "What is an API?", "Sort a list.")]
    second = [first[0] + [{"role": "assistant", "content": "It talks to the operating system."},
                          {"role": "user", "content": "Give me an example."}],
              [{"role": "user", "content": "Summarize this: the os module lists files and reads paths."}]]
    for stage, chats in ((1, first), (2, second)):
        (folder / f"prompts-{stage}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    def respond(chats, temperature, name, index):
        ids = [list(tok.apply_chat_template(chats[i], add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]) for i in index]
        rows = generate_batch(target, ids, 12, temperature, [tok.eos_token_id], torch.Generator().manual_seed(0))
        write_shard(folder / name, index, rows, temperature, 1.0)
    respond(first, 0.0, "shard-s1-t0-000.npz", list(range(8)))
    respond(first, 0.7, "shard-s1-t0.7-000.npz", [1, 3, 5])
    respond(second, 0.0, "shard-s2-t0-000.npz", [0, 1])
    return folder


@pytest.fixture(scope="module")
def features(tmp_path_factory, replies):
    from dynchat.train.features import build

    out = tmp_path_factory.mktemp("features")
    build(TARGET, replies, out, chunk=4, batch=3)
    return out


def test_features_are_the_targets_own_and_a_stop_loses_one_chunk(features, replies, target):
    from dynchat.train.features import FeatureStore, build, corpus

    convs, _ = corpus(replies)
    store = FeatureStore(features)
    assert len(store.chunks) == 4 and len(store.train) + len(store.held) == len(convs) == 13
    assert store.layers == [2, 5, 7]
    # one conversation's stored features against a plain forward of its tokens
    k, j, _ = store.train[0]
    w = store.window(k, j, 1000)
    with torch.no_grad():
        out = target(input_ids=w["tokens"][None], output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in store.layers], -1)
    assert torch.allclose(w["features"].float(), want, rtol=0.02, atol=0.05)
    assert torch.allclose(w["normed"].float(), out.hidden_states[-1][0], rtol=0.02, atol=0.05)
    # the window's response positions are the response's tokens: the label after each is a response token
    c = store.chunks[k]
    assert int(w["response"].sum()) == len(w["tokens"]) - int(c["prompt_lens"][j])

    # a stop mid-run: the chunk in progress has no meta file; a rerun makes that chunk alone
    (features / "c00002-meta.npz").unlink()
    kept = {p: p.stat().st_mtime_ns for p in features.glob("c0000[013]-*")}
    summary = build(TARGET, replies, features, chunk=4, batch=3)
    assert summary["chunks"] == 4 and summary["conversations"] == 13
    assert {p: p.stat().st_mtime_ns for p in kept} == kept


def test_features_of_the_int4_target_are_what_its_forward_computes(features, replies, tmp_path):
    """`--weights int4`: the features and normed states of the target as the int4 preset runs it (its
    quantized blocks, int8 activations on the native kernels), which a head drafting for that preset
    reads; near float32's, not equal; a folder keeps one arithmetic."""
    from dynchat.engine.native import library
    from dynchat.train.features import FeatureStore, build

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    out = tmp_path / "int4"
    assert build(TARGET, replies, out, chunk=4, batch=3, weights="int4")["conversations"] == 13
    assert json.loads((out / "build.json").read_text())["weights"] == "int4"
    floats, ints = FeatureStore(features), FeatureStore(out)
    k, j, _ = ints.train[0]
    w4 = ints.window(k, j, 1000)
    w32 = floats.window(*next((a, b) for a, b, _ in floats.train
                              if torch.equal(floats.window(a, b, 1000)["tokens"], w4["tokens"])), 1000)
    for key in ("features", "normed"):
        a, b = w4[key].float(), w32[key].float()
        assert not torch.equal(a, b)
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98, key
    with pytest.raises(ValueError, match="other weights"):
        build(TARGET, replies, out, chunk=4, batch=3)


def test_a_grown_corpus_only_adds_chunks(features, replies, target, tmp_path):
    """Responses added later (a new stage) get chunks of their own; the chunks made before stay as they
    were, so a long feature run never has to start over when the corpus grows."""
    import shutil

    from transformers import AutoTokenizer

    from dynchat.train.features import FeatureStore, build
    from dynchat.train.responses import generate_batch

    grown, out = tmp_path / "replies", tmp_path / "features"
    shutil.copytree(replies, grown)
    shutil.copytree(features, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("c*")}
    chats = [[{"role": "user", "content": q}] for q in ("How do I rename a file?", "Why is the sky blue?")]
    (grown / "prompts-3.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    tok = AutoTokenizer.from_pretrained(TARGET)
    ids = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
           for c in chats]
    write_shard(grown / "shard-s3-t0-000.npz", [0, 1],
                generate_batch(target, ids, 12, 0.0, [tok.eos_token_id], torch.Generator().manual_seed(0)), 0.0, 1.0)
    summary = build(TARGET, grown, out, chunk=4, batch=3)
    assert summary["conversations"] == 15 and summary["chunks"] == 5
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("c*") if p.name in before} == before
    store = FeatureStore(out)
    assert sorted(int(store.chunks[4]["stage"][j]) for j in range(2)) == [3, 3]


def test_held_out_prompts_stay_out_of_training_at_every_temperature(features):
    from dynchat.train.features import FeatureStore

    store = FeatureStore(features, heldout_every=4)
    def keys(which):
        return {(int(store.chunks[k]["stage"][j]), int(store.chunks[k]["prompt_index"][j])) for k, j, _ in which}
    assert keys(store.held) == {(1, 3), (1, 7)}              # every 4th prompt of each stage
    assert keys(store.train).isdisjoint(keys(store.held))
    assert {t for _, _, t in store.held} == {0.0, 0.7}       # prompt 3 was also sampled: held out there too
    batch = store.batch(store.train, 5, 8, torch.Generator().manual_seed(0))
    assert batch["tokens"].shape[0] == 5 and batch["tokens"].shape[1] <= 8     # long ones cut to seq_len
    # a stage drawn with weight 0 never comes, one weighted up comes more often
    weights = store.stage_weights(store.train, {1: 0.0})
    gen = torch.Generator().manual_seed(0)
    drawn = torch.multinomial(weights, 200, replacement=True, generator=gen)
    assert {int(store.chunks[store.train[i][0]]["stage"][store.train[i][1]]) for i in drawn.tolist()} == {2}
    second = [w for w in store.train if int(store.chunks[w[0]]["stage"][w[1]]) == 2]
    starts = {tuple(t.tolist()) for t in store.tokens(second)}
    batch = store.batch(store.train, 6, 1000, gen, weights)
    for row in batch["tokens"]:
        assert any(tuple(row[:len(t)].tolist()) == t for t in starts)         # whole stage-2 conversations only


def test_a_new_head_starts_as_the_targets_top_feature_layer(target):
    """Step 0 of a target-initialised head computes what that target layer computes on its input."""
    from dynchat.train.head_init import new_head
    from dynchat.train.ttt import ttt_attention as _attention

    head = new_head(target, torch.arange(300), init_from_target=True).float()
    index = head.layer_ids(target.config.num_hidden_layers)[-1]
    seen = {}
    target.model.layers[index].register_forward_hook(lambda m, a, o: seen.__setitem__("out", o[0] if
                                                                                      isinstance(o, tuple) else o))
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47]])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in head.layer_ids(target.config.num_hidden_layers)], -1)
        hidden = head.fc(feats)
        x = head.layer_input(hidden, torch.roll(ids, -1, 1))
        attn, _ = _attention(head, x, torch.arange(ids.shape[1]), [])
        step0 = head.after_attention(hidden, attn)
    target.model.layers[index]._forward_hooks.clear()
    assert torch.allclose(step0, seen["out"], atol=1e-4)


@pytest.mark.slow
def test_a_trained_and_a_continued_head_decode_losslessly(features, tmp_path, capsys):
    from dynchat.cli import main
    from dynchat.engine.decoder import run
    from dynchat.engine.policies import make_policy
    from dynchat.presets.config import Preset
    from dynchat.presets.loading import load_engine

    first, second = tmp_path / "head", tmp_path / "continued"
    assert main(["train-eagle3-chat", "--target", str(TARGET), "--features", str(features), "--out", str(first),
                 "--steps", "3", "--batch-size", "2", "--draft-vocab", "300", "--heldout-every", "4"]) == 0
    assert main(["train-eagle3-chat", "--target", str(TARGET), "--features", str(features), "--out", str(second),
                 "--steps", "2", "--batch-size", "2", "--init-head", str(first), "--heldout-every", "4", "--seed", "1",
                 "--ttt-steps", "3", "--aligned-ttt"]) == 0
    config = json.loads((second / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 300
    metrics = json.loads((second / "metrics.json").read_text())
    assert metrics["heldout_top1_by_step_by_group_before"] and metrics["continued_from"]
    card = (second / "README.md").read_text()
    assert f"continued from {first}" in card and "3 steps" in card       # the first run's history goes on
    assert "--seed 1" in card              # a continuation drawing other conversations says so in its reproduce line
    assert "--ttt-steps 3 --aligned-ttt" in card and "step j counted where steps before it drafted" in card
    assert all(len(acc) == 5 for acc in metrics["heldout_top1_by_step_by_group"].values())   # judged at 5 steps
    capsys.readouterr()
    assert main(["train-eagle3-chat", "--target", str(TARGET), "--features", str(features), "--out", str(second),
                 "--steps", "2", "--batch-size", "2", "--init-head", str(first), "--heldout-every", "4", "--seed", "2"]) == 2
    assert "made with --seed 1" in capsys.readouterr().err       # its checkpoint's draw, not the one now asked for
    assert "templated and Magpie prompts, T=0.7: " in card              # held-out agreement by kind of prompt
    grown = tmp_path / "grown"           # --draft-vocab with --init-head: the continued head's vocabulary grows
    assert main(["train-eagle3-chat", "--target", str(TARGET), "--features", str(features), "--out", str(grown),
                 "--steps", "1", "--batch-size", "2", "--init-head", str(first), "--draft-vocab", "400",
                 "--heldout-every", "4"]) == 0
    assert json.loads((grown / "config.json").read_text())["draft_vocab_size"] == 400
    assert "grown from the continued head's 300" in (grown / "README.md").read_text()
    assert "--draft-vocab 400" in (grown / "README.md").read_text()        # its reproduce line grows it too
    again = ["train-eagle3-chat", "--target", str(TARGET), "--features", str(features), "--out", str(grown), "--steps",
             "1", "--batch-size", "2", "--init-head", str(first), "--heldout-every", "4", "--draft-vocab"]
    assert main(again + ["200"]) == 2 and "can grow, not shrink" in capsys.readouterr().err
    assert main(again + ["350"]) == 2 and "another draft vocabulary" in capsys.readouterr().err   # its checkpoint's
    wide = tmp_path / "wide"             # --intermediate-size with --init-head: the continued head's MLP widens
    width = json.loads((first / "config.json").read_text())["intermediate_size"]
    widen = ["train-eagle3-chat", "--target", str(TARGET), "--features", str(features), "--out", str(wide), "--steps",
             "1", "--batch-size", "2", "--init-head", str(first), "--heldout-every", "4", "--intermediate-size"]
    assert main(widen + [str(width + 16)]) == 0
    assert json.loads((wide / "config.json").read_text())["intermediate_size"] == width + 16
    card = (wide / "README.md").read_text()
    assert f"MLP widened from {width} to {width + 16}" in card and f"--intermediate-size {width + 16}" in card
    assert main(widen + [str(width - 8)]) == 2 and "not narrowed" in capsys.readouterr().err
    assert main(widen + [str(width + 32)]) == 2 and "another shape" in capsys.readouterr().err    # its checkpoint's
    for head in (first, second, grown, wide):
        engine = load_engine(Preset(name="t", target=str(TARGET), eagle3=str(head)))
        ids = engine.encode("What is the os module for?")
        base, _ = run(engine.decoder("baseline"), ids, 40)
        out, s = run(engine.decoder("eagle3", tree=None), ids, 40, policy=make_policy("constant", 3))
        assert out == base and s.draft_tokens > 0



@pytest.mark.slow
def test_a_draft_distilled_on_features_and_continued_decodes_losslessly(features, tmp_path, capsys):
    """The assistant draft trains on the same feature folder as the heads (the target's normed states give
    its distribution); a continued draft keeps its vocabulary and says what it continued."""
    from dynchat.cli import main
    from dynchat.engine.decoder import run
    from dynchat.engine.policies import make_policy
    from dynchat.presets.config import Preset
    from dynchat.presets.loading import load_engine, read_vocab

    first, second = tmp_path / "draft", tmp_path / "continued"
    assert main(["train-draft-chat", "--target", str(TARGET), "--features", str(features), "--out", str(first),
                 "--steps", "3", "--batch-size", "2", "--layers", "2", "--draft-vocab", "300", "--heldout-every", "4"]) == 0
    assert main(["train-draft-chat", "--target", str(TARGET), "--features", str(features), "--out", str(second),
                 "--steps", "2", "--batch-size", "2", "--init-draft", str(first), "--heldout-every", "4", "--seed", "2"]) == 0
    assert torch.equal(read_vocab(first), read_vocab(second)) and len(read_vocab(second)) == 300
    config = json.loads((second / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["dynchat_shared_embedding"]
    card = (second / "README.md").read_text()
    assert f"continued from {first}" in card and "3 steps" in card and "(before this run: " in card
    assert "--seed 2" in card
    capsys.readouterr()
    assert main(["train-draft-chat", "--target", str(TARGET), "--features", str(features), "--out", str(second),
                 "--steps", "2", "--batch-size", "2", "--init-draft", str(first), "--heldout-every", "4", "--seed", "3"]) == 2
    assert "made with --seed 2" in capsys.readouterr().err
    metrics = json.loads((second / "metrics.json").read_text())
    assert set(metrics["heldout_greedy_agreement"]) == set(metrics["heldout_greedy_agreement_before"]) == {
        "templated and Magpie prompts, T=0"}
    grown = tmp_path / "grown"           # --draft-vocab with --init-draft: the continued draft's vocabulary grows
    assert main(["train-draft-chat", "--target", str(TARGET), "--features", str(features), "--out", str(grown),
                 "--steps", "1", "--batch-size", "2", "--init-draft", str(first), "--draft-vocab", "400",
                 "--heldout-every", "4"]) == 0
    assert len(read_vocab(grown)) == 400 and bool(torch.isin(read_vocab(first), read_vocab(grown)).all())
    assert "grown from the continued draft's 300" in (grown / "README.md").read_text()
    again = ["train-draft-chat", "--target", str(TARGET), "--features", str(features), "--out", str(grown), "--steps",
             "1", "--batch-size", "2", "--init-draft", str(first), "--heldout-every", "4", "--draft-vocab"]
    assert main(again + ["200"]) == 2 and "can grow, not shrink" in capsys.readouterr().err
    assert main(again + ["350"]) == 2 and "another draft vocabulary" in capsys.readouterr().err   # its checkpoint's
    for draft in (first, second, grown):
        engine = load_engine(Preset(name="t", target=str(TARGET), assistant=str(draft)))
        ids = engine.encode("What is the os module for?")
        base, _ = run(engine.decoder("baseline"), ids, 40)
        out, s = run(engine.decoder("assistant", tree=None), ids, 40, policy=make_policy("constant", 3))
        assert out == base and s.draft_tokens > 0


def test_a_draft_continues_only_on_features(tmp_path, capsys):
    from dynchat.cli import main

    assert main(["train-draft-chat", "--target", str(TARGET), "--init-draft", str(ROOT / "data" / "models" / "demo-draft"),
                 "--out", str(tmp_path / "d")]) == 2
    assert "give --features" in capsys.readouterr().err and not (tmp_path / "d").exists()

def test_training_refuses_a_folder_without_features(tmp_path, capsys):
    from dynchat.cli import main

    assert main(["train-eagle3-chat", "--target", str(TARGET), "--features", str(tmp_path), "--out",
                 str(tmp_path / "h")]) == 2
    assert "run prepare-features first" in capsys.readouterr().err
    assert np.all([not p.exists() for p in (tmp_path / "h",)])
