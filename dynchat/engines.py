"""The one way a preset gets its engine, for the app, the command line and the bench: vLLM's servers
for `engine: vllm` presets, else dynchat's in-process engine (which the app may put in a worker)."""
from __future__ import annotations

from .presets.config import Preset
from .presets.loading import ModelLoadError, load_engine


def open_engine(preset: Preset, **overrides):
    """A loaded engine for the preset, or ModelLoadError with one line. overrides (device, dtype,
    eagle3, quantization: the command line's) apply to the in-process engine; vLLM's servers take
    theirs from the preset's vllm: section, so they are refused there."""
    if preset.engine != "vllm":
        return load_engine(preset, **overrides)
    given = sorted(k for k, v in overrides.items() if v is not None)
    if given:
        raise ModelLoadError(f"preset {preset.name!r} serves through vLLM, which takes its settings from the "
                             f"preset's vllm: section, not {', '.join('--' + k for k in given)}")
    from .vllm.engine import VllmEngine
    from .vllm.server import VllmUnavailable

    try:
        return VllmEngine(preset)       # starts (or reaches) the servers
    except VllmUnavailable as e:
        raise ModelLoadError(str(e)) from None


def engine_from_flags(args):
    """The engine for the models the command line names (--preset, or --target and friends)."""
    from .presets.config import preset_from_flags

    return open_engine(preset_from_flags(args), device=args.device, dtype=args.dtype,
                       eagle3=getattr(args, "eagle3", None), quantization=getattr(args, "quantization", None))
