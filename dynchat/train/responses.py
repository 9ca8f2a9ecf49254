"""The target's own responses at scale, kept as token ids: what drafters train on and lookup drafts from.

`python -m dynchat prepare-responses --target SRC --out data/responses/smollm2` runs four stages, each
in shards written as they finish (an interrupted run, or one on a new machine with the committed
shards, resumes at the next shard):

  1. prompts: templated everyday requests and Magpie prompts (user turns the instruct model writes
     itself from its chat template, sampled);
  2. greedy responses to them;
  3. second-stage prompts built from those responses: two-turn follow-ups, and prompts that work on
     a given text (summarise, rewrite, extract, translate, fix this code), then their greedy responses;
  4. everyday prompts the target writes from a given opening ("How do I", "Write a short", "What is
     the difference between", ...): Magpie steered towards what people type, far more varied than
     the templates (whose few topics a held-out split shares, flattering held-out figures); greedy
     responses;
  5. sampled responses (temperature 0.7, top-p 0.95) to a share of all prompts.

Generation is batched through Transformers with a preallocated (static) KV cache, which streams the
weights once per step for the whole batch: on 2 cores, ~350-430 tokens/s at batch 64-128 against ~100
with a growing DynamicCache. Shards are `.npz` files of uint16/int32 token ids (a few MB for 20,000
responses); features for training are recomputed from them.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..engine.reply_shards import read_shard, write_shard
from ..presets.config import ROOT
from ..presets.sources import SMOLLM2
from .chat_data import FOLLOW_UPS, PARAGRAPHS, sample_tokens, template_prompts


@dataclass
class ResponsePlan:
    template_prompts: int = 5000
    magpie_prompts: int = 3000
    follow_ups: int = 3500
    text_work: int = 3500
    sampled: int = 5000
    everyday_prompts: int = 0        # stage 3: Magpie prompts from everyday openings
    temperature: float = 0.7
    max_new_tokens: int = 128
    batch_size: int = 128
    shard_size: int = 768
    seed: int = 0
    exclude: tuple[str, ...] = ()       # prompt texts never to use (the bench's held-out prompts)


TEXT_WORK = [
    "Summarize this in two sentences: {t}", "Summarize the following text: {t}", "What is the main idea of this? {t}",
    "Rewrite this more formally: {t}", "Rewrite this in simpler words: {t}", "Make this text shorter: {t}",
    "List the key points of this text: {t}", "Extract the facts in this text as a bulleted list: {t}",
    "Translate into French: {t}", "Translate into Spanish: {t}", "Fix the grammar and spelling: {t}",
    "Give this text a title: {t}", "Turn this into an email to a friend: {t}",
]
# Openings of everyday requests: the target completes each into a user turn (stage 3).
OPENINGS = [
    "How do I", "How can I", "How should I", "What is the best way to", "What are some ways to", "Give me tips for",
    "What should I do if", "Is it safe to", "Is it better to", "Can you help me", "Help me", "I want to", "I need to",
    "What is", "What are", "What does", "Why do", "Why is", "Why does", "Who was", "When did", "Where can I",
    "Explain", "Can you explain", "Explain to a child", "Tell me about", "What is the difference between",
    "Compare", "What are the pros and cons of", "What happens if", "How does", "How many", "Which is better,",
    "Write a short", "Write a poem about", "Write an email to", "Write a story about", "Write a letter",
    "Write a haiku about", "Write a product description for", "Write a tweet about", "Write a speech",
    "Give me ideas for", "Suggest a name for", "Suggest", "Recommend", "Plan a", "Make a list of", "List",
    "Give me a recipe for", "What can I cook with", "Create a workout plan", "Create a study plan for",
    "Write a Python function that", "Write a function in JavaScript that", "How do I fix this error:",
    "What does this code do:", "In Python, how do I", "What is the difference between a list and",
    "Write a SQL query that", "Explain recursion", "How do I sort", "Write a program that",
    "What is 15% of", "Calculate", "If I have", "A shop sells", "How long does it take to", "Convert",
    "Solve for x:", "What is the area of", "How much is",
    "Summarize this:", "Summarize the following paragraph:", "Rewrite this sentence:", "Correct the grammar:",
    "Make this more polite:", "Translate into French:", "Paraphrase this:", "Shorten this:",
    "What is the main idea of this text:", "Turn this into a list:",
    "Thank you! Can you also", "Can you give me an example of", "What do you think about", "Do you know",
]
CODE_WORK = ["Fix the bugs in this code:\n{t}", "Explain what this code does:\n{t}", "Add comments to this code:\n{t}",
             "Make this code shorter:\n{t}", "Write tests for this code:\n{t}"]


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new: int, temperature: float, eos: list[int],
                   gen: torch.Generator, top_p: float = 0.95) -> list[list[int]]:
    """New tokens for each left-padded prompt (EOS included when reached), one static cache per batch."""
    from transformers import StaticCache

    B, W = len(prompts), max(len(p) for p in prompts)
    L = W + max_new
    ids = torch.tensor([[eos[0]] * (W - len(p)) + list(p) for p in prompts])
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        mask[b, W - len(p):W] = 1
    positions = (mask[:, :W].cumsum(-1) - 1).clamp(min=0)
    cache = StaticCache(config=model.config, max_cache_len=L)
    out = model(input_ids=ids, attention_mask=mask[:, :W], position_ids=positions, cache=cache,
                cache_position=torch.arange(W), use_cache=True, logits_to_keep=1)
    position = positions[:, -1:] + 1
    eos_t = torch.tensor(eos)
    done = torch.zeros(B, dtype=torch.bool)
    new = torch.full((B, max_new), -1, dtype=torch.long)
    for s in range(max_new):
        nxt = sample_tokens(out.logits[:, -1], temperature, top_p, gen)
        new[:, s] = torch.where(done, -1, nxt)
        done |= torch.isin(nxt, eos_t)
        if s == max_new - 1 or bool(done.all()):
            break
        mask[:, W + s] = 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position, cache=cache,
                    cache_position=torch.tensor([W + s]), use_cache=True)
        position = position + 1
    return [[t for t in row if t >= 0] for row in new.tolist()]


class ResponseBuilder:
    def __init__(self, target_dir: Path, out: Path, plan: ResponsePlan):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.out, self.plan = out, plan
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = eos if isinstance(eos, list) else [eos]
        self.stats_file = out / "stats.json"
        self.stats = json.loads(self.stats_file.read_text()) if self.stats_file.exists() else {"shards": {}}
        self.stats["plan"] = {k: v for k, v in asdict(plan).items() if k != "exclude"}

    # -- prompts -----------------------------------------------------------------------------
    def _prompts_file(self, stage: int) -> Path:
        return self.out / f"prompts-{stage}.jsonl"

    def prompts(self, stage: int) -> list[list[dict]]:
        path = self._prompts_file(stage)
        return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]

    def _write_prompts(self, stage: int, chats: list[list[dict]]) -> None:
        tmp = self._prompts_file(stage).with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
        tmp.replace(self._prompts_file(stage))

    def _keep(self, text: str, seen: set[str]) -> bool:
        if text in seen or text in self.plan.exclude:
            return False
        seen.add(text)
        return True

    def first_prompts(self) -> None:
        """Stage-1 prompts: templates, then Magpie prompts in resumable parts."""
        if self._prompts_file(1).exists():
            return
        seen: set[str] = set()
        chats = [c for c in template_prompts(self.plan.template_prompts, self.plan.seed)
                 if self._keep(c[0]["content"], seen)]
        magpie = self._user_turns("magpie", self.plan.magpie_prompts, [""], 48, 1.0, (12, 300), seen)
        chats += [[{"role": "user", "content": t}] for t in magpie]
        random.Random(self.plan.seed).shuffle(chats)
        self._write_prompts(1, chats)

    def second_prompts(self) -> None:
        """Stage-2 prompts from stage-1 greedy responses: follow-ups and work on a given text."""
        if self._prompts_file(2).exists():
            return
        rng = random.Random(self.plan.seed + 2)
        first = self.prompts(1)
        answers = [(i, self.tokenizer.decode(r, skip_special_tokens=True).strip())
                   for i, r, _ in self._responses(1, 0.0)]
        answers = [(i, a) for i, a in answers if len(a) > 40]
        rng.shuffle(answers)
        chats: list[list[dict]] = []
        for i, a in answers[:self.plan.follow_ups]:
            chats.append(first[i] + [{"role": "assistant", "content": a}, {"role": "user", "content": rng.choice(FOLLOW_UPS)}])
        texts = [a for _, a in answers[self.plan.follow_ups:]] + PARAGRAPHS
        seen: set[str] = set()
        for text in texts:
            if len(chats) >= self.plan.follow_ups + self.plan.text_work:
                break
            code = re.search(r"```[a-z]*\n(.+?)```", text, re.S)
            if code:
                prompt = rng.choice(CODE_WORK).format(t=code.group(1).strip())
            else:
                words = text.split()
                prompt = rng.choice(TEXT_WORK).format(t=" ".join(words[:rng.randint(30, 90)]))
            if self._keep(prompt, seen):
                chats.append([{"role": "user", "content": prompt}])
        self._write_prompts(2, chats)

    def everyday_prompts(self) -> None:
        """Stage-3 prompts: the target completes everyday openings into user turns, in resumable parts."""
        have = self.prompts(3) if self._prompts_file(3).exists() else []
        if len(have) >= self.plan.everyday_prompts:
            return
        seen = {m[0]["content"] for i in (1, 2) if self._prompts_file(i).exists() for m in self.prompts(i)}
        texts = self._user_turns("everyday", self.plan.everyday_prompts, OPENINGS, 64, 0.95, (16, 400), seen)
        chats = [[{"role": "user", "content": t}] for t in texts]
        if chats[:len(have)] != have:     # responses on disk point into this list by index
            raise SystemExit(f"{self._prompts_file(3)} is not a prefix of the prompts its parts make now; "
                             "move it away to start stage 3 over")
        self._write_prompts(3, chats)

    def _user_turns(self, name: str, want: int, openings: list[str], max_new: int, top_p: float,
                    lengths: tuple[int, int], seen: set[str]) -> list[str]:
        """User turns the target writes itself (Magpie): its chat template up to a user turn, plus an
        opening picked per row, completed by sampling until the turn ends. Generated in parts of one
        batch (`<name>-NNN.json`) that a rerun reads back instead of generating again."""
        prefix = self.tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False)
        prefix = prefix[:prefix.index("X")]
        end = self._turn_end()
        texts: list[str] = []
        bar = tqdm(total=want, desc=f"{name} prompts")
        part, parts = 0, 20 * (1 + want // self.plan.batch_size)
        while len(texts) < want and part < parts:         # a model that never ends a turn stops here
            path = self.out / f"{name}-{part:03d}.json"
            if not path.exists():
                rng = random.Random(self.plan.seed * 1000 + part)
                starts = [rng.choice(openings) for _ in range(self.plan.batch_size)] if len(openings) > 1 else \
                    openings * self.plan.batch_size
                ids = [self.tokenizer(prefix + o, add_special_tokens=False)["input_ids"] for o in starts]
                gen = torch.Generator().manual_seed(self.plan.seed * 1000 + part)
                rows = generate_batch(self.model, ids, max_new, 1.0, [end], gen, top_p)
                path.write_text(json.dumps([(o + self.tokenizer.decode(r, skip_special_tokens=True)).strip()
                                            for o, r in zip(starts, rows) if r and r[-1] == end]))
            for text in json.loads(path.read_text()):
                if lengths[0] <= len(text) <= lengths[1] and self._keep(text, seen) and len(texts) < want:
                    texts.append(text)
                    bar.update()
            part += 1
        bar.close()
        return texts

    def _turn_end(self) -> int:
        """The token that closes a chat turn (ChatML's <|im_end|>, else the model's end of sequence)."""
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return end if isinstance(end, int) and end != self.tokenizer.unk_token_id else self.eos[0]

    # -- responses ---------------------------------------------------------------------------
    def _shards(self, stage: int, temperature: float) -> list[Path]:
        return sorted(self.out.glob(f"shard-s{stage}-t{temperature:g}-*.npz"))

    def _responses(self, stage: int, temperature: float):
        out = []
        for path in self._shards(stage, temperature):
            index, responses, _ = read_shard(path)
            out.extend((i, r, temperature) for i, r in zip(index, responses))
        return out

    def respond(self, stage: int, temperature: float, indices: list[int]) -> None:
        """Responses to the stage's prompts at `indices` that no shard on disk holds yet, in new shards
        of shard_size: a stopped run resumes and a grown prompt list only adds shards."""
        chats = self.prompts(stage)
        p = self.plan
        done = {i for i, _, _ in self._responses(stage, temperature)}
        todo = [i for i in indices if i not in done]
        first = len(self._shards(stage, temperature))
        bar = tqdm(total=len(indices), initial=len(indices) - len(todo), desc=f"stage {stage} T={temperature:g}",
                   unit="resp")
        for n, s in enumerate(range(0, len(todo), p.shard_size), start=first):
            path = self.out / f"shard-s{stage}-t{temperature:g}-{n:03d}.npz"
            part = todo[s:s + p.shard_size]
            encoded = [self.encode(chats[i]) for i in part]
            order = sorted(range(len(part)), key=lambda j: len(encoded[j]))
            results: list[list[int]] = [[] for _ in part]
            gen = torch.Generator().manual_seed(hash((p.seed, stage, temperature, n)) & 0xFFFFFFFF)
            t0, tokens = time.perf_counter(), 0
            for b in range(0, len(order), p.batch_size):
                idx = order[b:b + p.batch_size]
                rows = generate_batch(self.model, [encoded[j] for j in idx], p.max_new_tokens, temperature, self.eos, gen)
                for j, r in zip(idx, rows):
                    results[j] = r
                    tokens += len(r)
                bar.update(len(idx))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
            seconds = time.perf_counter() - t0
            write_shard(path, part, results, temperature, seconds)
            self.stats["shards"][path.name] = {"responses": len(part), "new_tokens": tokens, "seconds": round(seconds, 1),
                                               "tokens_per_s": round(tokens / seconds, 1),
                                               "threads": torch.get_num_threads()}
            self.stats_file.write_text(json.dumps(self.stats, indent=1) + "\n")
        bar.close()

    def encode(self, chat: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])

    def build(self) -> dict:
        p = self.plan
        self.first_prompts()
        n1 = len(self.prompts(1))
        self.respond(1, 0.0, list(range(n1)))
        self.everyday_prompts()
        n3 = len(self.prompts(3)) if self._prompts_file(3).exists() else 0
        self.respond(3, 0.0, list(range(n3)))
        self.second_prompts()
        n2 = len(self.prompts(2))
        self.respond(2, 0.0, list(range(n2)))
        for stage, picks in self.sampled_picks({1: n1, 2: n2, 3: n3}).items():
            self.respond(stage, p.temperature, picks)
        return self.summary()

    def sampled_picks(self, sizes: dict[int, int]) -> dict[int, list[int]]:
        """Which prompts get a sampled response: those that have one already, then the first others in
        a fixed hash order of (stage, index), up to plan.sampled. Growing any stage keeps every pick
        made before, so sampled shards on disk stay valid."""
        t = self.plan.temperature
        done = {(s, i) for s in sizes for i, _, _ in self._responses(s, t)}
        order = sorted(((s, i) for s, n in sizes.items() for i in range(n) if (s, i) not in done),
                       key=lambda si: hashlib.blake2b(f"{self.plan.seed}:{si[0]}:{si[1]}".encode(), digest_size=8).digest())
        picks = done | set(order[:max(0, self.plan.sampled - len(done))])
        return {s: sorted(i for st, i in picks if st == s) for s in sizes}

    def summary(self) -> dict:
        write_card(self.out)
        return card_figures(self.out)


PLAN_FLAGS = ("template_prompts", "magpie_prompts", "follow_ups", "text_work", "everyday_prompts", "sampled")
STAGE_NAMES = {"s1": "first-stage", "s2": "second-stage", "s3": "everyday (stage 3)"}


def card_figures(out: Path) -> dict:
    """Responses, new tokens and generation tokens/s over the folder's shards (from stats.json)."""
    stats = json.loads((out / "stats.json").read_text()) if (out / "stats.json").exists() else {"shards": {}}
    shards = stats["shards"].values()
    tokens, seconds = sum(s["new_tokens"] for s in shards), sum(s["seconds"] for s in shards)
    by_kind: dict[str, int] = {}
    for name, s in stats["shards"].items():
        stage, temperature = name.split("-")[1:3]
        how = "greedy" if temperature == "t0" else "T=" + temperature[1:]
        key = f"{STAGE_NAMES.get(stage, stage)} prompts, {how}"
        by_kind[key] = by_kind.get(key, 0) + s["responses"]
    return {"responses": sum(s["responses"] for s in shards), "new_tokens": tokens, "by_kind": by_kind,
            "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0, "plan": stats.get("plan", {}), "out": str(out)}


def write_card(out: Path) -> None:
    """README.md of a responses folder: what is in it, how fast it was made, the command that continues it."""
    f = card_figures(out)
    prompts = {i: len((out / f"prompts-{i}.jsonl").read_text().splitlines()) if (out / f"prompts-{i}.jsonl").exists()
               else 0 for i in (1, 2, 3)}
    plan = f["plan"]
    shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
    lines = ["# SmolLM2-135M-Instruct's own responses (token ids)", "",
             "Made by `python -m dynchat prepare-responses` (dynchat/train/responses.py): the target's greedy and sampled "
             "responses, up to 128 new tokens each, stored as token ids in `.npz` shards (`shard-s<stage>-t<temperature>-"
             "<n>.npz`); prompts in `prompts-1.jsonl` (templated everyday requests and Magpie prompts the target wrote) "
             "and `prompts-2.jsonl` (two-turn follow-ups and prompts that work on a given text, built from first-stage "
             "responses), `prompts-3.jsonl` (everyday requests the target wrote from given openings). The bench's "
             "held-out prompts are excluded. Lookup drafting indexes the greedy responses; trainers recompute features "
             "from them.", "",
             f"- prompts: {prompts[1]:,} first-stage, {prompts[2]:,} second-stage, {prompts[3]:,} everyday (stage 3)",
             f"- responses so far: {f['responses']:,} ({f['new_tokens']:,} new tokens)"]
    lines += [f"  - {k}: {v:,}" for k, v in f["by_kind"].items()]
    lines += [f"- generation: {f['tokens_per_s']} new tokens/s overall (batched, static KV cache, float32, "
              "2 CPU cores; per shard in `stats.json`)", "",
              "Continue or reproduce (resumes at the next missing shard):", "", "```bash",
              f"python -m dynchat prepare-responses --target {SMOLLM2} --out " + str(shown) +
              "".join(f" --{k.replace('_', '-')} {plan[k]}" for k in PLAN_FLAGS if k in plan), "```", ""]
    (out / "README.md").write_text("\n".join(lines))
