"""The bench's summary: speedups against the baseline, and acceptance pooled as vLLM's counters pool it."""
from __future__ import annotations

import pandas as pd
import pytest

from dynchat.bench.engine import summarise


def _run(method, prompt, tps, new, rounds=0, drafted=0, accepted=0):
    return {"method": method, "prompt_id": prompt, "tokens_per_s": tps, "new_tokens": new,
            "draft_rounds": rounds, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / rounds if rounds else 1.0,
            "per_position_acceptance": [], "same_as_baseline": True}


def test_acceptance_pools_counts_so_a_short_reply_weighs_by_its_rounds():
    df = pd.DataFrame([
        _run("baseline", 0, 100.0, 96), _run("baseline", 1, 100.0, 9),
        _run("spec", 0, 200.0, 96, rounds=24, drafted=96, accepted=71),   # tau 3.96
        _run("spec", 1, 120.0, 9, rounds=4, drafted=16, accepted=4),      # tau 2.0
        {**_run("hf", 0, 80.0, 96), "draft_rounds": None, "draft_tokens": None, "accepted_tokens": None,
         "acceptance_rate": None, "mean_accepted_length": None},
        {**_run("hf", 1, 80.0, 9), "draft_rounds": None, "draft_tokens": None, "accepted_tokens": None,
         "acceptance_rate": None, "mean_accepted_length": None},
    ])
    table = summarise(df)
    spec = table.loc["spec"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + 75 / 28)      # not the mean of 3.96 and 2.0
    assert spec["acceptance_rate"] == pytest.approx(75 / 112)
    assert spec["speedup"] == pytest.approx((2.0 + 1.2) / 2)                # median over prompts of per-prompt ratios
    assert table.loc["baseline", "mean_accepted_length"] == 1.0 and table.loc["baseline", "acceptance_rate"] == 0.0
    assert pd.isna(table.loc["hf", "mean_accepted_length"]) and pd.isna(table.loc["hf", "acceptance_rate"])
    assert table.loc["hf", "speedup"] == pytest.approx(0.8)


@pytest.mark.slow
def test_bench_reports_identical_tokens_decode_rate_and_weight_streaming(tmp_path):
    """`dynchat bench` on the demo: the methods' tokens equal the baseline's, the decode-only rate (what
    llama.cpp's tg reports) is given for our loop, and the GB/s figure counts every weight a step reads once."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    root = Path(__file__).resolve().parents[1]
    # a built llama.cpp peer (its script's output format), measured before and after ours
    peers = tmp_path / "peers"
    (peers / "build" / "bin").mkdir(parents=True)
    (peers / "build" / "bin" / "llama-bench").touch()
    (peers / "smol-q8_0.gguf").touch()
    fake = tmp_path / "llamacpp-peer"
    fake.write_text("#!/bin/sh\necho 'llama.cpp f32 tg128: 40.0 tokens/s'\necho 'llama.cpp q8_0 tg128: 120.0 tokens/s'\n"
                    "echo 'llama.cpp q8_0 forward of k tokens at depth 128: k=1 11.0 ms, k=5 25.5 ms'\n")
    fake.chmod(0o755)
    env = {**os.environ, "DYNCHAT_PEER": str(fake), "DYNCHAT_PEERS": str(peers)}
    r = subprocess.run([sys.executable, "-m", "dynchat", "bench", "--preset", "demo", "--limit", "2", "--repeats", "1",
                        "--max-new-tokens", "24", "--min-seconds", "5", "--methods", "baseline,eagle3-chain-constant-3", "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, cwd=root, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert out["llama_cpp"]["runs"] == 2 and out["llama_cpp"]["q8_0_forward_ms"] == {"1": 11.0, "5": 25.5}
    versus = out["plain_vs_llama_cpp"]                   # the demo runs float32: compared with llama.cpp's F32
    assert versus["llama_cpp_file"] == "f32" and versus["ratio"] == pytest.approx(
        out["methods"]["baseline"]["decode_tokens_per_s"] / 40.0)
    assert "x llama.cpp f32" in r.stdout
    methods = out["methods"]
    assert methods["eagle3-chain-constant-3"]["same_tokens_as_baseline"]
    # short replies get passes past --repeats 1 until each method's add up to --min-seconds (5 s: more than
    # a 24-token demo reply takes even on a loaded machine, where the default 0.3 s was not)
    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    per_prompt = runs.groupby(["prompt_id", "method"]).size()
    assert (per_prompt > 1).all() and per_prompt.groupby(level=0).nunique().eq(1).all()
    assert all(m["decode_tokens_per_s"] > 0 for m in methods.values())
    # where the time went, by tokens verified a round: plain decoding verifies one and commits one a round;
    # the rounds of every method add up to its replies' tokens after the first (the prefill's)
    rounds = pd.read_csv(tmp_path / "out" / "rounds.csv")
    plain = rounds[rounds.method == "baseline"]
    assert plain.verified_tokens.tolist() == [1] and plain.tokens_per_round.iloc[0] == 1.0
    assert plain.draft_ms.iloc[0] == 0.0 and plain.verify_ms.iloc[0] > 0
    for name, got in rounds.groupby("method"):
        assert (got.rounds * got.tokens_per_round).sum() == pytest.approx((runs[runs.method == name].new_tokens - 1).sum())
        assert got.share_of_time.sum() == pytest.approx(1.0)
    assert rounds[rounds.method == "eagle3-chain-constant-3"].verified_tokens.max() == 4
    target = load_engine(get_preset("demo")).target
    params = sum(p.numel() * p.element_size() for p in target.parameters())
    embed = target.get_input_embeddings().weight
    if embed.data_ptr() != target.get_output_embeddings().weight.data_ptr():
        params -= embed.numel() * embed.element_size()           # a step reads one row of an untied embedding
    streamed = out["weight_streaming"]
    assert streamed["weight_mb"] == pytest.approx(params / 1e6, rel=1e-6)
    assert streamed["gb_per_s"] == pytest.approx(streamed["weight_mb"] / out["verify_ms_by_tokens"]["1"])
    assert "GB/s" in r.stdout
    # the memory's read rate, measured in the same run, and the step's share of it
    assert 0.1 < streamed["memory_read_gb_per_s"] < 10_000
    assert streamed["share_of_memory_read"] == pytest.approx(streamed["gb_per_s"] / streamed["memory_read_gb_per_s"])
    assert "memory reads" in r.stdout


@pytest.mark.slow
def test_a_sampled_bench_times_every_method_and_does_not_claim_their_tokens_equal(tmp_path):
    """`bench --temperature`: speed under sampling, as chats at a temperature run. Each method draws its own
    tokens (a speculative round consumes the generator otherwise than a step), so the report leaves the
    token comparison out instead of calling them different or equal; the same seed per prompt and pass
    gives plain decoding the same reply every time it is asked."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "dynchat", "bench", "--preset", "demo", "--limit", "3", "--repeats", "1",
                        "--max-new-tokens", "24", "--min-seconds", "0", "--temperature", "0.8", "--peer", "off",
                        "--methods", "baseline,eagle3-chain-constant-3,hf-generate", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert out["meta"]["temperature"] == 0.8 and out["meta"]["top_p"] == 1.0
    for name in ("baseline", "eagle3-chain-constant-3", "hf-generate"):
        assert out["methods"][name]["same_tokens_as_baseline"] is None and out["methods"][name]["tokens_per_s"] > 0
    assert out["methods"]["eagle3-chain-constant-3"]["acceptance_rate"] > 0
    assert "sampled at temperature 0.8" in r.stdout
    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    assert runs.same_as_baseline.isna().all()

    from dynchat.bench.engine import Method, Runner
    from dynchat.engine.sampling import SamplingParams
    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    engine = load_engine(get_preset("demo"))
    runner, plain = Runner(engine, 24, SamplingParams(temperature=0.8)), Method("baseline", "ours", "baseline")
    ids = engine.encode("def fibonacci(n):")
    draws = [runner(plain, ids, seed=s)[0] for s in (7, 8, 9, 7)]
    assert draws[0] == draws[3] and len({tuple(d) for d in draws[:3]}) > 1


@pytest.mark.slow
def test_asking_for_llama_cpp_before_it_is_built_says_how_to_build_it(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "DYNCHAT_PEERS": str(tmp_path / "nothing-built")}
    r = subprocess.run([sys.executable, "-m", "dynchat", "bench", "--preset", "demo", "--peer", "on"],
                       capture_output=True, text=True, cwd=root, timeout=120, env=env)
    assert r.returncode != 0 and "llama.cpp is not built" in r.stderr and "Traceback" not in r.stderr


def test_a_peer_that_stops_early_keeps_its_figures_and_is_compared_on_the_weights_we_ran(tmp_path, monkeypatch):
    """llama.cpp's bench may die in its verify curve after its tg runs (an illegal instruction on one
    CPU): the figures it printed are kept. Plain decoding on Q4_1 blocks is compared with llama.cpp's
    Q4_1 file, whatever the preset's dtype says; int8 weights (activations int8 or not) with Q8_0."""
    from dynchat.bench import peer

    fake = tmp_path / "llamacpp-peer"
    fake.write_text("#!/bin/sh\necho 'llama.cpp f32 tg128: 40.0 tokens/s'\necho 'llama.cpp q4_1 tg128: 110.0 tokens/s'\n"
                    "echo 'Illegal instruction' >&2\nexit 132\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DYNCHAT_PEER", str(fake))
    figures = peer.run_peer()
    assert figures == {"tg128": {"f32": 40.0, "q4_1": 110.0}, "q8_0_forward_ms": {}}
    stored = {"q4_1 x int8 activations": 120, "output head q8_0 x int8 activations": 1}
    assert peer.compare("float32", 220.0, figures, stored)["llama_cpp_file"] == "q4_1"
    assert peer.compare("float32", 220.0, figures, stored)["ratio"] == 2.0
    assert peer.compare("float32", 80.0, figures, {"float": 120})["llama_cpp_file"] == "f32"
    # the int8 preset's weights (its activations rounded to int8 too) are compared with llama.cpp's Q8_0 file
    figures["tg128"]["q8_0"] = 100.0
    int8 = peer.compare("int8 x int8 activations", 112.0, figures, {"int8 x int8 activations": 120})
    assert int8["llama_cpp_file"] == "q8_0" and int8["ratio"] == pytest.approx(1.12)
    fake.write_text("#!/bin/sh\necho 'not built' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="no figures .exit 1.: not built"):
        peer.run_peer()


def test_the_comparison_with_llama_cpp_says_how_close_each_runs_to_the_memory_s_pace(tmp_path, monkeypatch):
    """With the memory's read rate measured in the run, llama.cpp's file streamed per token is given as a
    share of it, and so is the most plain decoding of our weights could reach over llama.cpp's there:
    a ratio target above that cannot be met on this machine by any kernel."""
    from dynchat.bench import peer

    monkeypatch.setenv("DYNCHAT_PEERS", str(tmp_path))
    with open(tmp_path / "smol-f32.gguf", "wb") as f:          # sparse: its size is what counts
        f.truncate(540_000_000)
    figures = {"tg128": {"f32": 40.0, "q4_1": 110.0}, "q8_0_forward_ms": {}}
    memory = {"weight_mb": 538.0, "memory_read_gb_per_s": 30.0}
    versus = peer.compare("float32", 52.0, figures, {"float": 120}, memory)
    assert versus["ratio"] == pytest.approx(1.3)
    assert versus["llama_cpp_share_of_memory_read"] == pytest.approx(40.0 * 540 / 1000 / 30.0)     # 0.72
    assert versus["most_over_llama_cpp_at_this_memory"] == pytest.approx(30_000 / 538 / 40.0)      # 1.39
    # the file llama.cpp ran is not there (another peers folder): its share is not guessed
    q41 = peer.compare("float32", 220.0, figures, {"q4_1 x int8 activations": 120}, memory)
    assert "llama_cpp_share_of_memory_read" not in q41 and q41["most_over_llama_cpp_at_this_memory"] > 0
    assert "llama_cpp_share_of_memory_read" not in peer.compare("float32", 52.0, figures, {"float": 120})


def test_a_follow_up_is_timed_with_the_earlier_turns_already_cached():
    """`bench --follow-ups` times a conversation's last message as the app times a follow-up: the caches
    hold the earlier turns (left by an untimed reply of the same method), so the timed run prefills only
    the new message; every method still gives the baseline's tokens. Without a history a run prefills
    as a new chat does (all but the start every chat shares, where the forward keeps caches)."""
    from dynchat.bench.engine import Runner, methods_for
    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    engine = load_engine(get_preset("demo"))
    messages = [{"role": "user", "content": "What does json.dumps do?"},
                {"role": "assistant", "content": "It turns a Python object into a JSON string."},
                {"role": "user", "content": "And json.loads?"}]
    ids, history = engine.encode(messages), engine.encode(messages[:-1])
    shared = next(i for i, (a, b) in enumerate(zip(ids, history)) if a != b)
    runner = Runner(engine, 16)
    methods = {m.name: m for m in methods_for(engine)}
    reference, _ = runner(methods["baseline"], ids)
    for name in ("baseline", "lookup-throughput", "assistant-constant-3", "eagle3-chain-constant-3"):
        runner(methods[name], ids)               # the bench's warm-up run (an EAGLE-3 decoder starts its cache anew)
        fresh, fresh_stats = runner(methods[name], ids)
        followed, stats = runner(methods[name], ids, history)
        assert fresh_stats["reused_tokens"] == engine.decoder("baseline").target.shared_rows(ids)
        assert stats["reused_tokens"] == shared > len(ids) // 2, name
        assert followed == fresh == reference, name


def test_short_replies_get_more_passes_until_their_samples_add_up():
    """A 12-token reply (~35 ms) is timed until each method's samples of it add up to --min-seconds; a long
    reply keeps --repeats; no prompt passes MAX_REPEATS; --min-seconds 0 keeps exactly --repeats."""
    from dynchat.bench.engine import MAX_REPEATS, extra_passes

    walls = {0: [0.25, 0.26], 1: [0.035, 0.034], 2: [0.07, 0.068], 3: [0.001, 0.001]}
    extra = extra_passes(walls, repeats=2, min_seconds=0.3)
    assert extra[0] == 0                                 # 2 x 0.25 s already
    assert 2 + extra[1] == 9 and (2 + extra[1]) * 0.0345 >= 0.3
    assert 2 + extra[2] == 5
    assert 2 + extra[3] == MAX_REPEATS
    assert extra_passes(walls, repeats=2, min_seconds=0.0) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert extra_passes(walls, repeats=20, min_seconds=0.3)[3] == 0
