"""Tokenizer and token streams for the demo models."""
from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def read_items(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def render(item: dict) -> str:
    """One corpus item as the text the model is trained on (chats through the chat template)."""
    if "messages" in item:
        return "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in item["messages"]) + "<|endoftext|>"
    return item["text"] + "<|endoftext|>"


def train_tokenizer(items: list[dict], vocab_size: int, out_dir: Path):
    """Byte-level BPE with the chat special tokens, saved in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True,
    )
    tok.train_from_iterator((render(it) for it in items), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>", pad_token="<|endoftext|>",
        unk_token=None, additional_special_tokens=SPECIAL_TOKENS[1:4],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def token_stream(items: list[dict], tokenizer) -> torch.Tensor:
    """All items tokenised and concatenated (documents separated by <|endoftext|>)."""
    ids: list[int] = []
    for it in items:
        ids.extend(tokenizer(render(it), add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.int32)


def batches(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless random windows of seq_len+1 tokens (inputs and shifted labels)."""
    n = stream.numel() - seq_len - 1
    while True:
        starts = torch.randint(0, n, (batch_size,), generator=generator)
        win = torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()]).long()
        yield win[:, :-1], win[:, 1:]


def fixed_windows(stream: torch.Tensor, seq_len: int, limit: int) -> list[torch.Tensor]:
    """Non-overlapping evaluation windows, deterministic."""
    n = min(limit, (stream.numel() - 1) // (seq_len + 1))
    return [stream[i * (seq_len + 1):(i + 1) * (seq_len + 1)].long() for i in range(n)]
