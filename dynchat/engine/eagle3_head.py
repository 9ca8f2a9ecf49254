"""The EAGLE-3 draft head: one decoder layer that reads the target's own hidden states.

Module and state-dict names follow the published checkpoints (SafeAILab/EAGLE, SpecForge), so
public heads such as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B load unchanged:
`fc.weight`, `midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
hidden_norm, input_layernorm, post_attention_layernorm}.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`, and optionally `embed_tokens.weight` (else the target's
embedding is shared). The config is Llama-style with `num_hidden_layers: 1` and
`draft_vocab_size`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .layer import output_and_mlp

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class HeadMismatch(ValueError):
    """The head was trained for another target: the message names the numbers that disagree."""


def default_layer_ids(num_layers: int) -> list[int]:
    """Layers whose *inputs* are captured: low, middle, high (EAGLE-3 / vLLM convention)."""
    return [2, num_layers // 2, num_layers - 3]


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embedding ; hidden] input."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Eagle3Head(nn.Module):
    """Parameters and the pieces of the forward shared by the trainer and the drafter.

    Per position t: fc(target features g_t) (or the head's own pre-norm output when drafting
    ahead) and the embedding of token x_{t+1} go in; logits for x_{t+2} over the draft
    vocabulary come out. Draft id i means target id i + d2t[i].
    """

    def __init__(self, config: LlamaConfig, own_embedding: bool = True):
        super().__init__()
        cfg = config
        if getattr(cfg, "head_dim", None) is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.config = cfg
        self.target_hidden_size = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
        self.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.fc = nn.Linear(3 * self.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, self.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if self.draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.shared_embedding: torch.Tensor | None = None     # the target's, when the head has none

    def _apply(self, fn, recurse=True):
        """Casts leave the rotary frequencies in float32: in bfloat16 they are ~0.4% off, a phase error
        that grows with the position (about a radian 500 tokens apart). Moves still move them."""
        freq = self.rotary_emb.inv_freq
        out = super()._apply(fn, recurse)
        self.rotary_emb.inv_freq = freq.to(self.rotary_emb.inv_freq.device, torch.float32)
        return out

    # -- pieces of the forward (batched: x is (..., n, ·)) ------------------------------------
    def embedding(self) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens.weight
        if self.shared_embedding is None:
            raise RuntimeError("this head shares the target's embedding: call head.share_embedding(target) first")
        return self.shared_embedding

    def share_embedding(self, target) -> None:
        if self.embed_tokens is None:    # a plain tensor: not a parameter of the head, never saved with it
            self.shared_embedding = target.get_input_embeddings().weight.detach()

    def layer_input(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embed(x_{t+1})) ; hidden_norm(h_t)], width 2H."""
        layer = self.midlayer
        emb = F.embedding(tokens, self.embedding()).to(hidden.dtype)
        return torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)

    def after_attention(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual (the hidden input), then the MLP block: the pre-norm output."""
        layer, mlp = self.midlayer, self.midlayer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        return output_and_mlp(hidden, attn_out, F.linear, layer.self_attn.o_proj.weight, gate_up, mlp.down_proj.weight,
                              layer.post_attention_layernorm.weight, self.config.rms_norm_eps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def restrict_vocabulary(self, target_ids: torch.Tensor) -> Eagle3Head:
        """A copy drafting only `target_ids` (a subset of this head's draft vocabulary): the same
        weights, fewer lm_head rows. On a CPU the lm_head is most of a draft step's bytes, and the
        tokens dropped are ones the target rarely emits (the published heads keep 32k of 128k)."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long).unique(sorted=True)
        row = self._draft_rows()
        if len(target_ids) == 0 or bool((row[target_ids] < 0).any()):
            raise ValueError("the restricted vocabulary must be a non-empty subset of the head's draft vocabulary")
        return self._with_vocabulary(target_ids, self.lm_head.weight[row[target_ids]])

    def extend_vocabulary(self, target_ids: torch.Tensor, output_embedding: torch.Tensor) -> Eagle3Head:
        """A copy drafting `target_ids` (a superset of this head's draft vocabulary), the new tokens' lm_head
        rows taken from the target's output embedding (`output_embedding`, vocab x hidden): a head trained
        with lm_head frozen at the target's rows scores them as it scores its own, and a target token
        outside the draft vocabulary is one no chain can ever be right about (SmolLM2's 4,096 covered 90%
        of its bench replies' tokens)."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long).unique(sorted=True)
        row = self._draft_rows()
        if not bool(torch.isin(torch.nonzero(row >= 0).flatten(), target_ids).all()):
            raise ValueError("the extended vocabulary must hold the head's whole draft vocabulary")
        if output_embedding.shape != (self.config.vocab_size, self.lm_head.weight.shape[1]):
            raise ValueError(f"the output embedding is {tuple(output_embedding.shape)}, the head needs "
                             f"({self.config.vocab_size}, {self.lm_head.weight.shape[1]})")
        rows = output_embedding.detach().to(self.lm_head.weight)[target_ids]
        mine = row[target_ids] >= 0
        rows[mine] = self.lm_head.weight.detach()[row[target_ids][mine]]    # its own rows, as trained
        return self._with_vocabulary(target_ids, rows)

    def widen_mlp(self, intermediate_size: int, seed: int = 0) -> Eagle3Head:
        """A copy whose MLP is `intermediate_size` wide, computing what this head computes: the new units'
        gate and up rows start random (spread as this head's are), their down columns at zero, so
        training starts from this head's outputs and grows the new units from there (a trained head
        short of capacity need not start over)."""
        mlp = self.midlayer.mlp
        old = mlp.gate_proj.weight.shape[0]
        if intermediate_size < old:
            raise ValueError(f"the head's MLP is {old} wide: it can be widened, not narrowed to {intermediate_size}")
        state = self._state()
        gen = torch.Generator().manual_seed(seed)
        extra = intermediate_size - old
        for name in ("gate_proj", "up_proj"):
            w = state[f"midlayer.mlp.{name}.weight"]
            fresh = torch.randn(extra, w.shape[1], generator=gen) * float(w.float().std())
            state[f"midlayer.mlp.{name}.weight"] = torch.cat([w, fresh.to(w)])
        down = state["midlayer.mlp.down_proj.weight"]
        state["midlayer.mlp.down_proj.weight"] = torch.cat([down, down.new_zeros(down.shape[0], extra)], dim=1)
        return self._copy(state, intermediate_size=intermediate_size)

    def _draft_rows(self) -> torch.Tensor:
        """Per target id, its row of the draft vocabulary, or -1."""
        current = self.to_target_ids(torch.arange(self.draft_vocab_size, device=self.d2t.device))
        row = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        row[current] = torch.arange(self.draft_vocab_size, device=self.d2t.device)
        return row

    def _with_vocabulary(self, target_ids: torch.Tensor, lm_rows: torch.Tensor) -> Eagle3Head:
        """A copy with these sorted draft ids and lm_head rows; every other weight the same."""
        state = self._state()
        state["lm_head.weight"] = lm_rows
        state["d2t"] = target_ids - torch.arange(len(target_ids), device=target_ids.device)
        state["t2d"] = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        state["t2d"][target_ids.cpu()] = True
        return self._copy(state, draft_vocab_size=len(target_ids))

    def _state(self) -> dict[str, torch.Tensor]:
        """The weights a copy starts from (the rotary frequencies are the config's, rebuilt)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}

    def _copy(self, state: dict[str, torch.Tensor], **config_changes) -> Eagle3Head:
        """A head of this one's config with config_changes, holding `state`, on this head's device and dtype."""
        import copy

        config = copy.deepcopy(self.config)
        for key, value in config_changes.items():
            setattr(config, key, value)
        head = Eagle3Head(config, own_embedding=self.embed_tokens is not None)
        head.load_state_dict(state, strict=False)
        head.shared_embedding = self.shared_embedding
        return head.to(self.fc.weight.device, self.fc.weight.dtype).eval()

    # -- checks -------------------------------------------------------------------------------
    def layer_ids(self, target_layers: int) -> list[int]:
        ids = None
        eagle = getattr(self.config, "eagle_config", None)
        if isinstance(eagle, dict):
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return list(ids) if ids else default_layer_ids(target_layers)

    def check_target(self, target) -> list[int]:
        """Raise HeadMismatch naming what disagrees; return the layer ids to capture."""
        cfg = target.config
        problems = []
        if self.target_hidden_size != cfg.hidden_size:
            problems.append(f"the head reads hidden size {self.target_hidden_size}, the target has {cfg.hidden_size}")
        vocab = target.get_input_embeddings().weight.shape[0]
        if self.config.vocab_size != vocab:
            problems.append(f"the head's vocabulary has {self.config.vocab_size} tokens, the target's {vocab}")
        if self.embed_tokens is None and cfg.hidden_size != self.config.hidden_size:
            problems.append(f"the head shares the target's embedding but its hidden size is {self.config.hidden_size}, "
                            f"the target's {cfg.hidden_size}")
        n = cfg.num_hidden_layers
        ids = self.layer_ids(n)
        if len(ids) != 3:
            problems.append(f"the head needs 3 feature layers, its config lists {len(ids)}")
        elif n < 7 and not getattr(self.config, "eagle_config", None):
            problems.append(f"the target has {n} layers; EAGLE-3 needs at least 7 for three distinct feature layers")
        elif any(not 0 <= i < n for i in ids):
            problems.append(f"feature layers {ids} are outside the target's {n} layers")
        if problems:
            raise HeadMismatch("this EAGLE-3 head does not fit the target: " + "; ".join(problems))
        return ids

    # -- published checkpoint format ----------------------------------------------------------
    def save_pretrained(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                   draft_vocab_size=self.draft_vocab_size, target_hidden_size=self.target_hidden_size,
                   dtype=str(self.fc.weight.dtype).removeprefix("torch."))
        (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        save_file(state, str(folder / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, source: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head:
        folder = _local_folder(str(source))
        raw = json.loads((folder / "config.json").read_text())
        state = _read_state(folder)
        config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "dtype")})
        config.num_hidden_layers = 1
        head = cls(config, own_embedding="embed_tokens.weight" in state)
        if "d2t" not in state and head.draft_vocab_size != config.vocab_size:
            raise HeadMismatch(f"{source}: a reduced draft vocabulary ({head.draft_vocab_size} of {config.vocab_size}) "
                               "needs the `d2t` mapping, which the checkpoint lacks")
        state = {k: v for k, v in state.items() if not k.startswith("rotary_emb.")}
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in ("d2t", "t2d") and not k.startswith("rotary_emb.")]
        if missing or unexpected:
            raise HeadMismatch(f"{source}: not an EAGLE-3 checkpoint (missing {missing[:4]}, unexpected {unexpected[:4]})")
        return head.to(dtype).eval()


def _local_folder(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, allow_patterns=["config.json", *WEIGHT_FILES]))


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder}: no {' or '.join(WEIGHT_FILES)}")
