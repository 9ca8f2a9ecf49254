"""llama.cpp measured in the same run as dynchat: speeds differ between machines by up to 1.5x, so a
peer's figure taken elsewhere is not a measurement. `../shared/tools/llamacpp-peer` builds llama.cpp
and SmolLM2's GGUF files once; `bench` runs its `bench` before and after dynchat's runs (interleaved)
when it is built, and reports the ratios per weight format."""
from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

from .. import ROOT

# dynchat's weight formats and the llama.cpp files that hold the same weights
GGUF_OF = {"float32": "f32", "int8": "q8_0", "int4": "q4_1"}
log = logging.getLogger(__name__)


def peer_command() -> Path:
    return Path(os.environ.get("DYNCHAT_PEER", ROOT.parent / "shared" / "tools" / "llamacpp-peer"))


def peers_folder() -> Path:
    return Path(os.environ.get("DYNCHAT_PEERS", Path(os.environ.get("TMPDIR", "/tmp")) / "dynchat-peers"))


def peer_ready() -> bool:
    """The peer script exists and its build is done (else measuring it would first build for ~17 min)."""
    folder = peers_folder()
    return peer_command().exists() and (folder / "build" / "bin" / "llama-bench").exists() and \
        (folder / "smol-q8_0.gguf").exists()


def peer_file_mb(gguf: str) -> float | None:
    """MB of llama.cpp's file `gguf` (f32, q8_0, q4_1): what each of its tokens streams (SmolLM2's output
    head is its token embedding, stored once; the file's metadata adds ~1%); None where it is missing."""
    path = peers_folder() / f"smol-{gguf}.gguf"
    size = path.stat().st_size if path.exists() else 0
    return size / 1e6 if size else None


def parse_peer(text: str) -> dict:
    """{"tg128": {gguf: tokens/s}, "q8_0_forward_ms": {tokens: ms}} from `llamacpp-peer bench` output."""
    tg = {m: float(v) for m, v in re.findall(r"llama\.cpp (\w+) tg128: ([\d.]+) tokens/s", text)}
    forward = {int(k): float(ms) for k, ms in re.findall(r"k=(\d+) ([\d.]+) ms", text)}
    return {"tg128": tg, "q8_0_forward_ms": forward}


def run_peer(timeout: float = 600) -> dict:
    """One `llamacpp-peer bench`: the figures it printed. Its verify curve may fail where its tg runs
    did not (seen: llama-bench's prompt batches crash in ggml's AMX kernels on a Xeon VM); the bench
    then goes on with the tg figures. None printed at all: an error saying why."""
    out = subprocess.run([str(peer_command()), "bench"], capture_output=True, text=True, timeout=timeout)
    figures = parse_peer(out.stdout)
    if not figures["tg128"]:
        raise RuntimeError(f"llama.cpp's bench gave no figures (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    if out.returncode:
        log.warning("llama.cpp's bench stopped early (exit %d); kept its figures: %s", out.returncode,
                    ", ".join(f"{m} {v:.1f}" for m, v in figures["tg128"].items()))
    return figures


def merge_runs(runs: list[dict]) -> dict:
    """The mean of interleaved peer runs, figure by figure."""
    merged: dict = {"runs": len(runs)}
    for key in ("tg128", "q8_0_forward_ms"):
        names = {n for r in runs for n in r[key]}
        merged[key] = {n: sum(r[key][n] for r in runs if n in r[key]) / sum(n in r[key] for r in runs) for n in names}
    return merged


def peer_file(weights: str, stored_as: dict | None = None) -> str | None:
    """The llama.cpp file holding the weights dynchat ran: the GGUF blocks it multiplies (SmolLM2's
    layers are Q4_1 on the native route whatever the preset's dtype), else the preset's format."""
    formats = list(stored_as or {})
    if any(f.startswith("q4_1") for f in formats):
        return "q4_1"
    if any(f.startswith("q8_0") for f in formats):
        return "q8_0"
    return GGUF_OF.get(weights.split(" x ")[0])      # "int8 x int8 activations": int8 weights, Q8_0's peer


def compare(weights: str, decode_tokens_per_s: float | None, peer: dict, stored_as: dict | None = None,
            memory: dict | None = None) -> dict | None:
    """Plain decoding's decode-only tokens/s (what llama-bench tg counts) against llama.cpp's on the
    same weights; with `memory` (weight_mb: what our step streams, memory_read_gb_per_s: the machine's
    read rate measured in the run), llama.cpp's file streamed as a share of that rate, and the most
    plain decoding could reach over llama.cpp's at that rate (our weights read once a token at the
    memory's full pace)."""
    gguf = peer_file(weights, stored_as)
    theirs = peer.get("tg128", {}).get(gguf)
    if not theirs or not decode_tokens_per_s:
        return None
    versus = {"llama_cpp_file": gguf, "llama_cpp_tokens_per_s": theirs, "dynchat_tokens_per_s": decode_tokens_per_s,
              "ratio": decode_tokens_per_s / theirs}
    rate, file_mb = (memory or {}).get("memory_read_gb_per_s"), peer_file_mb(gguf)
    if rate and file_mb:
        versus["llama_cpp_share_of_memory_read"] = theirs * file_mb / 1e3 / rate
    if rate and (memory or {}).get("weight_mb"):
        versus["most_over_llama_cpp_at_this_memory"] = rate * 1e3 / memory["weight_mb"] / theirs
    return versus
