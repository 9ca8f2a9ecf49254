"""A causal LM with its KV cache, as the decoding loop sees it: feed tokens, get logits, roll back."""
from __future__ import annotations

import torch
from transformers import DynamicCache


def context_length(config) -> int:
    """The longest sequence the model was built for (positions it can attend to)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30


def eos_ids(model, tokenizer) -> list[int]:
    """Every token that ends a reply: the generation config's EOS id(s) and the tokenizer's."""
    cfg = model.generation_config
    eos = cfg.eos_token_id if cfg is not None else None
    ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class CachedLM:
    """One sequence (batch 1) of a Transformers causal LM and its cache.

    `length` counts the tokens in the cache. Rollback crops the cache by length, so a rejected
    draft costs nothing to undo; sliding-window layers record past states so they can roll back.
    """
    verifies_trees = False          # forward takes no tree_mask: a lookup branch cannot ride along

    def __init__(self, model):
        self.model = model
        self.device = model.device
        self.max_length = context_length(model.config)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.reset()

        self.features: torch.Tensor | None = None
        self._hooks = []

    reuses_prefix = False       # a batched prefill and token-by-token steps differ in the last bits
    keeps_sessions = False      # one cache for every conversation

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.cache.activate_past_recording()
        self.length = 0
        self.held: list[int] = []     # never set: this forward reuses no prefix between generations

    def use_session(self, key) -> None:
        """This forward does not reuse a prefix: nothing is kept per conversation."""

    def resume(self, keep: int) -> None:
        """A new sequence whose first `keep` tokens are the cache's (the decoder checked they match)."""
        if keep:
            self.rollback(keep)
            self.held = []
        else:
            self.reset()

    def shared_rows(self, prompt_ids) -> int:
        """No prefix is shared between conversations here (LeanLM.shared_rows)."""
        return 0

    def begin(self, prompt_ids, keep: int, max_reuse: int | None = None) -> int:
        self.resume(keep)
        return keep

    def capture(self, layer_ids: list[int]) -> None:
        """Keep the inputs of these decoder layers per cached position (EAGLE-3 features), by forward hooks."""
        for h in self._hooks:
            h.remove()
        self._captured: dict[int, torch.Tensor] = {}
        self._capture_ids = list(layer_ids)

        def hook(index):
            def keep(module, args, kwargs):
                self._captured[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            return keep

        layers = self.model.model.layers
        self._hooks = [layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in self._capture_ids]
        self.features = torch.zeros(0, 0)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, last_only: bool = False, positions=None, tree_mask=None) -> torch.Tensor:
        """Append ids (1-D) to the sequence; return logits (n, V), or (1, V) for the last when last_only."""
        if tree_mask is not None:
            raise NotImplementedError("tree verification needs the lean backend (Llama-family targets)")
        out = self.model(input_ids=ids[None], cache=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        start = self.length
        self.length += ids.numel()
        if self._hooks:
            new = torch.cat([self._captured[i][0] for i in self._capture_ids], dim=-1)
            if self.features.shape[0] < self.length:
                grown = new.new_zeros(max(256, 2 * self.length), new.shape[-1])
                if start:
                    grown[:start] = self.features[:start]
                self.features = grown
            self.features[start:self.length] = new
        return out.logits[0]

    def rollback(self, keep: int) -> None:
        """Keep the first `keep` tokens of the cache."""
        self.cache.crop(-(self.length - keep))
        self.length = keep
