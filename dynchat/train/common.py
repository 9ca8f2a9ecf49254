"""What every trainer here shares: the run's plan, the learning-rate schedule, loss-curve plots, model cards."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainPlan:
    """A training run: `steps` batches of `batch_size` windows of up to `seq_len` tokens at peak `lr`,
    checkpointed every `checkpoint_every` steps; drafters predict over `draft_vocab` tokens (0: all)."""
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    draft_vocab: int = 4096
    seed: int = 0
    checkpoint_every: int = 20


def refuse_other_vocabulary(ckpt, saved, current) -> None:
    """A stopped run resumes only with the draft vocabulary it was made with (its labels are that vocabulary's)."""
    import torch

    if saved is not None and (saved.shape != current.shape or not torch.equal(saved, current.cpu())):
        raise ValueError(f"{ckpt} was made with another draft vocabulary ({saved.numel()} tokens): continue it with "
                         "the same --draft-vocab, or delete it to start over")


def refuse_other_seed(ckpt, saved: int | None, current: int) -> None:
    """A stopped run resumes only with the seed it was made with: it goes on with that run's draw of
    conversations (its generator's state), so another --seed would be written in the card and not used.
    A checkpoint from before seeds were kept says nothing (None)."""
    if saved is not None and saved != current:
        raise ValueError(f"{ckpt} was made with --seed {saved}: continue it with the same seed, or delete it to "
                         "start over")


def refuse_other_shape(ckpt, saved: dict, current: dict) -> None:
    """A stopped run resumes only into a model of the shape it was made with (an MLP widened to another
    --intermediate-size would not load)."""
    other = [k for k, v in current.items() if k in saved and tuple(saved[k].shape) != tuple(v.shape)]
    if other:
        raise ValueError(f"{ckpt} was made with another shape of {other[0]} ({tuple(saved[other[0]].shape)}, now "
                         f"{tuple(current[other[0]].shape)}): continue it with the same sizes, or delete it to start over")


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    """Linear warm-up to `peak`, then a cosine down to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def plot_losses(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        k = 25
        smooth = [sum(ys[max(0, i - k):i + 1]) / len(ys[max(0, i - k):i + 1]) for i in range(len(ys))]
        ax.plot(smooth, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (smoothed)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_card(out: Path, title: str, body: dict) -> None:
    lines = [f"# {title}", "", body.pop("summary"), ""]
    for k, v in body.items():
        if isinstance(v, list):
            lines += ([""] if lines[-1] else []) + [f"## {k}", ""] + [f"- {x}" for x in v] + [""]
        else:
            lines.append(f"- **{k}**: {v}")
    (out / "README.md").write_text("\n".join(lines) + "\n")


def end_of_text(model) -> int:
    """The token that ends a sequence in packed training windows: the model's (first) EOS."""
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    return int(eos if eos is not None else model.config.eos_token_id)
