"""A loaded preset as the app, CLI and bench use it: its models, tokenizer, modes, and a decoder per mode."""
from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import torch

from ..engine.decoder import Decoder
from ..engine.drafters import DraftModelDrafter
from ..engine.eagle3_head import Eagle3Head
from ..engine.eagle_drafter import Eagle3Drafter, TreeShape
from ..engine.forward import VerifyCosts, make_lm, verify_cost_curve
from ..engine.lookup import LookupDrafter, ReplyIndex, WithLookup, calibrate
from ..engine.model import context_length, eos_ids
from ..engine.other_tokenizer import OtherTokenizerDrafter
from ..engine.policies import Calibration
from .config import MODES, Preset

# new tokens of a reply before the assistant drafts (`assistant_start_after` in a preset's generation):
# its catch-up over the prompt is paid only by replies that go on long enough to earn it back
ASSISTANT_START_AFTER = 12
# on a CPU, the most a draft model reads to catch up on a conversation (DraftModelDrafter.catch_up_window):
# a 4-layer draft read the ~690 tokens of a sixth turn in ~33 ms; an accelerator reads them in one pass
ASSISTANT_CATCH_UP_CPU = 256


def same_vocabulary(a, b) -> bool:
    return a is b or a.get_vocab() == b.get_vocab()


def pinned_verify_ms() -> dict[int, float] | None:
    """DYNCHAT_VERIFY_MS ("1:40,2:41,5:50"): a verify-cost curve instead of the one timed at warm-up, so
    lookup's and the policies' cost-weighed choices (and so sampled tokens) repeat from run to run."""
    text = os.environ.get("DYNCHAT_VERIFY_MS", "").strip()
    if not text:
        return None
    try:
        curve = {int(n): float(ms) for n, ms in (pair.split(":") for pair in text.split(","))}
    except ValueError:
        raise ValueError(f"DYNCHAT_VERIFY_MS={text!r}: write tokens:ms pairs, e.g. 1:40,2:41,5:50") from None
    if not curve or min(curve) < 1 or min(curve.values()) <= 0:
        raise ValueError(f"DYNCHAT_VERIFY_MS={text!r}: tokens from 1 up, ms above 0")
    return curve


class TokenizedPreset:
    """Prompt ids and reply text for a preset, and its EAGLE-3 drafting shape: all that needs no model.

    Shared by Engine and the app's stand-in for an engine in another process (worker.RemoteEngine).
    """
    preset: Preset
    tokenizer: object

    @property
    def tree(self) -> TreeShape | None:
        """The preset's EAGLE-3 drafting: a tree shape, or None for a chain."""
        gen = self.preset.generation
        if gen.get("eagle3_drafting", "tree") == "chain":
            return None
        return TreeShape(gen.get("tree_top_k", 4), gen.get("tree_depth", 5), gen.get("tree_tokens", 16))

    def policy(self, mode: str, name: str | None = None, k: int | None = None, tree="preset"):
        """The lookahead policy for a mode: the one asked for, else the preset's measured default.

        A tree (EAGLE-3; `tree` as for decoder()) drafts its own shape, so its depth caps the
        lookahead as a constant; plain decoding has none.
        """
        from ..engine.policies import make_policy
        from .config import preset_policy

        if mode == "baseline":
            return None
        tree = self.tree if tree == "preset" else tree
        if mode == "eagle3" and tree is not None:
            return make_policy("constant", tree.depth)
        return make_policy(*preset_policy(self.preset, name, k, mode), getattr(self, "verify_ms", None))

    def encode(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """Token ids for a prompt: plain text to continue (raw), or a chat through the chat template."""
        if raw:
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.tokenizer.chat_template is None:
            text = "\n".join(m["content"] for m in messages)
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def shared_prefix(self) -> tuple[int, ...]:
        """The token ids every chat's first prompt begins with: what the chat template puts before the
        user's message (its system prompt), found as what prompts of different messages share; () with
        no chat template. A new chat takes their cache rows, computed once."""
        if self.tokenizer.chat_template is None:
            return ()
        probes = [self.encode(text) for text in ("a", "b", "Hello", "1 + 1")]
        n = 0
        while all(len(p) > n for p in probes) and len({p[n] for p in probes}) == 1:
            n += 1
        return tuple(probes[0][:n])

    def require_mode(self, mode: str) -> None:
        if mode not in self.modes:
            raise ValueError(f"mode {mode!r} is not available for preset {self.preset.name!r} "
                             f"(available: {', '.join(self.modes)})")


@dataclass
class Engine(TokenizedPreset):
    """A loaded preset: the target, its tokenizer, and the optional assistant."""
    preset: Preset
    target: object
    tokenizer: object
    assistant: object | None = None
    assistant_tokenizer: object | None = None
    eagle3: Eagle3Head | None = None
    lock: threading.Lock = None
    quantization: str = "none"          # weight-only, of all its models (models.yaml `quantization`)
    replies: ReplyIndex = None          # the target's earlier replies, which lookup drafts from
    held_out_replies: list | None = None    # more of them, not indexed: lookup's calibration walks them at warm-up
    verify_ms: dict | None = None       # ms of a target forward by tokens verified, measured at warm-up

    @property
    def weights(self) -> str:
        """What the target's matmuls run on: int8 / int4; GGUF blocks found in the target's weights
        (SmolLM2's published Q4_1) and the arithmetic they are multiplied in; else the float dtype."""
        dtype = str(self.target.dtype).removeprefix("torch.")
        lm = next(iter(self._target_lms.values()), None)
        formats = sorted({w.format for layer in getattr(lm, "weights", []) for w in layer.values() if hasattr(w, "format")})
        if self.quantization != "none":
            return self.quantization + (" x int8 activations" if any("int8 activations" in f for f in formats) else "")
        if not formats:
            return dtype
        name = formats[0].split()[0]
        return f"{name} blocks x int8 activations" if "int8 activations" in formats[0] else f"{name} blocks, {dtype} arithmetic"

    def __post_init__(self):
        self.lock = self.lock or threading.Lock()
        self.replies = self.replies if self.replies is not None else ReplyIndex()
        self.costs = VerifyCosts()          # the verify-cost curve lookup drafts by, measured at warm-up
        self.lookup_calibration = Calibration()     # how often lookup's estimates prove right, all modes
        self._decoders: dict[tuple, Decoder] = {}
        self._target_lms: dict = {}          # one target cache per backend, shared by every mode's decoder
        self.eos_token_ids = eos_ids(self.target, self.tokenizer)

    @property
    def modes(self) -> list[str]:
        return ["baseline", "lookup"] + (["assistant"] if self.assistant is not None else []) + \
            (["eagle3"] if self.eagle3 is not None else [])

    def remember(self, replies: list[list[int]]) -> None:
        """Replies (token ids) the lookup drafter may draft from from now on."""
        self.replies.add_many(replies)

    def prepare_turn(self, session, ids: list[int]) -> int:
        """The conversation's kept target cache extended to `ids`, what its next prompt begins with
        (Decoder.prepare); rows computed."""
        return self.decoder("baseline").prepare(ids, session)

    def remember_texts(self, texts: list[str]) -> None:
        """Logged reply texts (the app's session log), tokenized as the target would have written them."""
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts if t]
        self.replies.add_many(ids)

    @functools.cached_property
    def assistant_tokenizer_differs(self) -> bool:
        """The assistant drafts in its own tokens (universal assisted generation)."""
        return self.assistant is not None and not same_vocabulary(self.tokenizer, self.assistant_tokenizer)

    @property
    def context_length(self) -> int:
        return context_length(self.target.config)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def lookup_branches(self) -> bool:
        """Whether lookup's draft rides beside a model's as a second branch by default: the preset's
        `lookup_branches`, else on an accelerator only."""
        return bool(self.preset.generation.get("lookup_branches", self.device.type != "cpu"))

    def decoder(self, mode: str, backend: str | None = None, tree: TreeShape | None | str = "preset",
                lookup: bool = True, branches: bool | None = None) -> Decoder:
        """A decoder for the mode; backend "transformers" forces Transformers modules (default: fastest).

        tree (EAGLE-3 only): a TreeShape, None for chain drafting, or "preset" for the preset's choice.
        lookup: a model's rounds yield to lookup drafts when those expect more (WithLookup); the
        bench turns it off to measure the model alone. branches: on greedy model rounds lookup's candidate
        rides along as a second branch of the verified tree; None: the preset's `lookup_branches`, by
        default on an accelerator only (on a CPU each verified token costs ~10% of a step, and EAGLE-3's
        rounds made 2-3% more tokens a second without the branch: docs/benchmarks.md).
        """
        branches = self.lookup_branches if branches is None else branches
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.require_mode(mode)
        if mode == "eagle3":
            tree = self.tree if tree == "preset" else tree
            if tree is not None and backend == "transformers":
                raise ValueError("EAGLE-3 tree drafting needs the lean backend; use chain drafting with Transformers modules")
        key = (mode, backend, tree if mode == "eagle3" else None, lookup, branches)
        if key in self._decoders:     # decoders are reusable: each generation resets them
            return self._decoders[key]
        drafter = None
        vocab = self.target.get_output_embeddings().weight.shape[0]
        if mode == "assistant" and self.assistant_tokenizer_differs:
            drafter = OtherTokenizerDrafter(self.assistant, self.assistant_tokenizer, self.tokenizer, self.eos_token_ids,
                                            vocab, backend)
        elif mode == "assistant":
            drafter = DraftModelDrafter(self.assistant, vocab, backend,
                                        start_after=self.preset.generation.get("assistant_start_after",
                                                                                ASSISTANT_START_AFTER),
                                        catch_up_window=ASSISTANT_CATCH_UP_CPU if self.device.type == "cpu" else None)
            drafter.lm.shared_prefix = self.shared_prefix      # the same tokenizer: the same start
        elif mode == "eagle3":
            drafter = Eagle3Drafter(self.eagle3, self.target, tree)
        elif mode == "lookup":
            drafter = self._lookup_drafter()
        if backend not in self._target_lms:
            self._target_lms[backend] = make_lm(self.target, backend)
            self._target_lms[backend].shared_prefix = self.shared_prefix
        if lookup and mode in ("assistant", "eagle3") and not isinstance(drafter, OtherTokenizerDrafter):
            branches = branches and self._target_lms[backend].verifies_trees     # a second branch is a tree
            drafter = WithLookup(drafter, self._lookup_drafter(), branches=branches)
        self._decoders[key] = Decoder(self.target, drafter, self.eos_token_ids, backend, self._target_lms[backend],
                                      self.costs)
        return self._decoders[key]

    def _lookup_drafter(self) -> LookupDrafter:
        """Lookup over this engine's reply index, at its verify costs, with its shared calibration; drafting
        nothing past the target's end-of-reply tokens."""
        return LookupDrafter(self.replies, costs=self.costs, calibration=self.lookup_calibration,
                             stop_ids=self.eos_token_ids)

    def warm_up(self) -> None:
        """One short generation per mode, so the first measured reply is not the one paying for lazy setup."""
        from ..engine.decoder import run
        from ..engine.policies import Constant

        if self.held_out_replies:          # once: lookup's estimates calibrated before the first reply
            calibrate(self.lookup_calibration, self.replies, self.held_out_replies)
            self.held_out_replies = None
        ids = self.encode("Hello")
        for mode in self.modes:
            decoder = self.decoder(mode)
            drafter = getattr(decoder.drafter, "model", decoder.drafter)     # WithLookup wraps the model's
            start = getattr(drafter, "start_after", 0)
            if start:
                drafter.start_after = 0         # a 4-token warm-up must run the draft too
            try:
                run(decoder, ids, 4, policy=Constant(2))
            finally:
                if start:
                    drafter.start_after = start
        pinned = pinned_verify_ms()
        self.verify_ms = pinned or verify_cost_curve(self.decoder("baseline").target, sizes=(1, 2, 3, 5, 9), repeats=3)
        self.costs.curve = dict(self.verify_ms)
        self.costs.learn = pinned is None          # a pinned curve stays as given
