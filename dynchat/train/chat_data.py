"""Everyday chat data for a real target: prompts, the target's own responses, and its features.

Prompts come two ways: templates of everyday requests (knowledge, how-to, writing, coding,
arithmetic, summaries, rewrites, and multi-turn follow-ups), and the Magpie method (the instruct
model writes the user turn of its own chat template). Responses are generated in batches; while
they are generated, forward hooks keep what an EAGLE-3 head trains on, for every position: the
inputs of the three feature layers and the final normed hidden state (the target's distribution
is recomputed from it over the draft vocabulary), so training never runs the target again.
Shards are written as they finish: an interrupted run resumes at the next shard.
"""
from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from .features import captured_states

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "volcanoes", "vaccines",
    "the internet", "climate change", "the Roman Empire", "electric cars", "honey bees", "the human heart",
    "earthquakes", "the moon landing", "solar panels", "democracy", "inflation", "the immune system",
    "coral reefs", "the printing press", "gravity", "rainbows", "the stock market", "recycling", "dinosaurs",
    "the Great Wall of China", "sleep", "coffee", "the Olympic Games", "tides", "electricity", "DNA",
    "the Renaissance", "hurricanes", "antibiotics", "the Amazon rainforest", "airplanes", "music theory",
    "nutrition", "the solar system", "machine learning", "renewable energy", "ancient Egypt", "bread baking",
    "the periodic table", "glaciers", "the Industrial Revolution", "compound interest", "meditation", "bicycles",
]
TASKS = [
    "make a cup of tea", "start running", "save money each month", "write a good resume", "learn a new language",
    "plant tomatoes", "prepare for a job interview", "fall asleep faster", "clean a laptop keyboard",
    "organize my closet", "study for an exam", "make pancakes", "change a flat tire", "reduce stress",
    "keep a houseplant alive", "back up my phone", "give a short speech", "train a puppy", "cook rice",
    "stay focused while working from home", "plan a birthday party", "write a thank-you note", "learn to swim",
    "budget for a vacation", "improve my handwriting", "make new friends in a new city", "brew coffee",
]
WRITING = [
    "a short poem about {t}", "a haiku about {t}", "a two-sentence story about {t}", "a friendly email inviting a "
    "colleague to lunch", "a product description for a reusable water bottle", "a short speech for a friend's "
    "wedding", "a tweet about {t}", "a limerick about a cat", "an opening line for a mystery novel",
    "a short motivational message for a student", "a birthday message for my grandmother", "a slogan for a bakery",
    "a short paragraph about {t} for children", "a polite complaint about a late delivery",
]
CODE = [
    "Write a Python function that reverses a string.", "Write a Python function to check if a number is prime.",
    "How do I read a file line by line in Python?", "Write a function that returns the largest number in a list.",
    "Explain what a for loop does in Python.", "Write a JavaScript function that adds two numbers.",
    "How do I sort a list of dictionaries by a key in Python?", "What is the difference between a list and a tuple?",
    "Write a SQL query that selects all users older than 30.", "Write a Python function that counts the vowels in a "
    "word.", "How do I make an HTTP request in Python?", "What is recursion? Give a short example.",
    "Write a Python function to compute the factorial of n.", "Explain what a variable is in programming.",
    "Write a function that checks whether a string is a palindrome.", "What does git commit do?",
    "How do I create a dictionary in Python?", "Write a Python class for a bank account with deposit and withdraw.",
    "What is an API?", "Write a bash command that counts the lines in a file.",
]
PARAGRAPHS = [
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, a playground and "
    "better lighting. The council agreed to fund the playground this year and the lighting next year.",
    "Regular exercise improves mood, strengthens the heart and helps people sleep better. Experts recommend at "
    "least 150 minutes of moderate activity each week, such as brisk walking or cycling.",
    "Our team finished the project two weeks early. We reduced costs by reusing old parts, and customers said "
    "the new design is easier to use. Next quarter we will focus on faster delivery.",
    "Bees pollinate many of the crops we eat. Their numbers have fallen because of pesticides, disease and loss "
    "of habitat. Planting flowers and avoiding sprays in gardens can help them.",
    "The museum will be closed on Monday for cleaning. Tickets bought for that day can be used any other day "
    "this month. The cafe and gift shop will stay open as usual.",
    "I tried the new restaurant downtown last night. The soup was excellent, but the main course was cold and "
    "the service was slow. I might go back for lunch to give it another chance.",
]
SENTENCES = [
    "me and him goes to the store yesterday", "The meeting has been moved to Friday because of the holiday.",
    "I can't come to work today because I am sick.", "Please send me the report as soon as possible.",
    "The weather is really bad and I don't want to go outside.", "This phone is very good and cheap.",
    "We are happy to tell you that your order has shipped.", "Their going to the beach tomorrow if its sunny.",
]
FOLLOW_UPS = [
    "Can you explain that more simply?", "Give me an example.", "Can you make it shorter?", "Why is that?",
    "Thanks! Can you tell me more?", "What is the most important point?", "Can you say that in one sentence?",
    "Can you give me three tips?",
]


def template_prompts(n: int, seed: int = 0) -> list[list[dict]]:
    """Everyday single-turn requests from templates, as chat messages."""
    rng = random.Random(seed)
    def pick(options):
        return rng.choice(options)

    def knowledge():
        lead = pick(["What is", "Tell me about", "Explain", "Can you explain", "What do you know about",
                     "Give me a short overview of"])
        return f"{lead} {pick(TOPICS)}{pick(['?', '.', ' in simple terms.', ' to a ten-year-old.'])}"

    def how_to():
        return f"{pick(['How do I', 'How can I', 'What is the best way to', 'Give me tips to'])} {pick(TASKS)}?"

    def writing():
        return f"{pick(['Write', 'Please write', 'Can you write'])} {pick(WRITING).format(t=pick(TOPICS))}."

    def summary():
        lead = pick(["Summarize this:", "Summarize the following text in one sentence:", "Give me the main point of this:",
                     "TL;DR:"])
        return f"{lead} {pick(PARAGRAPHS)}"

    def rewrite():
        lead = pick(["Rewrite this sentence more formally:", "Fix the grammar:", "Make this sound friendlier:",
                     "Translate to simple English:", "Paraphrase:"])
        return f"{lead} {pick(SENTENCES)}"

    def facts():
        lead = pick(["What are the pros and cons of", "Why is", "What are three facts about", "Who invented",
                     "What is the history of"])
        return f"{lead} {pick(TOPICS)}?"

    makers = [knowledge, how_to, writing, lambda: pick(CODE), lambda: _arithmetic(rng), summary, rewrite, facts]
    seen, out = set(), []
    while len(out) < n:
        text = rng.choice(makers)()
        if text not in seen:
            seen.add(text)
            out.append([{"role": "user", "content": text}])
        if len(seen) > 50 * n:
            break
    return out


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return rng.choice([
        f"What is {a} + {b}?", f"What is {a} times {b}?", f"What is {a * b} divided by {b}?",
        f"If I have {a} apples and give away {min(a, b)}, how many are left?",
        f"A shirt costs ${a}. How much do {b % 9 + 2} shirts cost?", f"What is {a}% of {b * 10}?",
        f"Is {a} an even number?", f"What is {a} minus {b}?",
    ])


@torch.no_grad()
def magpie_prompts(model, tokenizer, n: int, batch: int = 64, max_tokens: int = 48, seed: int = 0) -> list[list[dict]]:
    """User turns written by the instruct model itself (Magpie): its chat template up to `user\\n`, sampled."""
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False)
    prefix = prefix[:prefix.index("X")]
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out, seen = [], set()
    bar = tqdm(total=n, desc="magpie prompts")
    while len(out) < n:
        seqs = _generate(model, [ids] * batch, max_tokens, 1.0, [end], gen, capture=None)
        for s in seqs:
            text = tokenizer.decode(s["tokens"][len(ids):], skip_special_tokens=True).strip()
            if s["tokens"][-1] == end and 12 <= len(text) <= 300 and text not in seen:
                seen.add(text)
                out.append([{"role": "user", "content": text}])
                bar.update()
    bar.close()
    return out[:n]


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator,
                  head: int = 1024) -> torch.Tensor:
    """Temperature and nucleus (top-p) sampling for a batch of rows. The nucleus is found among each
    row's `head` most likely tokens when they hold more than top_p of the mass (almost always): a
    sort over the whole vocabulary costs ~30x more on the CPU. Rows whose nucleus is wider fall back
    to the full sort, so the distribution is the exact nucleus either way."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    if top_p >= 1.0:                      # no nucleus: no sort over the vocabulary
        return torch.multinomial(probs, 1, generator=gen)[:, 0]
    top, order = probs.topk(min(head, probs.shape[-1]), -1)
    wide = top[:, :-1].sum(-1) <= top_p             # the nucleus may reach past the head
    any_wide = bool(wide.any())
    if any_wide:
        sorted_p, full = probs[wide].sort(-1, descending=True)
        picked = full.gather(-1, _nucleus_pick(sorted_p, top_p, gen))[:, 0]
    out = order.gather(-1, _nucleus_pick(top, top_p, gen))[:, 0]
    if any_wide:
        out[wide] = picked
    return out


def _nucleus_pick(sorted_p: torch.Tensor, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Column index sampled from descending probabilities kept while the mass before them <= top_p."""
    drop = sorted_p.cumsum(-1) - sorted_p > top_p
    return torch.multinomial(sorted_p.masked_fill(drop, 0), 1, generator=gen)


@torch.no_grad()
def _generate(model, prompts: list[list[int]], max_new: int, temperature: float, eos: list[int],
              gen: torch.Generator, capture: list[int] | None, top_p: float = 0.95) -> list[dict]:
    """Left-padded batch generation with a DynamicCache; with `capture`, keep per-position features
    (inputs of those layers, concatenated) and the final normed hidden state, in bfloat16."""
    from transformers import DynamicCache

    B, W = len(prompts), max(len(p) for p in prompts)
    pad = eos[0]
    ids = torch.tensor([[pad] * (W - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (W - len(p)) + [1] * len(p) for p in prompts])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    kept: dict[str, list] = {"f": [], "n": []}
    with captured_states(model, capture) if capture else contextlib.nullcontext({}) as grabbed:
        cache = DynamicCache(config=model.config)
        tokens = [list(p) for p in prompts]
        done = [False] * B
        fed = [len(p) for p in prompts]          # tokens of each row that went through the model
        step_ids, step_pos = ids, pos
        for step in range(max_new + 1):
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, cache=cache,
                        use_cache=True, logits_to_keep=1)
            if capture:
                kept["f"].append(torch.cat([grabbed[i] for i in capture], -1).to(torch.bfloat16))
                kept["n"].append(grabbed["norm"].to(torch.bfloat16))
            if step == max_new or all(done):
                break
            nxt = sample_tokens(out.logits[:, -1], temperature, top_p, gen)
            for b in range(B):
                if not done[b]:
                    tokens[b].append(int(nxt[b]))
                    fed[b] += 1
                    done[b] = int(nxt[b]) in eos
            step_ids = nxt[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype)], -1)
    result = []
    feats = torch.cat(kept["f"], 1) if capture else None
    normed = torch.cat(kept["n"], 1) if capture else None
    for b in range(B):
        item = {"tokens": tokens[b]}
        if capture:
            n_fed = min(fed[b], feats.shape[1] - (W - len(prompts[b])))
            start = W - len(prompts[b])
            item["tokens"] = tokens[b][:n_fed]
            item["features"] = feats[b, start:start + n_fed].clone()
            item["normed"] = normed[b, start:start + n_fed].clone()
            item["prompt_len"] = len(prompts[b])
        result.append(item)
    return result


def build(target_dir: Path, work: Path, n_template: int, n_magpie: int, n_follow_up: int,
          temperatures: dict[float, int], max_new: int = 128, batch: int = 64, shard_size: int = 256,
          seed: int = 0) -> list[Path]:
    """Prompts (cached in work/prompts.jsonl) and shards of responses with features.

    temperatures: {temperature: number of prompts answered at it (0 = all)}; 0 means greedy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..engine.eagle3_head import default_layer_ids

    work.mkdir(parents=True, exist_ok=True)
    (work / "build.json").write_text(json.dumps({
        "template_prompts": n_template, "magpie_prompts": n_magpie, "follow_ups": n_follow_up,
        "temperatures": {f"{t:g}": c for t, c in temperatures.items()}, "response_tokens": max_new, "seed": seed}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    gen = torch.Generator().manual_seed(seed)
    prompts_file = work / "prompts.jsonl"
    if prompts_file.exists():
        chats = [json.loads(line)["messages"] for line in prompts_file.read_text().splitlines() if line.strip()]
    else:
        chats = template_prompts(n_template, seed) + magpie_prompts(model, tokenizer, n_magpie, batch, seed=seed)
        chats += _follow_ups(model, tokenizer, random.Random(seed).sample(chats, min(n_follow_up, len(chats))),
                             eos, gen, max_new)
        random.Random(seed).shuffle(chats)
        prompts_file.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    encoded = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for c in chats]
    layers = default_layer_ids(model.config.num_hidden_layers)
    shards = []
    for t, count in temperatures.items():
        limit = min(count or len(encoded), len(encoded))
        for s in range(0, limit, shard_size):
            path = work / f"shard-t{t:g}-{s // shard_size:03d}.pt"
            shards.append(path)
            if path.exists():
                continue
            part = encoded[s:min(s + shard_size, limit)]
            order = sorted(range(len(part)), key=lambda i: len(part[i]))
            items = [None] * len(part)
            for b in tqdm(range(0, len(order), batch), desc=f"responses T={t:g} shard {s // shard_size}"):
                idx = order[b:b + batch]
                for i, item in zip(idx, _generate(model, [part[i] for i in idx], max_new, t, eos, gen, layers)):
                    items[i] = item
            tmp = path.with_suffix(".tmp")
            torch.save({"temperature": t, "layers": layers, "prompt_index": list(range(s, s + len(part))),
                        "items": items}, tmp)
            tmp.replace(path)
    return shards


def prepare_command(target: str, work: Path) -> str:
    """The prepare-chat-data command that made a work dir (from its build.json)."""
    if not (work / "build.json").exists():
        return f"{work}: made by prepare-chat-data (its settings were not recorded)"
    b = json.loads((work / "build.json").read_text())
    sampled = [(t, c) for t, c in b["temperatures"].items() if float(t) > 0]
    cmd = (f"python -m dynchat prepare-chat-data --target {target} --work-dir {work} --template-prompts "
           f"{b['template_prompts']} --magpie-prompts {b['magpie_prompts']} --follow-ups {b['follow_ups']} "
           f"--seed {b['seed']}")
    if sampled:
        cmd += f" --sampled-prompts {sampled[0][1]} --temperature {sampled[0][0]}"
    return cmd + ("" if b["response_tokens"] == 128 else f" --response-tokens {b['response_tokens']}")


def _follow_ups(model, tokenizer, chats, eos, gen, max_new) -> list[list[dict]]:
    """Two-turn chats: the target's greedy answer to a prompt, then a follow-up question."""
    rng = random.Random(1)
    encoded = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]) for c in chats]
    out = []
    for b in tqdm(range(0, len(chats), 32), desc="first turns for follow-ups"):
        part = list(range(b, min(b + 32, len(chats))))
        for i, item in zip(part, _generate(model, [encoded[i] for i in part], max_new, 0.0, eos, gen, None)):
            answer = tokenizer.decode(item["tokens"][len(encoded[i]):], skip_special_tokens=True).strip()
            out.append(chats[i] + [{"role": "assistant", "content": answer},
                                   {"role": "user", "content": rng.choice(FOLLOW_UPS)}])
    return out


def load_shards(works: list[Path]) -> tuple[list[dict], int, list[int]]:
    """All sequences of all shards of the work dirs (each with its temperature, its prompt index, numbered
    across dirs, and `heldout` by prompt), the prompt count, the feature layers."""
    items, offset, layers = [], 0, None
    for work in works:
        paths = sorted(work.glob("shard-t*.pt"))
        if not paths:
            raise ValueError(f"{work}: no shard-t*.pt files (run prepare-chat-data first)")
        top = 0
        for path in paths:
            shard = torch.load(path, weights_only=False)
            if layers is not None and shard["layers"] != layers:
                raise ValueError(f"{path}: features of layers {shard['layers']}, other shards hold {layers}")
            layers = shard["layers"]
            for index, item in zip(shard["prompt_index"], shard["items"]):
                items.append({**item, "temperature": shard["temperature"], "prompt_index": offset + index,
                              "local_index": index})
                top = max(top, index + 1)
        offset += top
    return items, offset, layers


def split(items: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out): every `every`-th prompt of each work dir is held out, at all temperatures."""
    held = [it for it in items if it["local_index"] % every == every - 1]
    return [it for it in items if it["local_index"] % every != every - 1], held


def pack(items: list[dict], seq_len: int, eos: int) -> dict[str, torch.Tensor]:
    """Concatenate sequences into one stream and cut it into windows of seq_len positions.

    `response[p]` is true where the token after position p belongs to a response: the positions a
    drafter is asked about."""
    if not items:
        return {"tokens": torch.zeros(0, seq_len, dtype=torch.long), "features": torch.zeros(0, seq_len, 0),
                "normed": torch.zeros(0, seq_len, 0), "response": torch.zeros(0, seq_len, dtype=torch.bool)}
    tokens = torch.cat([torch.tensor(it["tokens"]) for it in items])
    feats = torch.cat([it["features"] for it in items])
    normed = torch.cat([it["normed"] for it in items])
    response = torch.cat([torch.arange(len(it["tokens"])) >= it.get("prompt_len", 1) - 1 for it in items])
    n = len(tokens) // seq_len
    cut = n * seq_len
    return {"tokens": tokens[:cut].view(n, seq_len), "features": feats[:cut].view(n, seq_len, -1),
            "normed": normed[:cut].view(n, seq_len, -1), "response": response[:cut].view(n, seq_len)}
