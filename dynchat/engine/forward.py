"""The cached forward the decoding loop uses for a model: our lean one where it applies, else Transformers'."""
from __future__ import annotations

import os

from . import lean
from .model import CachedLM
from .ops import quantization_of


def make_lm(model, backend: str | None = None, exact: bool = True):
    """The fastest cached forward for this model: our lean one for Llama-family models, else Transformers'.

    backend: "auto" (default, or DYNCHAT_BACKEND), "lean" or "transformers". exact=False (a
    drafter's model) lets the lean forward use cheaper, inexact matmuls (bf16 weights).
    """
    backend = backend or os.environ.get("DYNCHAT_BACKEND", "auto")
    if backend not in ("auto", "lean", "transformers"):
        raise ValueError(f"unknown backend {backend!r}; choose auto, lean or transformers")
    if backend == "transformers" or not lean.supports(model):
        if quantization_of(model) != "none":
            raise ValueError(f"{quantization_of(model)} weights run on dynchat's own forward for Llama-family "
                             "models only; Transformers' forward would run the float weights")
        if backend == "lean":
            raise ValueError(f"the lean backend does not support {model.config.model_type!r} models")
        return CachedLM(model)
    return lean.LeanLM(model, exact=exact)
