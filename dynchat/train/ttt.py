"""EAGLE-3's training-time test, the objective every head trainer here optimises, and its loop.

The head runs `steps` draft steps per position, feeding back its own pre-norm output; step j is
trained on the target's distribution (over the draft vocabulary) for the token j+2 ahead, weighted
0.8^j. The attention of step j sees the real positions up to its origin plus its own chain's
earlier steps: exactly what it sees when drafting.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine.eagle3_head import Eagle3Head
from ..engine.layer import Heads


def ttt_attention(head: Eagle3Head, x: torch.Tensor, positions: torch.Tensor, past: list) -> tuple:
    """Step j's attention: causal over step 0's keys, plus its own chain's keys of steps 1..j.

    x: (B, T, 2H); past: [(k, v)] of earlier steps, k/v (B, kv, T, hd). Returns (out, (k, v)).
    """
    cfg = head.config
    attn = head.midlayer.self_attn
    B, T, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = F.linear(x, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    cos, sin = head.rotary_emb(x, positions[None].expand(B, -1))
    q, k, v = (t.transpose(1, 2) for t in Heads(nh, nkv, hd).split(qkv, cos[:, :, None], sin[:, :, None]))
    steps = past + [(k, v)]
    rep = nh // nkv
    k0, v0 = steps[0][0].repeat_interleave(rep, 1), steps[0][1].repeat_interleave(rep, 1)
    scale = 1 / math.sqrt(hd)
    scores = (q @ k0.transpose(-1, -2)) * scale                                      # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(q * ki.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for ki, _ in steps[1:]]
    weights = torch.softmax(torch.cat([scores, *diag], -1), -1)
    out = weights[..., :T] @ v0
    for i, (_, vi) in enumerate(steps[1:]):
        out = out + weights[..., T + i:T + i + 1] * vi.repeat_interleave(rep, 1)
    out = out.transpose(1, 2).reshape(B, T, nh * hd)
    return out, (k, v)


def ttt_forward(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, steps: int, logits: bool = True):
    """The head's training-time-test forward: per draft step j, logits (B, T - 1 - j, Vd) for origin t
    (with logits=False, the pre-norm outputs the logits come from, (B, T - 1 - j, H)).

    Step j at origin t reads token x_{t+1+j} and its own step j-1 output (step 0: fc(g_t)), and
    predicts x_{t+2+j}: what the drafter computes when its drafts so far were x_{t+2..t+1+j}.
    """
    T = tokens.shape[1]
    hidden = head.fc(features)
    past: list = []
    for j in range(steps):
        shift = 1 + j
        if T - shift < 2:
            return
        tok_in = F.pad(tokens[:, shift:], (0, shift), value=0)
        x = head.layer_input(hidden, tok_in)
        positions = torch.arange(T, device=tokens.device) + j
        attn_out, kv = ttt_attention(head, x, positions, past)
        past.append(kv)
        hidden = head.after_attention(hidden, attn_out)
        yield head.logits(hidden[:, :T - shift]) if logits else hidden[:, :T - shift]


def ttt_loss(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, target_logp: torch.Tensor,
             steps: int, counted: torch.Tensor | None = None,
             aligned: bool = False) -> tuple[torch.Tensor, list[float], list[tuple]]:
    """Training-time-test loss over one batch, the per-step top-1 agreement with the target, and
    per step (agreeing positions, counted positions).

    features (B, T, 3H) captured at every position; tokens (B, T); target_logp (B, T, Vd): the
    target's log-distribution over the draft vocabulary for the token after each position (the
    label of step j at origin t is the one at position t+1+j); counted (B, T), optional: the
    positions whose label counts (e.g. responses only), weighted 0.8^j by step. aligned: step j's
    loss counts only the origins where steps 0..j-1 drafted the target's top token (GRIFFIN's token
    alignment: a greedy round never reaches step j elsewhere); the agreement figures count every
    position either way.
    """
    total, accs, tallies = 0.0, [], []
    B, T = tokens.shape
    keep_all = torch.ones(B, T, dtype=torch.bool, device=tokens.device) if counted is None else counted
    reached = keep_all[:, 1:]                     # origins whose chain so far drafted the target's top tokens
    for j, out in enumerate(ttt_forward(head, features, tokens, steps, logits=False)):
        keep = keep_all[:, 1 + j:]
        label = target_logp[:, 1 + j:][keep]
        logits = head.logits(out[keep])           # the draft vocabulary's logits only where the label counts
        n = max(1, label.shape[0])
        right = logits.argmax(-1) == label.argmax(-1)
        per_position = -(label.exp() * F.log_softmax(logits.float(), -1)).sum(-1)
        if aligned:
            trained = reached[:, :T - 1 - j][keep]
            loss = (per_position * trained).sum() / max(1, int(trained.sum()))
            hit = torch.zeros_like(keep)
            hit[keep] = right
            reached = reached[:, :T - 2 - j] & hit[:, :T - 2 - j]
        else:
            loss = per_position.sum() / n
        total = total + (0.8 ** j) * loss
        hits = float(right.sum())
        accs.append(hits / n)
        tallies.append((hits, float(label.shape[0])))
    return total, accs, tallies


def fit(head: Eagle3Head, sample, *, steps: int, lr: float, warmup: int, ttt_steps: int, seed: int, ckpt: Path,
        checkpoint_every: int, meta=None, on_checkpoint=None, aligned: bool = False) -> dict:
    """The training-time-test loop both head trainers share: AdamW (0.9, 0.95), cosine schedule,
    gradient clip 0.5, a checkpoint every `checkpoint_every` steps, resumable.

    sample(generator) -> (features, tokens, target log-probabilities[, counted positions]) for one
    batch. meta(start,
    saved) -> what the trainer keeps with the checkpoint (given what the checkpoint held).
    Returns losses, per-step agreement, training seconds and meta.
    """
    from .common import lr_at, refuse_other_seed, refuse_other_shape, refuse_other_vocabulary

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses, accs, start, seconds, saved = [], [], 0, 0.0, None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        refuse_other_vocabulary(ckpt, state["head"].get("d2t"), head.d2t)
        refuse_other_shape(ckpt, state["head"], head.state_dict())
        refuse_other_seed(ckpt, state.get("seed"), seed)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        losses, accs, start, seconds, saved = (state["losses"], state["accs"], state["step"], state["seconds"],
                                               state["meta"])
    kept = meta(start, saved) if meta else None
    head.train()
    bar = tqdm(range(start, steps), desc="eagle3 head", initial=start, total=steps)
    for step in bar:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=warmup)
        feats, tokens, logp, *counted = sample(gen)
        loss, step_acc, _ = ttt_loss(head, feats, tokens, logp, ttt_steps, *counted, aligned=aligned)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        losses.append(float(loss.detach()))
        accs.append(step_acc)
        seconds += time.perf_counter() - t0
        recent = accs[-20:]
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                        acc0=f"{sum(a[0] for a in recent) / len(recent):.3f}")
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "seed": seed,
                        "losses": losses, "accs": accs, "step": step + 1, "seconds": seconds, "meta": kept}, tmp)
            tmp.replace(ckpt)
            if on_checkpoint:
                on_checkpoint()
    head.eval()
    return {"losses": losses, "accs": accs, "seconds": seconds, "meta": kept}
