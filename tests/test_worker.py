"""The engine in its own process (the app's default): same tokens, same errors, stop, crashes, policy state."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from dynchat.app.chat import ChatService
from dynchat.app.store import Store
from dynchat.app.turns import Settings
from dynchat.app.worker import RemoteEngine, WorkerCrashed
from dynchat.engine.decoder import PromptTooLong, run
from dynchat.engine.events import RoundEvent, Summary
from dynchat.engine.policies import make_policy
from dynchat.engine.sampling import SamplingParams
from dynchat.presets.config import get_preset
from dynchat.presets.loading import ModelLoadError, load_engine

PROMPT = "What does the function json.dumps do?"


@pytest.fixture(scope="module")
def engines(tiny_preset):
    """The worker and an in-process engine with one thread each: sampled tokens can differ with the
    thread count (float sums in another order), and the worker of a serving app uses fewer threads."""
    preset = get_preset("tiny", tiny_preset)
    threads = torch.get_num_threads()
    # and the same matmul routes: auto picks them by timing, and float sums in another order can
    # tip a sampled token (or which draft is proposed, and so how the random numbers are used)
    # and the same verify-cost curve: lookup cuts its drafts by it (a timed curve differs run to run)
    pinned = {"DYNCHAT_THREADS": "1", "DYNCHAT_LINEAR": "plain", "DYNCHAT_DRAFT_LINEAR": "plain",
              "DYNCHAT_VERIFY_MS": "1:10,2:10.5,3:11,5:12,9:14"}       # a tiny model: flat
    saved = {k: os.environ.get(k) for k in pinned}
    os.environ.update(pinned)
    torch.set_num_threads(1)
    remote = RemoteEngine(preset)
    local = load_engine(preset)
    local.warm_up()                      # as the worker does
    yield remote, local
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.set_num_threads(threads)
    remote.close()


@pytest.mark.parametrize("mode", ["baseline", "lookup", "assistant", "eagle3"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.9, 0.95, 0, 7)], ids=["greedy", "sampled"])
def test_remote_tokens_equal_in_process_tokens(engines, mode, sampling):
    remote, local = engines
    ids = local.encode(PROMPT)
    assert remote.encode(PROMPT) == ids
    policy = None if mode == "baseline" else make_policy("dynamic", 4)
    local_policy = None if mode == "baseline" else make_policy("dynamic", 4)
    got, summary = run(remote.decoder(mode), ids, 40, sampling, policy, threading.Event())
    want, _ = run(local.decoder(mode), ids, 40, sampling, local_policy, threading.Event())
    assert got == want and len(got) > 0
    assert isinstance(summary, Summary) and summary.new_tokens == len(got)


def test_replies_remembered_through_the_worker_feed_its_lookup(engines):
    remote, local = engines
    ids = local.encode("What does the class threading.Lock do?")
    reply, _ = run(remote.decoder("baseline"), ids, 40)
    remote.remember([reply])
    again, summary = run(remote.decoder("lookup"), ids, 40, policy=make_policy("constant", 8))
    assert again == reply and summary.target_forwards <= len(reply) / 4


def test_a_turn_s_start_prepared_in_the_worker_is_reused_by_the_next_prompt(tiny_preset, monkeypatch):
    """prepare_turn reaches the worker as a message: the conversation's cache there computes the rows of
    what the next prompt begins with, which the next generation reuses; the reply is as from nothing.
    (On the routes that keep a conversation's cache: the native ones, which this CPU builds.)"""
    from dynchat.engine import native

    if native.library() is None:
        pytest.skip("no native kernels here: no route keeps a conversation's cache")
    monkeypatch.delenv("DYNCHAT_LINEAR", raising=False)      # the module's other worker pins a plain route
    remote = RemoteEngine(get_preset("tiny", tiny_preset))
    try:
        ids = remote.encode(PROMPT)
        reply, _ = run(remote.decoder("baseline"), ids, 16, session="prepared")
        start = ids + reply + remote.encode("And one more thing")[:3]     # what the next prompt begins with
        remote.prepare_turn("prepared", start)
        follow_up = start + remote.encode("Why?")
        again, summary = run(remote.decoder("baseline"), follow_up, 16, session="prepared")
        fresh, _ = run(remote.decoder("baseline"), follow_up, 16, max_reuse=0, session="fresh")
        assert summary.reused_tokens == len(start) and again == fresh
    finally:
        remote.close()


def test_policy_state_comes_back_from_the_worker(engines):
    remote, local = engines
    ids = local.encode(PROMPT)
    remote_policy, local_policy = make_policy("heuristic", 3), make_policy("heuristic", 3)
    for _ in range(2):                   # the heuristic's k moves with acceptance, turn after turn
        run(remote.decoder("assistant"), ids, 32, SamplingParams(), remote_policy, threading.Event())
        run(local.decoder("assistant"), ids, 32, SamplingParams(), local_policy, threading.Event())
    assert vars(remote_policy) == vars(local_policy)


def test_errors_come_back_as_themselves(engines):
    remote, _ = engines
    with pytest.raises(PromptTooLong, match="context length"):
        run(remote.decoder("baseline"), [5] * 300, 8)
    with pytest.raises(ValueError, match="max new tokens"):
        run(remote.decoder("baseline"), [5, 6], 0)
    ids, _ = run(remote.decoder("baseline"), [5, 6], 4)          # and it still serves
    assert len(ids) == 4


def test_stop_and_early_exit_keep_the_stream_in_step(engines):
    remote, local = engines
    ids = local.encode(PROMPT)
    stop = threading.Event()
    events = []
    for ev in remote.decoder("assistant").generate(ids, 200, SamplingParams(0.8, 1.0, 0, 1), make_policy("constant", 2),
                                                   stop):
        events.append(ev)
        stop.set()
    assert isinstance(events[-1], Summary) and events[-1].finish_reason == "stopped"
    assert sum(isinstance(e, RoundEvent) for e in events) < 20
    gen = remote.decoder("baseline").generate(ids, 200, SamplingParams(), None, threading.Event())
    next(gen)
    gen.close()                                                     # a consumer that walks away
    got, _ = run(remote.decoder("baseline"), ids, 12, SamplingParams(), None, threading.Event())
    want, _ = run(local.decoder("baseline"), ids, 12, SamplingParams(), None, threading.Event())
    assert got == want


def test_a_preset_that_cannot_load_is_one_clear_line(tiny_preset, tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load the target .*'nobody/no-such-model'"):
        RemoteEngine(get_preset("unreachable", tiny_preset))
    broken = tmp_path / "models.yaml"             # the tokenizer loads here, the assistant fails in the worker
    broken.write_text(f"default: b\npresets:\n  b:\n    target: {tiny_preset.parent / 'target'}\n"
                      "    assistant: nobody/no-such-draft\n    device: cpu\n")
    with pytest.raises(ModelLoadError, match="cannot load the assistant 'nobody/no-such-draft'"):
        RemoteEngine(get_preset("b", broken))


def test_a_crashed_worker_is_a_clear_message_and_starts_again(tiny_preset, tmp_path):
    svc = ChatService(Store(tmp_path / "log.db"), tiny_preset, engine_process=True)
    svc.stream_interval = 0.0
    first = list(svc.turn("s", [], PROMPT, Settings("tiny", max_new_tokens=8)))[-1]
    assert first.status == "ok"
    engine = svc.engine("tiny")
    os.kill(engine._proc.pid, signal.SIGKILL)
    engine._proc.wait(10)
    with pytest.raises(WorkerCrashed, match="engine process for preset 'tiny'"):
        run(engine.decoder("baseline"), [5, 6], 4)
    crashed = list(svc.turn("s", [], PROMPT, Settings("tiny", max_new_tokens=8)))[-1]
    assert crashed.status == "error" and "engine process" in crashed.notice and "starts again" in crashed.notice
    again = list(svc.turn("s", [], PROMPT, Settings("tiny", max_new_tokens=8)))[-1]
    assert again.status == "ok" and again.reply == first.reply
    assert list(svc.store.session_turns("s")["status"]) == ["ok", "error", "ok"]
    svc.engine("tiny").close()


@pytest.mark.parametrize("env, expected", [({}, True), ({"SPACES_ZERO_GPU": "true"}, False),
                                           ({"DYNCHAT_ENGINE_PROCESS": "0"}, False),
                                           ({"DYNCHAT_ENGINE_PROCESS": "1", "SPACES_ZERO_GPU": "true"}, True)])
def test_the_app_uses_a_worker_except_on_zerogpu(monkeypatch, env, expected):
    from dynchat.app.engines import engine_process_default

    monkeypatch.delenv("DYNCHAT_ENGINE_PROCESS", raising=False)
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert engine_process_default() is expected


def test_a_pinned_verify_cost_curve_replaces_the_timed_one(monkeypatch):
    from dynchat.presets.runtime import pinned_verify_ms
    monkeypatch.setenv("DYNCHAT_VERIFY_MS", "1:40, 2:41.5,9:70")
    assert pinned_verify_ms() == {1: 40.0, 2: 41.5, 9: 70.0}
    monkeypatch.setenv("DYNCHAT_VERIFY_MS", "1=40")
    with pytest.raises(ValueError, match="tokens:ms pairs"):
        pinned_verify_ms()
    monkeypatch.delenv("DYNCHAT_VERIFY_MS")
    assert pinned_verify_ms() is None
