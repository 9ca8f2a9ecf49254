"""What the decoding loop streams: one RoundEvent per target forward, then one Summary.

Names and formulas follow the ecosystem (vLLM's SpecDecodingStats, SGLang, EAGLE): acceptance rate =
accepted / drafted draft tokens; mean accepted length = 1 + accepted / draft rounds, i.e. tokens per
verification forward, bonus token included. The prefill forward and rounds that drafted nothing
verify no draft, so they count in neither (vLLM's `num_drafts`).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def mean_accepted_length(accepted: int, draft_rounds: int) -> float:
    """vLLM's tau: 1 + accepted / rounds that drafted (1.0 when nothing was drafted)."""
    return 1.0 + accepted / draft_rounds if draft_rounds else 1.0


@dataclass
class RoundEvent:
    token_ids: list[int]          # tokens committed this round, in order
    from_draft: list[bool]        # per token: an accepted draft token (True) or the target's own
    drafted: int                  # draft tokens proposed this round
    accepted: int                 # of which accepted
    lookahead: int                # the most the policy allowed this round
    draft_s: float                # drafting time this round
    verify_s: float               # target forward + acceptance time this round
    elapsed_s: float              # since generation started

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Summary:
    new_tokens: int = 0
    target_forwards: int = 0
    draft_rounds: int = 0         # verification forwards with at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: float = 0.0
    finish_reason: str = ""       # eos | length | context | stopped
    per_position_accepted: list[int] = field(default_factory=list)   # rounds whose position i was accepted
    per_position_drafted: list[int] = field(default_factory=list)    # rounds that drafted position i
    shared: bool = False          # acceptance read from server-wide counters while other requests ran too
    reused_tokens: int = 0        # prompt tokens the cache held from the last turn (not prefilled again)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.accepted_tokens, self.draft_rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first / time after the first: generation without the prompt's prefill,
        what llama.cpp's `llama-bench` tg reports."""
        after = self.wall_s - self.ttft_s
        return (self.new_tokens - 1) / after if self.new_tokens > 1 and after > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        """Rounds whose draft position i was accepted / rounds that drafted position i."""
        return [a / d if d else 0.0 for a, d in zip(self.per_position_accepted, self.per_position_drafted)]

    def record_round(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """drafted: draft tokens verified (a tree's nodes); depth: draft positions (a tree's depth, a chain's length)."""
        self.draft_rounds += drafted > 0
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        depth = drafted if depth is None else depth
        while len(self.per_position_drafted) < depth:
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(depth):
            self.per_position_drafted[i] += 1
            self.per_position_accepted[i] += i < accepted

    def stats(self) -> dict:
        """The figures the CLI's --json prints under "stats"."""
        return {
            "new_tokens": self.new_tokens, "target_forwards": self.target_forwards,
            "draft_rounds": self.draft_rounds, "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate, "mean_accepted_length": self.mean_accepted_length,
            "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s, "ttft_s": self.ttft_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "finish_reason": self.finish_reason,
            "per_position_acceptance": self.per_position_acceptance(),
        }
