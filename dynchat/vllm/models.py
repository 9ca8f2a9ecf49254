"""A draft model as vLLM can load it: standalone, with a head size its attention supports.

dynchat's drafts may borrow the target's embedding (`dynchat_shared_embedding`: not stored) and may
have a head size vLLM's CPU attention lacks (the demo draft's 44; vLLM's CPU backend takes 32, 64,
80, 96, ...). vLLM gets a converted copy in the cache (DYNCHAT_CACHE/vllm), made once:

- the borrowed embedding is written in (tied to the lm_head, as in the target);
- heads are zero-padded to the next supported size, exactly: RoPE pairs dimension j with j + d/2,
  so the d/2 pairs keep their places in the first half and at D/2 in the second; rope_theta becomes
  theta^(D/d) so pair i keeps its frequency theta^(-2i/d); q is scaled by sqrt(D/d) so q.k/sqrt(D)
  equals the original q.k/sqrt(d); padded value dimensions are zero and o_proj ignores them.
A draft restricted to a draft vocabulary (draft_vocab.safetensors) drafts over the full vocabulary
in vLLM, which has no such restriction for draft models.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from ..engine import cache_root
from ..presets.loading import lend_embedding, load_model, shares_embedding

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def supported_head_size(d: int, device: str) -> int:
    """d itself where vLLM's attention takes it, else the next size its CPU backend supports."""
    if device != "cpu" or d in VLLM_CPU_HEAD_SIZES:
        return d
    bigger = [s for s in VLLM_CPU_HEAD_SIZES if s > d]
    if not bigger:
        raise ValueError(f"head size {d} is larger than any vLLM CPU attention supports")
    return bigger[0]


def _place(w: torch.Tensor, heads: int, d: int, D: int, dim: int) -> torch.Tensor:
    """Spread each head's d rows (dim=0) or columns (dim=1) over D: halves at 0 and D/2, zeros elsewhere."""
    if dim == 1:
        return _place(w.t(), heads, d, D, 0).t().contiguous()
    rest = w.shape[1:]
    src = w.reshape(heads, d, *rest)
    out = w.new_zeros(heads, D, *rest)
    h = d // 2
    out[:, :h], out[:, D // 2:D // 2 + h] = src[:, :h], src[:, h:]
    return out.reshape(heads * D, *rest)


def pad_heads(model, D: int) -> None:
    """Pad every attention head of a Llama-style model from head_dim d to D, in place (see module doc)."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": cfg.rope_theta})
    if rope.get("rope_type", "default") != "default" or d % 2:
        raise ValueError(f"head padding needs plain RoPE and an even head size (got {rope.get('rope_type')}, {d})")
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.weight = torch.nn.Parameter(_place(a.q_proj.weight, H, d, D, 0) * math.sqrt(D / d))
            a.k_proj.weight = torch.nn.Parameter(_place(a.k_proj.weight, KV, d, D, 0))
            a.v_proj.weight = torch.nn.Parameter(_place(a.v_proj.weight, KV, d, D, 0))
            a.o_proj.weight = torch.nn.Parameter(_place(a.o_proj.weight, H, d, D, 1))
    rope["rope_theta"] = float(rope["rope_theta"]) ** (D / d)
    cfg.head_dim, cfg.rope_parameters = D, rope


def vllm_ready_draft(source: str, target_folder: str, device: str = "cpu") -> str:
    """The folder vLLM loads for a draft model: `source` itself when it loads as is (or is a hub id,
    which vLLM fetches itself), else a converted copy."""
    src = Path(source)
    if not (src / "config.json").is_file():
        return source
    cfg = json.loads((src / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    D = supported_head_size(d, device)
    if D == d and not cfg.get("dynchat_shared_embedding"):
        return source
    stamp = hashlib.sha256(json.dumps([str(src.resolve()), (src / "model.safetensors").stat().st_mtime_ns,
                                       str(Path(target_folder).resolve()), D]).encode()).hexdigest()[:12]
    out = cache_root() / "vllm" / f"{src.name}-{stamp}"
    if (out / "config.json").exists():
        return str(out)
    model = load_model("assistant", source, torch.float32, torch.device("cpu"))
    if shares_embedding(model.config):
        target = load_model("target", target_folder, torch.float32, torch.device("cpu"))
        lend_embedding(model, target)
        model.config.dynchat_shared_embedding = False
        model.config.tie_word_embeddings = True
    if D != d:
        pad_heads(model, D)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    for f in src.iterdir():           # the tokenizer and chat template travel with the weights
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")) or f.name == "generation_config.json":
            (tmp / f.name).write_bytes(f.read_bytes())
    tmp.rename(out)
    return str(out)
