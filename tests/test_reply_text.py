"""The streamed reply text: grown a round at a time from a short window, it ends exactly as one
decode of all the reply's tokens, never shows half a character, and costs O(n) decoding."""
import random

import pytest
from conftest import ROOT
from transformers import AutoTokenizer

from dynchat.app.reply_text import PARTIAL, ReplyText

TEXT = ("Voilà: naïve café, 東京タワー and 🚀🎉 emoji.\n    def f(x):\n        return x ** 2  # squares\n"
        "Ünïcödé «quotes» — dashes… and   spaces.  ") * 3


@pytest.mark.parametrize("folder", ["demo-target", "demo-draft-bpe3k"])
@pytest.mark.parametrize("seed", range(3))
def test_streamed_text_ends_as_one_full_decode(folder, seed):
    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "models" / folder)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    decoded_tokens = 0

    def decode(chunk):
        nonlocal decoded_tokens
        decoded_tokens += len(chunk)
        return tok.decode(chunk, skip_special_tokens=True)

    reply, rng, i, shown = ReplyText(decode), random.Random(seed), 0, []
    while i < len(ids):
        n = rng.randint(1, 6)
        reply.add(ids[i:i + n], rng.randint(0, n - 1))
        i += n
        shown.append(reply.text)
        assert PARTIAL not in reply.text
        assert "".join(t for t, _ in reply.segments) == reply.text
    final = reply.finish()
    assert final == tok.decode(ids, skip_special_tokens=True)
    assert all(final.startswith(s) for s in shown)          # what was shown is never taken back
    assert {label for _, label in reply.segments} == {"draft", "target"}
    assert decoded_tokens < 30 * len(ids)                    # a window per round, not the whole reply


def test_a_reply_cut_inside_a_character_drops_only_that_character():
    tok = AutoTokenizer.from_pretrained(ROOT / "data" / "models" / "demo-target")
    ids = tok("ok 🚀", add_special_tokens=False)["input_ids"]
    reply = ReplyText(lambda c: tok.decode(c))
    reply.add(ids[:-1], 0)
    assert reply.finish() == tok.decode(ids[:-1]).rstrip(PARTIAL)
