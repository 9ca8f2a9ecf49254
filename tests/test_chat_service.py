"""The chat turn as the UI drives it, without Gradio: inputs, history, logging, cancellation."""
from __future__ import annotations

import sqlite3

import pytest

from dynchat.app.chat import ChatService
from dynchat.app.metrics import TURN_METRICS
from dynchat.app.store import Store
from dynchat.app.turns import Settings, TurnError, clean_text, history_messages


@pytest.fixture()
def service(tiny_preset, tmp_path):
    svc = ChatService(Store(tmp_path / "log.db"), tiny_preset, engine_process=False)   # the worker: test_worker.py
    svc.stream_interval = 0.0        # the tiny models are so fast that 100 ms batches would hold a whole reply
    return svc


def finish(gen):
    last = None
    for last in gen:  # noqa: B007 - the last update is the result
        pass
    return last


def test_turn_streams_and_is_logged(service):
    updates = list(service.turn("s1", [], "What does json.dumps do?", Settings("tiny", max_new_tokens=24)))
    streaming = [u for u in updates if u.status == "streaming"]
    assert len(streaming) >= 2 and updates[-1].status == "ok"
    last = updates[-1]
    assert last.reply and last.metrics["new_tokens"] == 24
    assert last.metrics["baseline_tokens_per_s"] > 0 and last.metrics["speedup"] > 0
    assert "".join(t for t, _ in last.segments) == last.reply
    turns = service.store.session_turns("s1", with_text=True)
    assert len(turns) == 1 and turns.loc[0, "status"] == "ok" and turns.loc[0, "prompt_text"] == "What does json.dumps do?"
    assert turns.loc[0, "new_tokens"] == 24
    rounds = service.store.turn_rounds(int(turns.loc[0, "id"]))
    assert rounds["new_tokens"].sum() == 24 and len(rounds) == len(last.rounds)
    for metric in TURN_METRICS:       # every metric the page showed is logged as shown, and in the CSV
        assert turns.loc[0, metric.name] == pytest.approx(last.metrics[metric.name]), metric.name


def test_the_baseline_streams_its_reply_and_greedy_matches(service):
    updates = list(service.turn("s-base", [], "What does json.dumps do?", Settings("tiny-long", max_new_tokens=64)))
    during = [u for u in updates if u.status == "baseline"]
    # streamed as the reply was (the page renders both under the same load), growing to the whole reply
    assert len(during) >= 2 and during[0].baseline_reply == "" and any(u.baseline_reply for u in during)
    last = updates[-1]
    assert last.baseline_reply == last.reply and last.metrics["same_tokens_as_baseline"] is True
    sampled = finish(service.turn("s-base2", [], "What does json.dumps do?",
                                  Settings("tiny-long", max_new_tokens=24, temperature=0.8, seed=3)))
    assert sampled.baseline_reply and "same_tokens_as_baseline" not in sampled.metrics   # not a check when sampling
    # the page shows it as a thought under the reply: not conversation, the next prompt leaves it out
    history = [{"role": "user", "content": "What does json.dumps do?"}, {"role": "assistant", "content": last.reply},
               {"role": "assistant", "content": last.baseline_reply, "metadata": {"title": "plain decoding"}}]
    assert history_messages(history) == history[:2]
    # a message that got no reply (its turn failed before the first token) is not conversation either
    unanswered = [{"role": "user", "content": "x " * 5000}, {"role": "assistant", "content": ""}]
    assert history_messages(history + unanswered + history[:2]) == history[:2] * 2


def test_baseline_mode_and_settings(service):
    last = finish(service.turn("s2", [], "hi", Settings("tiny", mode="baseline", max_new_tokens=8, compare=False)))
    assert last.status == "ok" and last.metrics["speedup"] == 1.0
    assert last.metrics["acceptance_rate"] is None


@pytest.mark.parametrize("message, settings, error", [
    ("", {}, "the message is empty"),
    ("   \n\t ", {}, "the message is empty"),
    ("x" * 100_000, {}, "limit is 32000"),
    ("hi", {"mode": "telepathy"}, "unknown mode"),
    ("hi", {"policy": "psychic"}, "unknown lookahead policy"),
    ("hi", {"max_new_tokens": 0}, "max new tokens must be between"),
    ("hi", {"max_new_tokens": 10**6}, "max new tokens must be between"),
    ("hi", {"temperature": -1}, "temperature"),
    ("hi", {"temperature": 99}, "temperature"),
    ("hi", {"top_p": 0}, "top-p"),
    ("hi", {"top_p": 1.5}, "top-p"),
    ("hi", {"preset": "nope"}, "no such preset"),
    ("hi", {"preset": "unreachable"}, "cannot load the target"),
    ("hi", {"preset": "target-only", "mode": "assistant"}, "not available for preset"),
])
def test_bad_input_is_refused_and_nothing_logged(service, message, settings, error):
    with pytest.raises(TurnError, match=error):
        finish(service.turn("s3", [], message, Settings(**{"preset": "tiny", **settings})))
    assert service.store.session_turns("s3").empty
    assert finish(service.turn("s3", [], "still there?", Settings("tiny", max_new_tokens=4))).status == "ok"


def test_control_characters_and_surrogates_are_cleaned():
    assert clean_text("a\x00b\x1b[31mc\ud800d\n") == "ab[31mc?d\n"


def test_history_that_no_longer_fits_drops_oldest_exchanges(service):
    long = "word " * 60
    history = []
    for i in range(8):
        history += [{"role": "user", "content": f"{i} {long}"},
                    {"role": "assistant", "content": [{"type": "text", "text": long}]}]
    assert len(history_messages(history)) == 16
    last = finish(service.turn("s4", history, "and now?", Settings("tiny", max_new_tokens=8)))
    assert last.status == "ok" and "dropped" in last.notice


def test_stop_flag_cancels_and_logs_cancelled(service):
    gen = service.turn("s5", [], "tell me everything", Settings("tiny", max_new_tokens=200, compare=True))
    first = next(gen)
    assert first.status == "streaming"
    service.stop("s5")
    last = finish(gen)
    assert last.status == "cancelled" and "baseline_tokens_per_s" not in last.metrics
    turns = service.store.session_turns("s5")
    assert turns.loc[0, "status"] == "cancelled" and turns.loc[0, "new_tokens"] < 200


def test_generator_closed_mid_turn_is_logged_cancelled(service):
    gen = service.turn("s6", [], "hello", Settings("tiny", max_new_tokens=200))
    next(gen)
    gen.close()          # what Gradio does on cancel
    assert service.store.session_turns("s6").loc[0, "status"] == "cancelled"


def test_a_stop_during_the_baseline_keeps_the_whole_reply(service):
    # the reply has ended when the baseline runs: a Stop there (or the page closing the turn) costs only the figure
    gen = service.turn("s-stop-base", [], "What does json.dumps do?", Settings("tiny-long", max_new_tokens=64))
    update = next(gen)
    while update.status != "baseline" or not update.baseline_reply:
        update = next(gen)
    service.stop("s-stop-base")
    last = finish(gen)
    assert last.status == "ok" and last.metrics["new_tokens"] == 64 and "baseline_tokens_per_s" not in last.metrics
    turns = service.store.session_turns("s-stop-base", with_text=True)
    assert turns.loc[0, "status"] == "ok" and turns.loc[0, "reply_text"] == last.reply

    gen = service.turn("s-close-base", [], "What does json.dumps do?", Settings("tiny-long", max_new_tokens=64))
    update = next(gen)
    while update.status != "baseline" or not update.baseline_reply:
        update = next(gen)
    gen.close()          # Gradio's cancel, landing on a streamed baseline update
    turns = service.store.session_turns("s-close-base", with_text=True)
    assert turns.loc[0, "status"] == "ok" and turns.loc[0, "new_tokens"] == 64
    assert ("s-close-base", "tiny-long") in service.replies      # the next turn keeps the reply's own ids


def test_interrupted_turn_is_marked_incomplete_on_restart(tiny_preset, tmp_path):
    db = tmp_path / "crash.db"
    store = Store(db)
    store.start_turn("s7", "p", preset="tiny", target="t", assistant=None, mode="baseline", policy=None,
                     max_new_tokens=4, temperature=0.0, top_p=1.0, prompt_tokens=3)
    Store(db)      # a restart
    assert sqlite3.connect(db).execute("select status from turns").fetchone() == ("incomplete",)


def test_message_text_can_be_kept_out_of_the_log(tiny_preset, tmp_path):
    svc = ChatService(Store(tmp_path / "notext.db", store_text=False), tiny_preset, engine_process=False)
    finish(svc.turn("s8", [], "secret", Settings("tiny", max_new_tokens=4)))
    t = svc.store.session_turns("s8", with_text=True)
    assert t.loc[0, "prompt_text"] is None and t.loc[0, "reply_text"] is None


def test_replies_feed_lookup_and_survive_a_restart(tiny_preset, tmp_path):
    """Every finished reply joins the target's lookup index; a new start rebuilds it from the log, so
    the same question asked again after a restart is drafted from the earlier answer."""
    svc = ChatService(Store(tmp_path / "log.db"), tiny_preset, engine_process=False)
    svc.stream_interval = 0.0
    first = finish(svc.turn("a", [], "What does json.dumps do?", Settings("tiny", mode="baseline", max_new_tokens=24,
                                                                          compare=False)))
    engine = svc.engine("tiny")
    assert first.status == "ok" and len(engine.replies) == 1
    again = finish(svc.turn("b", [], "What does json.dumps do?", Settings("tiny", mode="lookup", max_new_tokens=24)))
    assert again.reply == first.reply and again.metrics["mean_accepted_length"] > 2      # plain decoding: 1

    restarted = ChatService(Store(tmp_path / "log.db"), tiny_preset, engine_process=False)
    restarted.stream_interval = 0.0
    assert len(restarted.store.replies(engine.preset.target)) == 2
    third = finish(restarted.turn("c", [], "What does json.dumps do?", Settings("tiny", mode="lookup", max_new_tokens=24,
                                                                               compare=False)))
    # the log keeps text: re-tokenised, a random model's reply may split differently, so less is drafted
    assert third.reply == first.reply and third.metrics["mean_accepted_length"] > 2


def test_per_chat_state_is_bounded(service, monkeypatch):
    """Policies and stop flags of chats long gone are dropped, least recently used first."""
    from dynchat.app.state import LRUDict

    service.policies, service.stops = LRUDict(3), LRUDict(3)
    for i in range(6):
        finish(service.turn(f"chat{i}", [], "hi", Settings("tiny", mode="lookup", max_new_tokens=4, compare=False)))
    assert list(service.stops) == ["chat3", "chat4", "chat5"] and len(service.policies) == 3
    evicted = []
    d = LRUDict(2, on_evict=evicted.append)
    d["a"], d["b"] = 1, 2
    d["a"]                                   # used: b is now the oldest
    d["c"] = 3
    assert list(d) == ["a", "c"] and evicted == [2]



def test_a_new_chat_starts_from_what_earlier_chats_learned(service):
    """The throughput policy's calibration and measured costs need more rounds than a short chat has: a
    new chat on the same preset, mode and policy starts where the last finished turn left them, as a copy."""
    import numpy as np

    settings = Settings("tiny", mode="assistant", policy="throughput", max_new_tokens=24, compare=False)
    finish(service.turn("first", [], "What does json.dumps do?", settings))
    first = service.policies[("first", "tiny", "assistant", "throughput")]
    assert first.rounds > 0 and first.calibration.seen.sum() > 0      # it drafted, and learned from it

    one_token = Settings("tiny", mode="assistant", policy="throughput", max_new_tokens=1, compare=False)
    finish(service.turn("second", [], "What does os.path.join do?", one_token))    # a reply of no rounds
    second = service.policies[("second", "tiny", "assistant", "throughput")]
    assert second is not first and second.rounds == first.rounds
    assert np.array_equal(second.calibration.seen, first.calibration.seen)
    assert list(second.verify_samples) == list(first.verify_samples)

    finish(service.turn("second", [], "What does os.path.join do?", settings))
    assert second.rounds > first.rounds                        # a copy: the first chat's state stays its own
    finish(service.turn("third", [], "hi", one_token))
    assert service.policies[("third", "tiny", "assistant", "throughput")].rounds == second.rounds   # the latest

    other = Settings("tiny", mode="assistant", policy="dynamic", max_new_tokens=1, compare=False)
    finish(service.turn("fourth", [], "hi", other))            # another policy starts fresh
    assert service.policies[("fourth", "tiny", "assistant", "dynamic")].describe().startswith("dynamic")


def test_an_unusable_log_path_is_one_clear_line(tmp_path):
    from dynchat.app.store import StoreError

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(StoreError, match="cannot be created"):
        Store(tmp_path / "a-file" / "log.db")
    (tmp_path / "junk.db").write_text("not a database at all" * 100)
    with pytest.raises(StoreError, match="cannot be opened: file is not a database"):
        Store(tmp_path / "junk.db")


@pytest.mark.slow
def test_the_app_refuses_an_unusable_log_path_without_a_traceback(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "a-file").write_text("x")
    env = {**os.environ, "DYNCHAT_DB": str(tmp_path / "a-file" / "log.db"), "DYNCHAT_PRESET": "demo"}
    out = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "cannot be created" in out.stderr


def prompts_and_reuse(monkeypatch) -> list:
    """A list that each generation from now on appends (its prompt ids, the tokens it took from the cache) to."""
    from dynchat.engine.decoder import Decoder
    from dynchat.engine.events import Summary

    seen = []
    original = Decoder.generate

    def spy(self, prompt_ids, *args, **kwargs):
        for event in original(self, prompt_ids, *args, **kwargs):
            if isinstance(event, Summary):
                seen.append((list(prompt_ids), event.reused_tokens))
            yield event

    monkeypatch.setattr(Decoder, "generate", spy)
    return seen


def test_a_follow_up_keeps_the_reply_s_own_token_ids_and_the_whole_cache(service, monkeypatch):
    """A model may write its reply in tokens its tokenizer would not choose (SmolLM2 wrote "\\n\\n" as
    one token; a random model mostly does): the follow-up's prompt keeps the ids it wrote, so the chat's
    cache is reused to the reply's end, not only up to the first token the text re-tokenizes differently."""
    seen = prompts_and_reuse(monkeypatch)
    settings = Settings("tiny", mode="baseline", max_new_tokens=24, compare=False)
    first = finish(service.turn("c", [], "What does json.dumps do?", settings))
    prompt1, reply_ids = seen[-1][0], service.replies[("c", "tiny")][1]
    history = [{"role": "user", "content": "What does json.dumps do?"}, {"role": "assistant", "content": first.reply}]
    engine = service.engine("tiny")
    canonical = engine.encode(history + [{"role": "user", "content": "And json.loads?"}])
    assert canonical[:len(prompt1) + len(reply_ids)] != prompt1 + reply_ids     # the text re-tokenizes otherwise
    finish(service.turn("c", history, "And json.loads?", settings))
    prompt2, reused = seen[-1]
    assert prompt2[:len(prompt1) + len(reply_ids)] == prompt1 + reply_ids
    assert engine.decode(prompt2) == engine.decode(canonical)                   # the same text
    assert reused >= len(prompt1) + len(reply_ids)       # all the cache held, and the next turn's start after it
    edited = [history[0], {"role": "assistant", "content": first.reply + " (edited)"}]
    finish(service.turn("c", edited, "And json.loads?", settings))
    assert seen[-1][0] == engine.encode(edited + [{"role": "user", "content": "And json.loads?"}])   # as written



def test_a_sampled_follow_up_after_the_comparison_still_prefills_only_its_message(service, monkeypatch):
    """Sampled, plain decoding's comparison writes another reply into the chat's cache than the one shown
    (on a page at temperature 0.7 a fourth turn's first token waited 714 ms: the whole chat prefilled again):
    after the turn the cache computes the shown reply's rows again from where the two replies part, so the
    follow-up, whose prompt holds the shown reply, still prefills only its message."""
    seen = prompts_and_reuse(monkeypatch)
    settings = Settings("tiny", mode="eagle3", max_new_tokens=24, compare=True, temperature=1.0, seed=3)
    first = finish(service.turn("s", [], "What does json.dumps do?", settings))
    prompt1, reply_ids = seen[-2][0], service.replies[("s", "tiny")][1]       # the reply's run, then the baseline's
    assert first.baseline_reply and first.baseline_reply != first.reply        # the comparison drew another reply
    history = [{"role": "user", "content": "What does json.dumps do?"}, {"role": "assistant", "content": first.reply}]
    finish(service.turn("s", history, "And json.loads?", settings))
    prompt2, reused = seen[-2]
    assert reused > len(prompt1) + len(reply_ids)                # the shown reply and the turn's start
    assert service.engine("tiny").decode(prompt2[reused:]).startswith("And json.loads?")   # and only the message on


@pytest.mark.parametrize("mode", ["baseline", "eagle3"])
def test_a_follow_up_prefills_only_its_message_and_replies_as_from_nothing(service, monkeypatch, mode):
    """After a turn the chat's cache computes what any next prompt begins with (the reply's end and the
    template's start of a user turn) while the reply is read: the follow-up prefills only its message
    and the template's tokens after it, as a new chat's first turn does, and replies exactly as its
    prompt prefilled from nothing does (greedy; EAGLE-3 reads the target's features of those rows)."""
    from dynchat.engine.decoder import run

    seen = prompts_and_reuse(monkeypatch)
    settings = Settings("tiny", mode=mode, max_new_tokens=24, compare=False)
    first = finish(service.turn("p", [], "What does json.dumps do?", settings))
    prompt1, reply_ids = seen[-1][0], service.replies[("p", "tiny")][1]
    history = [{"role": "user", "content": "What does json.dumps do?"}, {"role": "assistant", "content": first.reply}]
    second = finish(service.turn("p", history, "And json.loads?", settings))
    prompt2, reused = seen[-1]
    engine = service.engine("tiny")
    assert reused > len(prompt1) + len(reply_ids)                # more than the reply: the turn's start too
    assert engine.decode(prompt2[reused:]).startswith("And json.loads?")   # and no more: only the message on
    again, _ = run(engine.decoder(mode), prompt2, 24, max_reuse=0, session="fresh")
    assert service.replies[("p", "tiny")][1] == again and second.status == "ok"
