"""engine: vllm - the demo preset served by vLLM behind the same chat, metrics, log and CSV.

The first tests need no vLLM. The rest start real vLLM servers (the CPU build, from the venv that
scripts/install-vllm.sh makes; tests/run.sh installs it and sets DYNCHAT_REQUIRE_VLLM=1, so there a
missing vLLM fails instead of skipping).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import reply_text

from dynchat.app.chat import ChatService
from dynchat.app.store import Store
from dynchat.app.turns import Settings, TurnError
from dynchat.presets.config import ConfigError, parse
from dynchat.vllm.engine import parse_counters, trim_to_reply
from dynchat.vllm.server import ServerSpec, free_port, vllm_python

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [json.loads(line) for line in (ROOT / "data" / "bench_prompts.jsonl").read_text().splitlines()]


# -- no vLLM needed -----------------------------------------------------------------------------
def test_acceptance_counts_only_what_the_reply_kept():
    # 11 tokens = prefill token + 4 steps + 6 accepted drafts; vLLM's last step accepted 3 past EOS
    assert trim_to_reply([0, 2, 3, 3], 11) == [0, 2, 3, 1]
    assert trim_to_reply([4, 4, 4], 16) == [4, 4, 4]          # nothing past the end
    assert trim_to_reply([2, 4], 4) == [1, 0]                 # the reply ended early in step 1


def test_counters_from_prometheus_text():
    text = ('# HELP x\nvllm:spec_decode_num_drafts_total{engine="0",model_name="demo"} 12.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="demo"} 30.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="demo"} 2.0\n'
            'vllm:num_requests_running{engine="0"} 1.0\n')
    c = parse_counters(text)
    assert c["vllm:spec_decode_num_drafts_total"] == 12 and c["vllm:spec_decode_num_accepted_tokens_total"] == 32
    assert c["vllm:num_requests_running"] == 1 and c["vllm:spec_decode_num_draft_tokens_total"] == 0


def test_without_per_request_metrics_counter_deltas_stand_in():
    from dynchat.engine.events import Summary
    from dynchat.vllm.engine import COUNTERS, VllmDecoder

    decoder = VllmDecoder.__new__(VllmDecoder)          # no server: only the arithmetic
    decoder._counters = lambda: dict(zip(COUNTERS, (14, 56, 30, 0)))
    alone = Summary(new_tokens=40)
    decoder._acceptance(alone, None, dict(zip(COUNTERS, (4, 16, 10, 0))), 4)
    assert (alone.draft_rounds, alone.draft_tokens, alone.accepted_tokens, alone.shared) == (10, 40, 20, False)
    assert alone.mean_accepted_length == 3.0
    crowded = Summary(new_tokens=40)                     # another request was running when this one started
    decoder._acceptance(crowded, None, dict(zip(COUNTERS, (4, 16, 10, 1))), 4)
    assert crowded.shared


def test_server_command_passes_speculation_and_parallelism_through():
    spec = ServerSpec("eagle3", "/m/target", "p", "bfloat16", "cuda", {"method": "eagle3", "model": "/m/head",
                      "num_speculative_tokens": 5},
                      {"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray",
                       "extra_args": ["--gpu-memory-utilization", 0.8]})
    args = spec.args(8000)
    i = args.index("--speculative-config")
    assert json.loads(args[i + 1]) == {"method": "eagle3", "model": "/m/head", "num_speculative_tokens": 5}
    assert args[args.index("--tensor-parallel-size") + 1] == "4" and args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert args[args.index("--distributed-executor-backend") + 1] == "ray"
    assert "--per-request-spec-decode-metrics" in args and args[-2:] == ["--gpu-memory-utilization", "0.8"]
    assert "--enforce-eager" not in args                        # CUDA graphs stay on on a GPU
    plain = ServerSpec("baseline", "/m/target", "p", "float32", "cpu").args(8001)
    assert "--speculative-config" not in plain and "--per-request-spec-decode-metrics" not in plain
    assert "--enforce-eager" in plain


@pytest.mark.parametrize("yaml_text, message", [
    ("presets: {a: {target: org/m, engine: vllm, vllm: {tensor_parallel: 2}}}", "unknown vllm setting(s) ['tensor_parallel']"),
    ("presets: {a: {target: org/m, vllm: {max_model_len: 512}}}", "needs `engine: vllm`"),
    ("presets: {a: {target: org/m, engine: tgi}}", "engine 'tgi' is not one of"),
    ("presets: {a: {target: org/m, engine: vllm, quantization: int8}}", "quantization is for the in-process engine"),
    ("presets: {a: {target: org/m, engine: vllm, vllm: {urls: {fast: 'http://x'}}}}", "vllm.urls maps modes"),
])
def test_bad_vllm_settings_are_named(yaml_text, message, tmp_path):
    import yaml

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse(yaml.safe_load(yaml_text), tmp_path)


def test_padded_draft_computes_the_same(tmp_path, monkeypatch):
    """The demo draft's head size 44 (not in vLLM's CPU attention) padded to 64 gives the same logits."""
    from transformers import AutoModelForCausalLM

    from dynchat.vllm.models import vllm_ready_draft

    monkeypatch.setenv("DYNCHAT_CACHE", str(tmp_path))
    src = ROOT / "data" / "models" / "demo-draft"
    out = vllm_ready_draft(str(src), str(ROOT / "data" / "models" / "demo-target"))
    cfg = json.loads((Path(out) / "config.json").read_text())
    assert cfg["head_dim"] == 64 and Path(out).parent == tmp_path / "vllm"
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, cfg["vocab_size"], (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a(x).logits, b(x).logits
    assert (la - lb).abs().max() < 1e-4 and torch.equal(la.argmax(-1), lb.argmax(-1))
    assert vllm_ready_draft(str(src), str(ROOT / "data" / "models" / "demo-target")) == out     # made once
    assert vllm_ready_draft("meta-llama/Llama-3.2-1B-Instruct", "x") == "meta-llama/Llama-3.2-1B-Instruct"  # vLLM fetches it


@pytest.fixture
def service(tmp_path):
    return ChatService(Store(tmp_path / "log.db"), engine_process=False)


def test_vllm_missing_is_one_line_and_other_presets_keep_serving(service, monkeypatch):
    monkeypatch.setenv("DYNCHAT_VLLM_PYTHON", "/nonexistent/python")
    with pytest.raises(TurnError, match=r"vLLM is not installed .*bash scripts/install-vllm.sh"):
        list(service.turn("s", [], "Hello", Settings(preset="demo-vllm", mode="eagle3", max_new_tokens=8)))
    final = list(service.turn("s", [], "What does the function json.dumps do?",
                              Settings(preset="demo", mode="eagle3", max_new_tokens=8)))[-1]
    assert final.status == "ok" and final.reply


def test_vllm_that_cannot_start_is_one_line(service, monkeypatch):
    monkeypatch.setenv("DYNCHAT_VLLM_PYTHON", sys.executable)     # a Python without vLLM: the server exits at once
    with pytest.raises(TurnError, match=r"vLLM server for \w+ exited with code 1 while starting: .*vllm"):
        list(service.turn("s", [], "Hello", Settings(preset="demo-vllm", mode="eagle3", max_new_tokens=8)))


# -- real vLLM servers ---------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(not vllm_python().exists() and not os.environ.get("DYNCHAT_REQUIRE_VLLM"),
                                reason="vLLM is not installed (bash scripts/install-vllm.sh)")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The app on the repo's models.yaml with demo-vllm loaded (three vLLM servers), and a gradio client."""
    from gradio_client import Client

    from dynchat.app.ui import create_app, launch

    demo = create_app(Store(tmp_path_factory.mktemp("db") / "app.db"), preload=False, engine_process=False)
    demo.service.stream_interval = 0.0
    demo.service.engine("demo-vllm")
    port = free_port()
    launch(demo, server_port=port, prevent_thread_lock=True, quiet=True)
    yield demo, Client(f"http://127.0.0.1:{port}/", verbose=False)
    demo.close()
    demo.service.engines["demo-vllm"].close()


def chat_args(message, client_id, mode="eagle3", max_new=96, compare=True):
    return dict(message=message, history=[], client_id=client_id, preset="demo-vllm", mode=mode, policy="dynamic",
                max_new=max_new, temperature=0.0, top_p=1.0, compare=compare)


@needs_vllm
def test_vllm_reply_streams_with_its_acceptance(served):
    demo, client = served
    question = "What does the function json.dumps do?"
    # vLLM streams one chunk per engine step, and the decoder one RoundEvent per chunk
    served_engine = demo.service.engine("demo-vllm")
    events = list(served_engine.decoder("eagle3").generate(served_engine.encode(question), 96))
    assert len(events) >= 4 and sum(len(e.token_ids) for e in events[:-1]) == events[-1].new_tokens
    job = client.submit(**chat_args(question, "v-stream"), api_name="/chat")
    job.result(timeout=300)
    outputs = job.outputs()            # the demo's reply is short: its steps may reach the page in one update
    lengths = [len(reply_text(o[0])) for o in outputs]
    assert len(outputs) >= 2 and lengths == sorted(lengths) and lengths[-1] > 0
    metrics = outputs[-1][2]
    assert "float32 (vLLM)" in metrics and "speedup" in metrics
    turn = demo.service.store.session_turns("v-stream").iloc[0]
    assert turn["status"] == "ok" and turn["weights"] == "float32 (vLLM)"
    assert turn["mean_accepted_length"] > 1 and 0 < turn["acceptance_rate"] <= 1
    assert f"**mean accepted length** {turn['mean_accepted_length']:.2f}" in metrics
    assert turn["baseline_tokens_per_s"] > 0


@needs_vllm
def test_choosing_a_vllm_preset_hides_the_lookahead_policy(served):
    from dynchat.app.ui import App

    app = App(served[0].service)
    to_vllm, back = app.on_preset("demo-vllm", "demo"), app.on_preset("demo", "demo-vllm")
    assert to_vllm[0] == "demo-vllm" and to_vllm[-1]["visible"] is False
    assert back[0] == "demo" and back[-1]["visible"] is True


@torch.inference_mode()
def same_up_to_a_near_tie(model, prompt: list[int], expected: list[int], got: list[int], tol: float = 2e-3) -> bool:
    """Two float32 implementations' greedy tokens agree, or first differ where the two tokens' logits
    are within `tol` of each other: vLLM's CPU kernels sum in another order than ours, and on some CPUs
    that flips a near-tie (then everything after it differs legitimately)."""
    if got == expected:
        return True
    i = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    if i == min(len(expected), len(got)):
        return False                    # one stopped early: not a tie
    logits = model(torch.tensor([prompt + expected[:i]])).logits[0, -1].float()
    return float(logits[expected[i]] - logits[got[i]]) < tol


@needs_vllm
@pytest.mark.parametrize("mode", ["baseline", "eagle3", "assistant"])
def test_vllm_greedy_tokens_equal_dynchat_baseline(served, mode):
    from dynchat.engine.decoder import run

    demo, _ = served
    ours = demo.service.engine("demo")
    served_engine = demo.service.engine("demo-vllm")
    for row in PROMPTS[::2]:
        ids = ours.encode(row["prompt"], raw=row.get("raw", False))
        expected, _ = run(ours.decoder("baseline"), ids, 64)
        events = list(served_engine.decoder(mode).generate(ids, 64))
        got = [t for ev in events[:-1] for t in ev.token_ids]
        assert same_up_to_a_near_tie(ours.target, ids, expected, got), row["prompt"][:40]
        assert events[-1].new_tokens == len(got)
        if mode != "baseline":
            assert 0 < events[-1].accepted_tokens <= len(got) - 1 - events[-1].draft_rounds


@needs_vllm
def test_four_concurrent_chats_complete_together_and_are_logged(served):
    demo, client = served
    results, errors = {}, []

    def one(i):
        try:
            results[i] = client.predict(**chat_args(PROMPTS[4 + i]["prompt"], f"v-conc-{i}", compare=False), api_name="/chat")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    demo.service.load.peak = 0
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(results) == 4
    assert demo.service.load.peak >= 2           # generated at the same time, not one after another
    for i in range(4):
        turns = demo.service.store.session_turns(f"v-conc-{i}")
        assert list(turns["status"]) == ["ok"] and turns.iloc[0]["new_tokens"] > 0
        assert reply_text(results[i][0])


@needs_vllm
def test_concurrency_bench_serves_the_same_replies_on_both_engines(served):
    from dynchat.bench.concurrency import clients_round

    demo, _ = served
    ours, theirs = demo.service.engine("demo"), demo.service.engine("demo-vllm")
    encoded = [ours.encode(p["prompt"], raw=p.get("raw", False)) for p in PROMPTS[:4]]
    a = clients_round(ours, "baseline", encoded, 2, 24)
    b = clients_round(theirs, "eagle3", encoded, 4, 24)
    assert a["replies"] == b["replies"] == 4 and a["tokens"] == b["tokens"]      # greedy: the same replies
    assert b["aggregate_tokens_per_s"] > 0 and b["mean_accepted_length"] > 1
    assert a["max_latency_s"] >= a["mean_latency_s"] > 0


def test_concurrency_needs_chat_counts_and_a_preset():
    import subprocess

    for args, message in ((["--preset", "demo-vllm", "--concurrency", "0,4"], "expected chat counts like 1,4,8"),
                          (["--concurrency", "1,4"], "--concurrency needs --preset")):
        r = subprocess.run([sys.executable, "-m", "dynchat", "bench", *args], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@needs_vllm
def test_servers_started_elsewhere_are_reached_by_url(served, tmp_path):
    """A preset with vllm.urls starts nothing: it reads the served model's name and leaves the servers running."""
    demo, _ = served
    running = demo.service.engines["demo-vllm"].servers
    models = ROOT / "data" / "models"
    (tmp_path / "models.yaml").write_text(
        "presets:\n  remote:\n    engine: vllm\n"
        f"    target: {models / 'demo-target'}\n    eagle3: {models / 'demo-eagle3'}\n"
        f"    vllm: {{baseline: false, urls: {{eagle3: '{running['eagle3'].url}'}}}}\n")
    service = ChatService(Store(tmp_path / "log.db"), tmp_path / "models.yaml", engine_process=False)
    engine = service.engine("remote")
    assert engine.modes == ["eagle3"] and not engine.servers["eagle3"].started_here
    assert engine.servers["eagle3"].model_name == "demo-vllm"
    final = list(service.turn("r", [], "What does the function json.dumps do?",
                              Settings(preset="remote", mode="eagle3", max_new_tokens=16)))[-1]
    assert final.status == "ok" and final.reply and "no plain baseline" in final.notice
    assert final.metrics["mean_accepted_length"] >= 1
    engine.close()
    assert running["eagle3"].alive()


@needs_vllm
def test_crashed_vllm_is_one_line_and_starts_again(served):
    demo, client = served
    server = demo.service.engines["demo-vllm"].servers["eagle3"]
    server.stop()                                   # as if it crashed
    out = client.predict(**chat_args("What does the function json.dumps do?", "v-crash", max_new=16), api_name="/chat")
    assert "**error**" in out[2] and "went away" in out[2] and "starts again with the next message" in out[2]
    assert "Traceback" not in out[2]
    ok = client.predict(**{**chat_args("What does the function json.dumps do?", "v-crash", max_new=16), "preset": "demo"},
                        api_name="/chat")
    assert "**error**" not in ok[2] and reply_text(ok[0])
    again = client.predict(**chat_args("What does the function json.dumps do?", "v-crash", max_new=16), api_name="/chat")
    assert "**error**" not in again[2] and reply_text(again[0])
    statuses = list(demo.service.store.session_turns("v-crash")["status"])
    assert statuses == ["error", "ok", "ok"]
