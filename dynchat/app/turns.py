"""What a chat turn is made of before it runs: its settings and their checks, the cleaned message,
the history as plain messages, and the snapshots of it the UI renders."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.policies import DEFAULT_POLICY, POLICIES
from ..engine.sampling import SamplingParams
from ..presets.config import MODES
from ..presets.runtime import Engine

# ~8k tokens of English (SmolLM2's whole context): a pasted article fits; each model's own limit is checked in tokens
MAX_MESSAGE_CHARS = 32_000
MAX_NEW_TOKENS_LIMIT = 1024


class TurnError(ValueError):
    """Bad input for a turn: shown to the user as is."""


@dataclass
class Settings:
    preset: str
    mode: str = "assistant"
    policy: str = DEFAULT_POLICY
    max_new_tokens: int = 96
    temperature: float = 0.0
    top_p: float = 1.0
    compare: bool = True
    seed: int | None = None

    def validate(self, engine: Engine) -> None:
        if self.mode not in MODES:
            raise TurnError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.mode not in engine.modes:
            raise TurnError(f"mode {self.mode!r} is not available for preset {self.preset!r} "
                            f"(available: {', '.join(engine.modes)})")
        if self.policy not in POLICIES:
            raise TurnError(f"unknown lookahead policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise TurnError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {self.max_new_tokens}")
        try:
            SamplingParams(float(self.temperature), float(self.top_p))
        except (TypeError, ValueError) as e:
            raise TurnError(str(e)) from None
        if self.temperature > 5:
            raise TurnError(f"temperature must be between 0 and 5, got {self.temperature}")


@dataclass
class TurnUpdate:
    reply: str = ""
    segments: list[tuple[str, str]] = field(default_factory=list)   # (text, "draft" | "target")
    metrics: dict = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)
    status: str = "streaming"          # queued | streaming | baseline | ok | cancelled | error
    notice: str = ""
    baseline_reply: str = ""           # plain decoding's reply to the same prompt, streamed as the reply was

    def snapshot(self) -> TurnUpdate:
        return TurnUpdate(self.reply, list(self.segments), dict(self.metrics), list(self.rounds), self.status,
                          self.notice, self.baseline_reply)


def clean_text(text: str) -> str:
    """Drop control characters (but newlines and tabs) and unpaired surrogates."""
    text = text.encode("utf-8", "replace").decode("utf-8")   # lone surrogates -> '?'
    return "".join(ch for ch in text if ch in "\n\t" or ch.isprintable() or ch == " ")


def history_messages(history: list) -> list[dict]:
    """Gradio messages (content as str or a list of text blocks) -> plain role/content dicts. A message
    that got no reply (a turn that failed before its first token leaves an empty reply after it) is
    left out with that reply: the model never answered it."""
    out = []
    for m in history or []:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            continue
        if (m.get("metadata") or {}).get("title"):     # notices, not conversation
            continue
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(b.get("text", "") for b in c if isinstance(b, dict))
        if not isinstance(c, str):
            continue
        if m["role"] == "assistant" and not c.strip() and out and out[-1]["role"] == "user":
            out.pop()
            continue
        out.append({"role": m["role"], "content": c})
    return out


def with_reply_ids(decode, msgs: list[dict], ids: list[int], last: tuple[list[int], list[int], str] | None
                   ) -> list[int]:
    """The prompt `ids` (msgs through the chat template) with the last reply's own token ids where that
    reply's text stands. A model may write a text in tokens its tokenizer would not choose (SmolLM2 wrote
    "\\n\\n" as one token, which its text tokenizes as two), and the conversation's kept cache holds
    what it wrote: a prompt re-tokenized from the text lost the cache from there (a follow-up prefilled
    129 of its 648 tokens again). `last`: (the prompt the reply answered, the reply's ids, its text as
    the history shows it). Where anything differs (history edited, oldest exchanges dropped, the text
    not the ids' decoding), `ids` as they are. decode: ids -> text, special tokens left out."""
    if last is None or len(msgs) < 2 or msgs[-2].get("role") != "assistant":
        return ids
    prompt, reply_ids, text = last
    start = len(prompt)
    if msgs[-2].get("content") != text or ids[:start] != prompt:
        return ids
    own = list(reply_ids)
    while own and decode(own[-1:]) == "":        # an end-of-turn token: the template writes its own
        own.pop()
    if not own or decode(own) != text:
        return ids
    for end in range(start + 1, len(ids) + 1):   # the shortest run of ids that spells the reply's text
        spelled = decode(ids[start:end])
        if spelled == text:
            return ids[:start] + own + ids[end:]
        if len(spelled) > len(text):
            break
    return ids
