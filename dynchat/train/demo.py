"""`python -m dynchat train-demo`: rebuilds the embedded demo target and draft, offline.

Stages (each resumable from its checkpoint in --work-dir): corpus -> tokenizer -> target
(next-token training) -> draft (distilled from the target's distributions) -> evaluation and
model cards. Deep-and-narrow target, 2-layer draft: on a CPU a tiny model's forward cost follows
its layer count, so this pair reproduces the GPU regime where the draft is ~10x cheaper.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import corpus
from .common import TrainPlan, lr_at, plot_losses, write_card
from .data import batches, fixed_windows, read_items, token_stream, train_tokenizer


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


TARGET = Shape(hidden=256, layers=10, heads=8, kv_heads=4, intermediate=704)
DRAFT = Shape(hidden=176, layers=2, heads=4, kv_heads=4, intermediate=480)


@dataclass
class Plan(TrainPlan):
    """The demo's runs: a target of target_steps and a distilled draft of draft_steps (both from scratch,
    over a vocabulary of vocab_size tokens trained on the corpus)."""
    vocab_size: int = 4096
    batch_size: int = 16
    target_steps: int = 1100
    draft_steps: int = 600
    lr: float = 3e-3
    checkpoint_every: int = 50


def llama_config(shape: Shape, tokenizer, max_positions: int = 1024):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=max_positions,
        rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )


def _train(model, steps: int, plan: Plan, stream, ckpt: Path, desc: str, teacher=None) -> list[float]:
    """Shared loop: cross-entropy on data, or soft cross-entropy against a teacher's logits."""
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(plan.seed)
    losses: list[float] = []
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        losses, start = state["losses"], state["step"]
    data = batches(stream, plan.batch_size, plan.seq_len, gen)
    model.train()
    bar = tqdm(range(start, steps), desc=desc, initial=start, total=steps)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, plan.lr)
        x, y = next(data)
        logits = model(input_ids=x).logits
        if teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        else:
            with torch.no_grad():
                soft = F.softmax(teacher(input_ids=x).logits, dim=-1)
            loss = -(soft * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % plan.checkpoint_every == 0 or step + 1 == steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "losses": losses, "step": step + 1}, tmp)
            tmp.replace(ckpt)
    model.eval()
    return losses


@torch.no_grad()
def evaluate(target, draft, windows) -> dict:
    """Held-out perplexity of both models and greedy agreement of the draft with the target."""
    nll_t = nll_d = agree = count = 0.0
    for w in windows:
        x, y = w[None, :-1], w[None, 1:]
        lt, ld = target(input_ids=x).logits.float(), draft(input_ids=x).logits.float()
        nll_t += F.cross_entropy(lt[0], y[0], reduction="sum").item()
        nll_d += F.cross_entropy(ld[0], y[0], reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        count += y.numel()
    return {"target_perplexity": math.exp(nll_t / count), "draft_perplexity": math.exp(nll_d / count),
            "greedy_acceptance": agree / count, "heldout_tokens": int(count)}


def _save(model, tokenizer, out: Path, eos_ids: list[int]) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                     do_sample=False, max_new_tokens=128).save_pretrained(out)


@torch.no_grad()
def samples(model, tokenizer, prompts: list[str], max_new_tokens: int = 48) -> list[str]:
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run(out_root: Path, work: Path, plan: Plan) -> dict:
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(plan.seed)
    work.mkdir(parents=True, exist_ok=True)
    corpus_dir = work / "corpus"
    if not (corpus_dir / "manifest.json").exists():
        print("building corpus ...")
        corpus.build(corpus_dir, seed=plan.seed)
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    train_items, held_items = read_items(corpus_dir / "train.jsonl"), read_items(corpus_dir / "heldout.jsonl")

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        print("training tokenizer ...")
        train_tokenizer(train_items, plan.vocab_size, tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    streams = work / "streams.pt"
    if not streams.exists():
        # chat exchanges are short and few: repeat them so the chat format is learnt well
        chats = [it for it in train_items if "messages" in it]
        torch.save({"train": token_stream(train_items + 3 * chats, tokenizer),
                    "heldout": token_stream(held_items, tokenizer)}, streams)
    st = torch.load(streams)
    eos_ids = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    print(f"corpus: {st['train'].numel():,} training tokens, {st['heldout'].numel():,} held-out tokens")

    t0 = time.time()
    target = LlamaForCausalLM(llama_config(TARGET, tokenizer))
    t_losses = _train(target, plan.target_steps, plan, st["train"], work / "target.ckpt", "target")
    t_time = time.time() - t0
    target.requires_grad_(False)

    t0 = time.time()
    draft = LlamaForCausalLM(llama_config(DRAFT, tokenizer))
    d_losses = _train(draft, plan.draft_steps, plan, st["train"], work / "draft.ckpt", "draft (distil)", teacher=target)
    d_time = time.time() - t0

    tgt_dir, dft_dir = out_root / "demo-target", out_root / "demo-draft"
    _save(target, tokenizer, tgt_dir, eos_ids)
    _save(draft, tokenizer, dft_dir, eos_ids)
    # evaluate the weights as shipped (bf16 on disk, computed in float32)
    target = LlamaForCausalLM.from_pretrained(tgt_dir, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(dft_dir, dtype=torch.float32).eval()
    metrics = evaluate(target, draft, fixed_windows(st["heldout"], plan.seq_len, 64))
    print(json.dumps(metrics, indent=2))
    prompts = ["What does the function json.dumps do?", "What is the os.path module for?",
               "How do I sort a list in Python?"]
    plot_losses({"target": t_losses, "draft (distillation)": d_losses}, tgt_dir / "loss_curve.png")
    (dft_dir / "loss_curve.png").write_bytes((tgt_dir / "loss_curve.png").read_bytes())
    common = {
        "data": f"{manifest['documents']} documentation pages + {manifest['chat_pairs']} docstring Q&A chats "
                f"({st['train'].numel():,} training tokens); licence: {manifest['licence']}",
        "tokenizer": f"byte-level BPE, {len(tokenizer)} tokens, chat template <|user|>/<|assistant|>/<|end|>",
        "held-out target perplexity": f"{metrics['target_perplexity']:.2f}",
        "held-out draft perplexity": f"{metrics['draft_perplexity']:.2f}",
        "greedy acceptance (draft argmax == target argmax, held-out positions)": f"{metrics['greedy_acceptance']:.3f}",
        "reproduce": "python -m dynchat train-demo (seeded; resumable; see dynchat/train/demo.py)",
        "plan": json.dumps(asdict(plan)),
    }
    write_card(tgt_dir, "dynchat demo target", {
        "summary": "Small Llama-architecture target trained offline by dynchat on Python documentation.",
        "architecture": f"LlamaForCausalLM, {asdict(TARGET)}, {n_params(target):,} parameters",
        "training time": f"{t_time / 60:.1f} min on 2 CPU cores ({plan.target_steps} steps)", **common,
        "samples (greedy)": [f"{p!r} -> {s!r}" for p, s in zip(prompts, samples(target, tokenizer, prompts))],
    })
    write_card(dft_dir, "dynchat demo draft", {
        "summary": "Two-layer draft distilled from the demo target (soft cross-entropy on its distributions).",
        "architecture": f"LlamaForCausalLM, {asdict(DRAFT)}, {n_params(draft):,} parameters",
        "training time": f"{d_time / 60:.1f} min on 2 CPU cores ({plan.draft_steps} steps)", **common,
        "samples (greedy)": [f"{p!r} -> {s!r}" for p, s in zip(prompts, samples(draft, tokenizer, prompts))],
    })
    (tgt_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


OTHER_DRAFT_VOCAB = 3072


def run_other_tokenizer_draft(out_root: Path, work: Path, plan: Plan, steps: int = 600,
                              vocab_size: int = OTHER_DRAFT_VOCAB) -> dict:
    """A second demo draft with its own tokenizer (different vocabulary), for universal assisted generation.

    Trained by plain next-token cross-entropy (no shared vocabulary to distil through) on the corpus
    plus, when `train-eagle3` has generated them, the target's own responses as text, so the draft
    learns what the target says rather than only what the documents say.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(plan.seed)
    corpus_dir = work / "corpus"
    if not (corpus_dir / "manifest.json").exists():
        corpus.build(corpus_dir, seed=plan.seed)
    train_items = read_items(corpus_dir / "train.jsonl")
    tok_dir = work / f"tokenizer-{vocab_size}"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(train_items, vocab_size, tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    stream_file = work / f"streams-{vocab_size}.pt"
    responses = 0
    if not stream_file.exists():
        chats = [it for it in train_items if "messages" in it]
        items = train_items + 3 * chats
        generated = work / "eagle3" / "eagle3-data-t0.7.pt"
        if generated.exists():
            target_tok = AutoTokenizer.from_pretrained(out_root / "demo-target")
            texts = [target_tok.decode(s, skip_special_tokens=False) for s in torch.load(generated)]
            items += [{"text": t.removeprefix("<|endoftext|>").removesuffix("<|endoftext|>")} for t in texts] * 2
            responses = len(texts)
        torch.save({"train": token_stream(items, tokenizer), "responses": responses}, stream_file)
    st = torch.load(stream_file)
    eos_ids = [tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    t0 = time.time()
    draft = LlamaForCausalLM(llama_config(DRAFT, tokenizer))
    losses = _train(draft, steps, plan, st["train"], work / f"draft-{vocab_size}.ckpt", f"draft ({vocab_size} tokens)")
    minutes = (time.time() - t0) / 60
    out = out_root / f"demo-draft-bpe{vocab_size // 1024}k"
    _save(draft, tokenizer, out, eos_ids)
    plot_losses({f"draft, own {vocab_size}-token tokenizer": losses}, out / "loss_curve.png")
    prompts = ["What does the function json.dumps do?", "What is the os.path module for?"]
    n_params = sum(p.numel() for p in draft.parameters())
    write_card(out, "dynchat demo draft with its own tokenizer", {
        "summary": (f"Two-layer draft with its own byte-level BPE tokenizer ({vocab_size} tokens; the demo target has "
                    f"{plan.vocab_size}), for assisted generation across tokenizers. Trained by next-token "
                    "cross-entropy on the demo corpus and the target's own responses (as text)."),
        "architecture": f"LlamaForCausalLM, {asdict(DRAFT)}, {n_params:,} parameters",
        "training": f"{steps} steps x {plan.batch_size} x {plan.seq_len} tokens, {minutes:.1f} min on CPU; "
                    f"{st['train'].numel():,} training tokens incl. {st['responses']} target responses",
        "reproduce": "python -m dynchat train-demo --other-tokenizer-draft (after train-eagle3 for the responses)",
        "samples (greedy)": [f"{p!r} -> {s!r}" for p, s in zip(prompts, samples(draft, tokenizer, prompts))],
    })
    return {"out": str(out), "final_loss": sum(losses[-20:]) / len(losses[-20:])}
