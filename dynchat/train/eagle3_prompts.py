"""Train an EAGLE-3 head for a local target from prompts: `python -m dynchat train-eagle3 --target DIR --out DIR`.

1. Data: the target's own responses to prompts (chat questions through its chat template, and
   openings of plain documents to continue), generated in batches and cached in the work dir.
2. Draft vocabulary: the most frequent tokens of that data (d2t / t2d), or the full vocabulary.
3. Training-time test (ttt.py) from a head shaped like one target layer (head_init.py).
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine.eagle3_head import Eagle3Head
from .common import TrainPlan, end_of_text
from .head_init import draft_vocabulary, new_head
from .ttt import fit, ttt_loss


@dataclass
class Eagle3Plan(TrainPlan):
    steps: int = 600
    ttt_steps: int = 6
    draft_vocab: int = 0             # 0 = the full vocabulary
    max_prompts: int = 4000
    response_tokens: int = 128
    gen_batch: int = 64
    temperatures: tuple[float, ...] = (0.7,)   # one response set per temperature (0 = greedy)
    checkpoint_every: int = 25
    intermediate_size: int = 0       # 0 = the target's
    init_from_target: bool = False   # the draft layer starts as the target's top feature layer


def read_prompts(path: Path, tokenizer, limit: int, seed: int, opening_tokens: int = 48) -> list[list[int]]:
    """Prompt token ids from a jsonl of {"messages"}, {"prompt"} or {"text"} items."""
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    random.Random(seed).shuffle(items)
    prompts = []
    for it in items[:limit]:
        if "messages" in it or "prompt" in it:
            msgs = [m for m in it.get("messages", []) if m["role"] != "assistant"][:1] or \
                [{"role": "user", "content": it.get("prompt", "")}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompts.append(list(ids["input_ids"]))
        else:          # a document: several openings to continue, from different places
            text = it["text"]
            for start in range(0, max(1, len(text) - 200), 1500)[:6]:
                ids = tokenizer(text[start:start + 600], add_special_tokens=True)["input_ids"]
                prompts.append(ids[:opening_tokens])
    return [p for p in prompts if p][:limit]


@torch.no_grad()
def generate_responses(target, tokenizer, prompts: list[list[int]], plan: Eagle3Plan,
                       temperature: float) -> list[list[int]]:
    """prompt + the target's own response per prompt, batched with left padding.

    The order depends only on the prompts' lengths, so sets made at different temperatures line up
    prompt by prompt (the held-out split is by prompt).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = target.generation_config.eos_token_id
    out = []
    torch.manual_seed(plan.seed)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))      # similar lengths share a batch
    for b in tqdm(range(0, len(order), plan.gen_batch), desc=f"target responses (T={temperature:g})"):
        batch = [prompts[i] for i in order[b:b + plan.gen_batch]]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        gen = target.generate(ids, attention_mask=mask, max_new_tokens=plan.response_tokens,
                              do_sample=temperature > 0, temperature=temperature or None,
                              top_p=0.95 if temperature > 0 else None,
                              pad_token_id=pad, eos_token_id=eos)
        for p, row in zip(batch, gen[:, width:].tolist()):
            resp = []
            for t in row:
                resp.append(t)
                if t in (eos if isinstance(eos, list) else [eos]):
                    break
            out.append(p + resp)
    return out


def _features(target, ids: torch.Tensor, layer_ids: list[int], draft_ids: torch.Tensor):
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in layer_ids], -1)
        logp = F.log_softmax(out.logits[..., draft_ids].float(), -1)
    return feats, logp


@torch.no_grad()
def heldout_agreement(head, target, windows: torch.Tensor, layer_ids, draft_ids, steps: int) -> list[float]:
    """Top-1 agreement with the target by draft step, averaged over held-out windows."""
    val = []
    for w in windows:
        feats, logp = _features(target, w[None], layer_ids, draft_ids)
        val.append(ttt_loss(head, feats, w[None], logp, steps)[1])
    return [sum(v[j] for v in val) / len(val) for j in range(len(val[0]))]


def _data_name(temperature: float) -> str:
    return f"eagle3-data-t{temperature:g}.pt"


def _windows(sequences: list[list[int]], seq_len: int, eos: int) -> torch.Tensor:
    stream = [t for s in sequences for t in s + [eos]]
    n = len(stream) // seq_len
    return torch.tensor(stream[:n * seq_len]).view(n, seq_len)


def train(target_dir: Path, out_dir: Path, prompts_path: Path, work: Path, plan: Eagle3Plan) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .common import plot_losses, write_card

    torch.manual_seed(plan.seed)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    n_layers = target.config.num_hidden_layers
    if n_layers < 7:
        raise ValueError(f"the target has {n_layers} layers; EAGLE-3 needs at least 7")

    response_sets, prompts = [], None
    for temperature in plan.temperatures:
        data_file = work / _data_name(temperature)
        if data_file.exists():
            response_sets.append(torch.load(data_file))
            continue
        if prompts is None:
            prompts = read_prompts(prompts_path, tokenizer, plan.max_prompts, plan.seed)
        response_sets.append(generate_responses(target, tokenizer, prompts, plan, temperature))
        torch.save(response_sets[-1], data_file)
    eos = end_of_text(target)
    n_prompts = len(response_sets[0])
    if any(len(s) != n_prompts for s in response_sets):
        raise ValueError("response sets of different sizes in the work dir; delete them to regenerate")
    order = list(range(n_prompts))
    random.Random(plan.seed).shuffle(order)
    n_val = max(8, n_prompts // 40)
    held = set(order[:n_val])              # the same prompts are held out of every set
    sequences = [s for rs in response_sets for s in rs]
    train_seqs = [rs[i] for rs in response_sets for i in range(n_prompts) if i not in held]
    draft_ids, coverage = draft_vocabulary(train_seqs, target.config.vocab_size, plan.draft_vocab)
    windows = _windows(train_seqs, plan.seq_len, eos)
    val_windows = {t: _windows([rs[i] for i in order[:n_val]], plan.seq_len, eos)[:16]
                   for t, rs in zip(plan.temperatures, response_sets)}

    head = new_head(target, draft_ids, intermediate_size=plan.intermediate_size,
                    init_from_target=plan.init_from_target, seed=plan.seed)
    layer_ids = head.layer_ids(n_layers)
    def sample(gen):
        ids = windows[torch.randint(len(windows), (plan.batch_size,), generator=gen)]
        feats, logp = _features(target, ids, layer_ids, draft_ids)
        return feats, ids, logp

    def phases_from(start: int, saved: list | None) -> list:
        """Training phases (steps, peak lr, temperatures): a run that continues a finished one with more
        steps restarts the schedule's decay from where it stands."""
        phases = list(saved or [])
        phase = {"steps": [start, plan.steps], "lr": plan.lr, "temperatures": list(plan.temperatures)}
        if start < plan.steps and (not phases or phases[-1] != phase):
            if phases:
                phases[-1]["steps"][1] = start          # where the previous phase actually ended
            phases.append(phase)
        return phases

    run = fit(head, sample, steps=plan.steps, lr=plan.lr, warmup=min(50, plan.steps // 10), ttt_steps=plan.ttt_steps,
              seed=plan.seed, ckpt=work / "eagle3.ckpt", checkpoint_every=plan.checkpoint_every, meta=phases_from,
              on_checkpoint=lambda: head.save_pretrained(out_dir))
    losses, seconds, phases = run["losses"], run["seconds"], run["meta"]
    head.eval()
    val_by_temperature = {f"{t:g}": heldout_agreement(head, target, w, layer_ids, draft_ids, plan.ttt_steps)
                          for t, w in val_windows.items()}
    val_acc = next(iter(val_by_temperature.values()))
    head.save_pretrained(out_dir)
    plot_losses({"eagle3 head (TTT loss)": losses}, out_dir / "loss_curve.png")
    metrics = {
        "plan": asdict(plan), "target": str(target_dir), "sequences": len(sequences),
        "training_tokens_seen": plan.steps * plan.batch_size * plan.seq_len,
        "draft_vocab_size": len(draft_ids), "draft_vocab_coverage": coverage, "feature_layers": layer_ids,
        "heldout_top1_by_step": val_acc, "heldout_top1_by_step_by_temperature": val_by_temperature,
        "phases": phases, "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "train_seconds": seconds,
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    write_card(out_dir, "EAGLE-3 head for the dynchat demo target", {
        "summary": ("A one-layer EAGLE-3 draft head (published checkpoint format: fc, midlayer, norm, lm_head, d2t, "
                    "t2d; the target's embedding is shared) trained by `python -m dynchat train-eagle3` with "
                    "training-time test on the target's own responses to prompts."),
        "target": str(target_dir), "feature layers (inputs of)": layer_ids,
        "draft vocabulary": f"{len(draft_ids)} tokens covering {coverage:.1%} of the training tokens",
        "training": (f"{plan.steps} steps x {plan.batch_size} x {plan.seq_len} tokens, {plan.ttt_steps} TTT steps "
                     f"(weights 0.8^j), AdamW, {seconds / 60:.0f} min on CPU; phases (steps, peak lr, response "
                     "temperatures): " + "; ".join(f"{p['steps'][0]}-{p['steps'][1]}, {p['lr']:g}, "
                                                   f"{'/'.join(f'{t:g}' for t in p['temperatures'])}" for p in phases)),
        "held-out top-1 agreement with the target, by draft step": [
            f"responses at T={t}: " + " ".join(f"{a:.3f}" for a in acc) for t, acc in val_by_temperature.items()],
        "data": (f"{len(sequences)} target responses ({n_prompts} prompts from {prompts_path.name} at temperatures "
                 f"{', '.join(f'{t:g}' for t in plan.temperatures)}); {n_val} prompts held out"),
    })
    return metrics


def prune_vocabulary(head_dir: Path, out_dir: Path, work: Path, size: int) -> dict:
    """Restrict a trained head to the `size` target tokens most frequent in its training data (the
    response sets cached in `work`), and write it with its card amended. Measured on the demo:
    1024 of 4096 tokens cover 92% of the data and leave mean accepted length unchanged."""
    import shutil

    sets = sorted(work.glob("eagle3-data*.pt"))
    if not sets:
        raise ValueError(f"{work}: no eagle3-data*.pt response sets (the train-eagle3 work dir) to count tokens in")
    head = Eagle3Head.from_pretrained(head_dir)
    sequences = [s for f in sets for s in torch.load(f)]
    keep, coverage = draft_vocabulary(sequences, head.config.vocab_size, size, allowed=head.t2d)
    small = head.restrict_vocabulary(keep)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("README.md", "metrics.json", "loss_curve.png"):
        if (head_dir / name).exists() and head_dir.resolve() != out_dir.resolve():
            shutil.copy(head_dir / name, out_dir / name)
    small.save_pretrained(out_dir)
    note = {"from_draft_vocab_size": head.draft_vocab_size, "draft_vocab_size": small.draft_vocab_size,
            "coverage": coverage, "counted_in": [f.name for f in sets]}
    metrics_file = out_dir / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    metrics["vocabulary_pruned"] = note
    metrics_file.write_text(json.dumps(metrics, indent=2))
    card = out_dir / "README.md"
    text = card.read_text() if card.exists() else "# EAGLE-3 head\n"
    card.write_text(text.rstrip("\n") + "\n\n## draft vocabulary pruned\n\n"
                    f"- `python -m dynchat prune-eagle3-vocab --size {size}`: lm_head restricted from "
                    f"{head.draft_vocab_size} to the {small.draft_vocab_size} tokens most frequent in the training "
                    f"responses ({coverage:.1%} of their tokens); other weights unchanged. The held-out figures "
                    "above are the unpruned head's.\n")
    return note
