"""The bench's prompt files are held out of the reply corpus the SmolLM2 head, draft and lookup index
are made from: a speedup measured on a prompt the drafters were trained on, or whose reply lookup
has indexed, says nothing about the prompts a user types."""
import json
from pathlib import Path

from dynchat.cli import BENCH_PROMPT_FILES

ROOT = Path(__file__).resolve().parents[1]


def _user_messages(row: dict) -> list[str]:
    return [row["prompt"]] if "prompt" in row else [m["content"] for m in row["messages"] if m["role"] == "user"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_bench_prompts_are_held_out_of_the_reply_corpus():
    corpus = [msg for path in sorted((ROOT / "data" / "responses" / "smollm2").glob("prompts-*.jsonl"))
              for row in _rows(path) for msg in _user_messages(row)]
    assert len(corpus) > 20_000
    asked = set(corpus)
    everything = "\n".join(corpus)
    for name in BENCH_PROMPT_FILES:
        for row in _rows(ROOT / "data" / name):
            for msg in _user_messages(row):
                assert msg not in asked, (name, msg[:80])
    # the prompts that work on a given text: the text itself (its longest line) is in no corpus prompt
    text_rows = _rows(ROOT / "data" / "bench_text_prompts.jsonl")
    assert len({r["kind"] for r in text_rows}) >= 6 and len(text_rows) >= 12
    for row in text_rows:
        given = max(row["prompt"].split("\n"), key=len)
        assert len(given) > 40 and given not in everything, given[:80]


def test_the_corpus_builder_holds_out_every_bench_prompt(monkeypatch, tmp_path):
    """prepare-responses never asks the target a bench prompt, whichever bench file it is in (a new
    file in data/ included): every one of their messages is in the plan's exclusions."""
    import dynchat.cli as cli
    import dynchat.train.responses as responses

    assert {p.name for p in (ROOT / "data").glob("bench_*prompts.jsonl")} == set(BENCH_PROMPT_FILES)
    plans = []

    class Builder:            # the plan as the command builds it; nothing generated
        def __init__(self, target, out, plan):
            plans.append(plan)

        def build(self):
            return {}

    monkeypatch.setattr(responses, "ResponseBuilder", Builder)
    monkeypatch.setattr(cli, "_local_target", lambda source: source)
    assert cli.main(["prepare-responses", "--target", "some-target", "--out", str(tmp_path)]) == 0
    excluded = set(plans[0].exclude)
    for name in BENCH_PROMPT_FILES:
        for row in _rows(ROOT / "data" / name):
            assert set(_user_messages(row)) <= excluded, name
