"""The command line: generate --json on the embedded demo, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


def run_main(capsys, *args) -> tuple[int, str, str]:
    """main() as `python -m dynchat` runs it, in this process (the shell itself: the last test)."""
    from dynchat.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:          # argparse's own refusals
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def demo_preset(monkeypatch):
    monkeypatch.setenv("DYNCHAT_PRESET", "demo")       # the embedded demo


def cli(*args, env=None):
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "DYNCHAT_PRESET": "demo", **(env or {})}   # the embedded demo
    return subprocess.run([sys.executable, "-m", "dynchat", *args], cwd=ROOT, capture_output=True, text=True,
                          env=e, timeout=300)


def test_generate_json_on_the_demo_preset_offline(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What does the function json.dumps do?"}) + "\n"
                       + json.dumps({"prompt": "What is the os module for?"}) + "\n")
    base = run_main(capsys, "generate", "--mode", "baseline", "--prompts-file", str(prompts), "--max-new-tokens", "24",
                    "--json")
    spec = run_main(capsys, "generate", "--mode", "assistant", "--lookahead", "dynamic", "--prompts-file", str(prompts),
                    "--max-new-tokens", "24", "--json")
    assert base[0] == 0 and spec[0] == 0, base[2] + spec[2]
    b = [json.loads(line) for line in base[1].splitlines()]
    s = [json.loads(line) for line in spec[1].splitlines()]
    assert len(b) == len(s) == 2
    for x, y in zip(b, s):
        assert x["token_ids"] == y["token_ids"], "greedy assistant output differs from baseline"
        assert set(y) >= {"prompt", "mode", "token_ids", "text", "stats"}
        assert set(y["stats"]) >= {"new_tokens", "target_forwards", "draft_tokens", "accepted_tokens", "acceptance_rate",
                                   "mean_accepted_length", "wall_s", "tokens_per_s", "ttft_s"}
        assert y["stats"]["draft_tokens"] > 0 and y["text"].strip()
    assert sum(y["stats"]["target_forwards"] for y in s) < sum(x["stats"]["target_forwards"] for x in b)


def test_sampling_with_seeds_is_reproducible(capsys):
    args = ("generate", "--prompt", "Tell me about lists", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7",
            "--max-new-tokens", "16", "--json", "--raw")
    a, b = run_main(capsys, *args), run_main(capsys, *args)
    assert a[0] == 0 and json.loads(a[1])["token_ids"] == json.loads(b[1])["token_ids"]


@pytest.mark.parametrize("args, message", [
    (["--mode", "telepathy"], "invalid choice"),
    (["--lookahead", "psychic"], "invalid choice"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens must be >= 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "top-p must be in (0, 1]"),
    (["--preset", "nope"], "no such preset 'nope'"),
    (["--target", "/no/such/model"], "--target /no/such/model: no such directory"),
    (["--preset", "llama-3.1-8b"], "cannot load the target"),
    (["--mode", "eagle3", "--target", "data/models/demo-draft"], "--mode eagle3: not available here"),
    (["--mode", "eagle3", "--target", "data/models/demo-draft", "--eagle3", "data/models/demo-eagle3"],
     "does not fit the target"),
    (["--mode", "eagle3", "--tree-top-k", "0"], "top-k >= 1"),
    (["--prompts-file", "/no/file.jsonl"], "no such file"),
    (["--prompt", "word " * 2000, "--raw"], "context length"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, capsys):
    if "--prompts-file" not in args and "--prompt" not in args:
        args = args + ["--prompt", "hi"]
    code, _, err = run_main(capsys, "generate", "--max-new-tokens", "4", *args)
    assert code == 2, err
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err      # one line, the last


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0.9"], "--top-p 0.9 samples only with a --temperature above 0"),    # would run greedy, record 0.9
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "0.7", "--top-p", "1.5"], "top-p must be in (0, 1]"),
])
def test_a_bench_with_sampling_settings_it_cannot_use_says_so_in_one_line(args, message, capsys):
    code, _, err = run_main(capsys, "bench", "--preset", "demo", "--peer", "off", *args)
    assert code == 2 and message in err.strip().splitlines()[-1] and "Traceback" not in err


@pytest.mark.slow
def test_bad_input_from_the_shell_is_one_line_without_a_traceback():
    r = cli("generate", "--max-new-tokens", "4", "--preset", "nope", "--prompt", "hi")
    assert r.returncode == 2 and r.stderr.strip() == "error: no such preset 'nope' (have: " + r.stderr.split("(have: ")[1].strip()
    assert "Traceback" not in r.stderr


def test_export_writes_all_sessions_turns_as_csv(tmp_path, capsys):
    import csv

    from dynchat.app.store import Store

    db = tmp_path / "log.db"
    store = Store(db)
    for sid, prompt in (("a", "=1+1"), ("b", "hello")):
        tid = store.start_turn(sid, prompt, preset="demo", target="t", assistant=None, mode="baseline", policy=None,
                               max_new_tokens=4, temperature=0.0, top_p=1.0, prompt_tokens=3)
        store.finish_turn(tid, "ok", rounds=[{"lookahead": 0, "drafted": 0, "accepted": 0, "new_tokens": 1,
                                              "draft_s": 0.0, "verify_s": 0.01}], new_tokens=1, tokens_per_s=10.0)
    out = tmp_path / "turns.csv"
    code, _, err = run_main(capsys, "export", "--db", str(db), "--out", str(out))
    assert code == 0, err
    rows = list(csv.DictReader(open(out)))
    assert [row["session_id"] for row in rows] == ["a", "b"] and all(row["status"] == "ok" for row in rows)
    assert "prompt_text" not in rows[0]
