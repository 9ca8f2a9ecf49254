"""What an EAGLE-3 head trains on, recomputed from a reply corpus's token ids, memory-mapped.

`python -m dynchat prepare-features --target SRC --replies data/responses/smollm2 --out DIR` runs
the target once over each conversation of the corpus (the prompt through the chat template, then
the target's own response) and keeps, per position, the inputs of the three feature layers and
the final normed hidden state (the target's distribution over the draft vocabulary is rebuilt
from it and the lm_head rows while training), in bfloat16 `.npy` files opened memory-mapped.

The corpus is visited in one fixed shuffled order, in chunks written as they finish (the meta file
last, atomically): a stop loses at most the chunk in progress, and any prefix of chunks is a fair
sample of the whole corpus, so a run cut short still trains on a mix of every prompt kind.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..engine.eagle3_head import default_layer_ids
from ..engine.reply_shards import read_shard


@dataclass(frozen=True)
class Conversation:
    stage: int              # the corpus stage whose prompt file holds the prompt
    prompt_index: int
    temperature: float
    response: np.ndarray    # token ids of the target's response


def corpus(replies: Path) -> tuple[list[Conversation], dict[int, list[list[dict]]]]:
    """Every response of a reply corpus and its prompts by stage."""
    prompts = {}
    for path in sorted(replies.glob("prompts-*.jsonl")):
        stage = int(path.stem.split("-")[1])
        prompts[stage] = [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]
    out = []
    for path in sorted(replies.glob("shard-s*-t*-*.npz")):
        stage = int(path.name.split("-")[1][1:])
        index, responses, temperature = read_shard(path)
        out += [Conversation(stage, i, temperature, r) for i, r in zip(index, responses)]
    if not out:
        raise ValueError(f"{replies}: no shard-s*-t*-*.npz reply shards (run prepare-responses first)")
    return out, prompts


def _key(c: Conversation) -> tuple:
    return c.stage, c.prompt_index, round(float(c.temperature), 4)


def _shuffled(convs: list[Conversation], seed: int) -> list[int]:
    """A fixed shuffled order that does not move when the corpus grows: by a hash of each conversation's
    identity, so conversations added later fall in among the rest instead of reshuffling them."""
    import hashlib

    def rank(i):
        return hashlib.blake2b(repr((seed, *_key(convs[i]))).encode(), digest_size=8).digest()
    return sorted(range(len(convs)), key=rank)


def _featured(out: Path) -> set[tuple]:
    """The conversations whose features are already in `out` (a resumed or grown run skips them)."""
    done = set()
    for meta in out.glob("c*-meta.npz"):
        with np.load(meta) as z:
            done.update(zip(z["stage"].tolist(), z["prompt_index"].tolist(),
                            [round(float(t), 4) for t in z["temperature"]]))
    return done


def heldout(c: Conversation, every: int) -> bool:
    """Every `every`-th prompt of each stage is held out, at every temperature."""
    return c.prompt_index % every == every - 1


def _bf16(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy()


@contextlib.contextmanager
def captured_states(model, layers: list[int]):
    """Forward hooks for the duration: a dict filled by each forward with the inputs of `layers`
    (by layer index) and the final norm's output ("norm")."""
    grabbed: dict = {}

    def pre(i):
        def hook(module, args, kwargs):
            grabbed[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return hook

    hooks = [model.model.layers[i].register_forward_pre_hook(pre(i), with_kwargs=True) for i in layers]
    hooks.append(model.model.norm.register_forward_hook(lambda m, a, o: grabbed.__setitem__("norm", o)))
    try:
        yield grabbed
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def _capture(model, sequences: list[list[int]], layers: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(features (n, 3H), normed (n, H)) per sequence: one right-padded forward for the batch."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with captured_states(model, layers) as grabbed:
        model.model(input_ids=ids, attention_mask=mask, use_cache=False)   # causal: padding on the right changes nothing
    feats = torch.cat([grabbed[i] for i in layers], -1)
    return [(feats[b, :len(s)], grabbed["norm"][b, :len(s)]) for b, s in enumerate(sequences)]


WEIGHTS = ("float32", "int4")


def _int4_forward(model, layers: list[int]):
    """The target as the int4 preset runs it (GGUF Q4_1 blocks x int8 activations, dynchat's native
    kernels), keeping its feature layers' inputs and its final normed hidden states: a head drafting
    for that preset is fed and judged by these, which round differently from float32 arithmetic."""
    from ..engine.forward import make_lm
    from ..presets.loading import mark_quantized

    mark_quantized(model, "int4", "target", int_dot=True)
    lm = make_lm(model)
    lm.capture(layers)
    lm.keep_normed = True
    return lm


@torch.no_grad()
def _capture_lean(lm, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    lm.reset()
    lm.forward(torch.tensor(seq), last_only=True)
    return lm.features[:len(seq)].clone(), lm.normed.clone()


def build(target_dir: Path, replies: Path, out: Path, chunk: int = 256, batch: int = 16, limit: int = 0,
          seed: int = 0, weights: str = "float32") -> dict:
    """Chunks of features for the corpus's conversations not yet in `out` (all, or up to `limit` in all, in a
    fixed shuffled order); new chunks follow the existing ones, so a grown corpus only adds chunks.
    weights: the target's arithmetic (WEIGHTS): float32 (Transformers, batched) or int4 (as the int4
    preset runs it, one conversation at a time)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}: choose one of {', '.join(WEIGHTS)}")
    out.mkdir(parents=True, exist_ok=True)
    if (out / "build.json").exists() and json.loads((out / "build.json").read_text()).get("weights", "float32") != weights:
        raise ValueError(f"{out} holds features of other weights; give another --out")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    layers = default_layer_ids(model.config.num_hidden_layers)
    lm = _int4_forward(model, layers) if weights == "int4" else None
    convs, prompts = corpus(replies)
    done = _featured(out)
    order = [i for i in _shuffled(convs, seed) if _key(convs[i]) not in done]
    if limit:
        order = order[:max(0, limit - len(done))]
    free = (i for i in range(1 << 20) if not (out / f"c{i:05d}-meta.npz").exists())   # a stopped chunk's name first
    from ..presets.config import ROOT

    shown = replies.resolve().relative_to(ROOT) if replies.resolve().is_relative_to(ROOT) else replies
    (out / "build.json").write_text(json.dumps({"replies": str(shown), "seed": seed, "chunk": chunk, "weights": weights,
                                                "layers": layers, "conversations": len(convs)}) + "\n")
    bar = tqdm(total=len(order), desc="features", unit="conv")
    done_positions, t_start = 0, time.perf_counter()
    for c0 in range(0, len(order), chunk):
        name = f"c{next(free):05d}"
        part = order[c0:c0 + chunk]
        seqs, prompt_lens = [], []
        for i in part:
            c = convs[i]
            p = list(tokenizer.apply_chat_template(prompts[c.stage][c.prompt_index], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"])
            seqs.append(p + c.response.tolist())
            prompt_lens.append(len(p))
        by_length = sorted(range(len(seqs)), key=lambda j: len(seqs[j]))
        captured: list = [None] * len(seqs)
        for b in range(0, len(by_length), batch):
            idx = by_length[b:b + batch]
            got_all = _capture(model, [seqs[j] for j in idx], layers) if lm is None else \
                [_capture_lean(lm, seqs[j]) for j in idx]
            for j, got in zip(idx, got_all):
                captured[j] = got
            bar.update(len(idx))
        np.save(out / f"{name}-feats.npy", _bf16(torch.cat([f for f, _ in captured])))
        np.save(out / f"{name}-normed.npy", _bf16(torch.cat([n for _, n in captured])))
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)
        tmp = out / f"{name}-meta.tmp.npz"
        np.savez(tmp, tokens=np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]),
                 starts=np.concatenate([[0], np.cumsum(lengths)]), prompt_lens=np.asarray(prompt_lens, dtype=np.int64),
                 stage=np.array([convs[i].stage for i in part]), prompt_index=np.array([convs[i].prompt_index for i in part]),
                 temperature=np.array([convs[i].temperature for i in part], dtype=np.float32), layers=np.array(layers))
        tmp.replace(out / f"{name}-meta.npz")
        done_positions += int(lengths.sum())
        bar.set_postfix(pos_s=f"{done_positions / (time.perf_counter() - t_start):.0f}")
    bar.close()
    return summary(out)


def summary(out: Path) -> dict:
    metas = sorted(out.glob("c*-meta.npz"))
    positions = conversations = 0
    for m in metas:
        with np.load(m) as z:
            positions += int(z["starts"][-1])
            conversations += len(z["prompt_lens"])
    return {"chunks": len(metas), "conversations": conversations, "positions": positions, "out": str(out)}


class FeatureStore:
    """The chunks of a features folder, memory-mapped, as conversations to sample training windows from.

    A window is up to `seq_len` positions of one conversation, from its start (what the head sees when
    drafting: the conversation so far, nothing before it); longer conversations are cut from random
    starts. Held-out conversations are kept apart by prompt."""

    def __init__(self, folder: Path, heldout_every: int = 25):
        self.chunks = []
        train, held = [], []
        for meta_path in sorted(folder.glob("c*-meta.npz")):
            name = meta_path.name[:-len("-meta.npz")]
            with np.load(meta_path) as z:
                meta = {k: z[k] for k in z.files}
            k = len(self.chunks)
            self.chunks.append({**{key: meta[key] for key in ("tokens", "starts", "prompt_lens", "stage", "prompt_index")},
                                "feats": np.load(folder / f"{name}-feats.npy", mmap_mode="r"),
                                "normed": np.load(folder / f"{name}-normed.npy", mmap_mode="r")})
            self.layers = meta["layers"].tolist()
            for j in range(len(meta["prompt_lens"])):
                c = Conversation(int(meta["stage"][j]), int(meta["prompt_index"][j]), round(float(meta["temperature"][j]), 4),
                                 np.empty(0))
                (held if heldout(c, heldout_every) else train).append((k, j, c.temperature))
        if not self.chunks:
            raise ValueError(f"{folder}: no c*-meta.npz feature chunks (run prepare-features first)")
        self.train, self.held = train, held

    STAGES = {1: "templated and Magpie prompts", 2: "follow-ups and text work", 3: "everyday prompts"}

    def held_groups(self) -> dict[str, list]:
        """The held-out conversations by corpus stage and temperature (each kind of prompt judged apart:
        the templated ones share their few topics with training, the everyday ones do not)."""
        groups: dict[str, list] = {}
        for k, j, t in sorted(self.held, key=lambda w: (int(self.chunks[w[0]]["stage"][w[1]]), w[2])):
            stage = int(self.chunks[k]["stage"][j])
            groups.setdefault(f"{self.STAGES.get(stage, f'stage {stage}')}, T={t:g}", []).append((k, j, t))
        return groups

    def positions(self, which: list) -> int:
        return sum(int(self.chunks[k]["starts"][j + 1] - self.chunks[k]["starts"][j]) for k, j, _ in which)

    def tokens(self, which: list) -> list[np.ndarray]:
        return [self.chunks[k]["tokens"][self.chunks[k]["starts"][j]:self.chunks[k]["starts"][j + 1]] for k, j, _ in which]

    def response_positions(self, which: list) -> int:
        return sum(int(self.chunks[k]["starts"][j + 1] - self.chunks[k]["starts"][j] - self.chunks[k]["prompt_lens"][j])
                   for k, j, _ in which)

    def window(self, k: int, j: int, seq_len: int, offset: int = 0) -> dict[str, torch.Tensor]:
        """One conversation's positions [offset, offset + seq_len). `response[p]`: the token after p is a
        response token (the positions drafting meets)."""
        c = self.chunks[k]
        a = int(c["starts"][j]) + offset
        b = min(int(c["starts"][j + 1]), a + seq_len)
        first_label = int(c["prompt_lens"][j]) - 1 - offset          # position whose next token starts the response
        pos = torch.arange(b - a)
        return {"tokens": torch.from_numpy(c["tokens"][a:b].astype(np.int64)),
                "features": torch.from_numpy(np.array(c["feats"][a:b])).view(torch.bfloat16),
                "normed": torch.from_numpy(np.array(c["normed"][a:b])).view(torch.bfloat16),
                "response": (pos >= first_label) & (pos < b - a - 1)}

    @staticmethod
    def pad(rows: list[dict]) -> dict[str, torch.Tensor]:
        """Windows zero-padded at the end to the longest (causal attention never looks at the padding;
        `response` is false there, so no loss counts it)."""
        width = max(len(r["tokens"]) for r in rows)
        def padded(x):
            return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, width - x.shape[0]))
        return {key: torch.stack([padded(r[key]) for r in rows]) for key in rows[0]}

    def stage_weights(self, which: list, weights: dict[int, float]) -> torch.Tensor:
        """Sampling weight per conversation: its stage's (1 for a stage not named)."""
        return torch.tensor([weights.get(int(self.chunks[k]["stage"][j]), 1.0) for k, j, _ in which])

    def batch(self, which: list, size: int, seq_len: int, gen: torch.Generator,
              weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`size` random training windows (drawn by `weights` when given): whole conversations, or a random
        cut of `seq_len` of longer ones."""
        rows = []
        picks = (torch.randint(len(which), (size,), generator=gen) if weights is None
                 else torch.multinomial(weights, size, replacement=True, generator=gen))
        for r in picks.tolist():
            k, j, _ = which[r]
            n = int(self.chunks[k]["starts"][j + 1] - self.chunks[k]["starts"][j])
            offset = int(torch.randint(n - seq_len + 1, (1,), generator=gen)) if n > seq_len else 0
            rows.append(self.window(k, j, seq_len, offset))
        return self.pad(rows)
