"""An EAGLE-3 head before training: its draft vocabulary (the target's most frequent tokens) and its
weights, shaped like one target layer and, optionally, started as the target's top feature layer."""
from __future__ import annotations

import torch

from ..engine.eagle3_head import Eagle3Head, default_layer_ids


def draft_vocabulary(sequences: list[list[int]], vocab_size: int, size: int,
                     allowed: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """The `size` most frequent target ids (sorted; among `allowed`, a boolean mask, when given; `keep`,
    ids that are in it whatever their count: a continued head's vocabulary) and the share of data tokens
    they cover."""
    counts = torch.bincount(torch.tensor([t for s in sequences for t in s]), minlength=vocab_size).float()
    if allowed is None and (size <= 0 or size >= vocab_size):
        return torch.arange(vocab_size), 1.0
    ranked = counts if allowed is None else counts.masked_fill(~allowed, -1)
    if keep is not None:
        ranked = ranked.clone()
        ranked[keep] = float("inf")
    top = ranked.topk(min(size, int(ranked.ge(0).sum()))).indices.sort().values
    return top, float(counts[top].sum() / counts.sum())


def grown_vocabulary(sequences: list[list[int]], vocab_size: int, size: int,
                     current: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A continued head's or draft's draft vocabulary grown to `size` (draft_vocabulary keeping `current`);
    a smaller size is refused (prune-eagle3-vocab restricts a head)."""
    if size < len(current):
        raise ValueError(f"the draft vocabulary holds {len(current)} tokens: it can grow, not shrink to {size}")
    return draft_vocabulary(sequences, vocab_size, size, keep=current)


def new_head(target, draft_ids: torch.Tensor, *, intermediate_size: int = 0, init_from_target: bool = False,
             seed: int = 0) -> Eagle3Head:
    """A head shaped like one target layer (MLP width intermediate_size, 0 = the target's), lm_head
    and norm initialised from the target's; with init_from_target, the layer starts as the target's
    top feature layer."""
    from transformers import LlamaConfig

    tc = target.config
    n = tc.num_hidden_layers
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=getattr(tc, "rope_parameters", None), num_hidden_layers=1,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
        draft_vocab_size=len(draft_ids), target_hidden_size=tc.hidden_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": default_layer_ids(n), "use_aux_hidden_state": True},
    )
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, own_embedding=False)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, 0, 0.02)
        if init_from_target:
            init_from_target_layer(head, target)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    head.share_embedding(target)
    return head


@torch.no_grad()
def init_from_target_layer(head: Eagle3Head, target) -> int:
    """Start the draft layer as the target layer whose input is the head's top feature (layer n-3):
    fc passes that feature through, q/k/v read it with that layer's weights (the embedding half of
    their input starts at zero), and the MLP, o_proj and norms are that layer's. Step 0 then
    computes exactly what that target layer computes; training moves it one token ahead. (SpecForge's
    ablation: early training accuracy 0.45 initialised against 0.06-0.19 from scratch.) Returns the
    layer's index."""
    index = head.layer_ids(target.config.num_hidden_layers)[-1]
    src, dst, H = target.model.layers[index], head.midlayer, head.config.hidden_size
    if head.target_hidden_size != H or head.config.intermediate_size != target.config.intermediate_size:
        raise ValueError("init from the target needs the target's hidden and intermediate sizes")
    head.fc.weight.zero_()
    head.fc.weight[:, 2 * H:].copy_(torch.eye(H))
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(dst.self_attn, name).weight
        w[:, :H].zero_()
        w[:, H:].copy_(getattr(src.self_attn, name).weight)
    dst.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
    dst.hidden_norm.weight.copy_(src.input_layernorm.weight)
    dst.input_layernorm.weight.copy_(src.input_layernorm.weight)
    dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
    return index
