"""Native kernels dynchat builds itself: a C compiler turns the sources next to this file into one
shared library in DYNCHAT_CACHE/native once per source version, loaded through ctypes.

Only where it pays and is safe: x86 CPUs with AVX2 and FMA and a C compiler (`cc`); anywhere else,
or with DYNCHAT_NATIVE=0, `library()` is None: the int8 route uses PyTorch's kernels and ops,
lookup's search its numpy code (lookup.c gives the same drafts), and sampling PyTorch's operators
(sampling.c's warp is the same distribution, within float32's rounding).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name)
           for name in ("gemm.c", "int_dot.c", "decoder_layer.c", "lookup.c", "argmax.c", "spans.c", "sampling.c")]
# built for this CPU (AVX-512 where it has it); its flags are part of the library's name, so a cache
# shared with another kind of machine never loads a library built for instructions it lacks
# -ffp-contract=off: a multiply then an add stay two roundings where the source says so (the 4-bit
# weights are rebuilt exactly as GGUF dequantizes them); explicit fused multiply-adds stay fused
FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _cpu_has_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return " avx2" in flags and " fma" in flags and " f16c" in flags


def _build(out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc) found")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    r = subprocess.run([compiler, *FLAGS, *extra_flags, *map(str, SOURCES), "-o", str(tmp), "-lm"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"{compiler} failed: {r.stderr.strip()[-500:]}")
    tmp.replace(out)             # atomic: a concurrent process sees the whole library or none


@cache
def library() -> ctypes.CDLL | None:
    """The built library (int8_gemm, f32_gemm, q41_gemm, q80_gemm, q41x16_gemm, q80x16_gemm, eagle3_layer, eagle3_draft,
    decoder_layer, decoder_stack, lookup_scan, lookup_narrow, lookup_follow, lookup_candidate, argmax_rows,
    greedy_judge, warp_rows, draw_rows, sample_rows, walk_rows), or None where it cannot be
    built or is turned off."""
    if os.environ.get("DYNCHAT_NATIVE", "1") == "0" or not _cpu_has_avx2():
        return None
    from .. import cache_root

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()
                            + _cpu_flags().encode()).hexdigest()[:16]
    lib_path = cache_root() / "native" / f"dynchat-{digest}.so"
    try:
        if not lib_path.exists():
            _build(lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        log.warning("native kernels not built (%s); the int8 route uses PyTorch's kernels", e)
        return None
    return declared(lib)


def declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with its functions' argument and result types declared (a build of SOURCES)."""
    lib.int8_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    lib.int8_gemm.restype = None
    lib.f32_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.f32_gemm.restype = None
    lib.q41_gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    lib.q41_gemm.restype = None
    lib.q80_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
    lib.q80_gemm.restype = None
    lib.q41x16_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.q41x16_gemm.restype = None
    lib.q80x16_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.q80x16_gemm.restype = None
    lib.decoder_layer.restype = None
    lib.decoder_stack.restype = ctypes.c_int
    lib.eagle3_layer.restype = None
    lib.eagle3_draft.restype = ctypes.c_int
    ptr, long_, int_, double = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_double
    lib.lookup_scan.argtypes = [ptr, long_, long_, int_, ptr, ptr]
    lib.lookup_scan.restype = long_
    lib.lookup_narrow.argtypes = [ptr, ptr, long_, ptr, int_, ptr, ptr]
    lib.lookup_narrow.restype = int_
    lib.lookup_follow.argtypes = [ptr, long_, ptr, long_, int_, int_, double, int_, double, double, double, ptr, ptr]
    lib.lookup_follow.restype = int_
    lib.lookup_candidate.argtypes = [ptr, long_, ptr, long_, long_, ptr, ptr, long_, ptr, long_, ptr, ptr, ptr, ptr]
    lib.lookup_candidate.restype = int_
    lib.argmax_rows.argtypes = [ptr, long_, long_, ptr]
    lib.argmax_rows.restype = None
    lib.greedy_judge.argtypes = [ptr, long_, long_, ptr, ptr]
    lib.greedy_judge.restype = None
    lib.warp_rows.argtypes = [ptr, long_, long_, double, double, ptr]
    lib.warp_rows.restype = int_
    lib.draw_rows.argtypes = [ptr, long_, long_, ptr, ptr]
    lib.draw_rows.restype = None
    lib.sample_rows.argtypes = [ptr, long_, long_, double, double, ptr, ptr]
    lib.sample_rows.restype = int_
    lib.walk_rows.argtypes = [ptr, long_, long_, ptr, ptr, ptr, double, double, double, ptr]
    lib.walk_rows.restype = int_
    return lib


def _wrap(fn):
    """A ctypes matmul fn(x, w, [scale, [mins,]] y, M, N, K) as a call on tensors returning a new y (M, N)."""
    def gemm(x: torch.Tensor, w: torch.Tensor, *scale: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        y = torch.empty(m, w.shape[0], dtype=torch.float32)
        fn(x.data_ptr(), w.data_ptr(), *(s.data_ptr() for s in scale), y.data_ptr(), m, w.shape[0], k)
        return y

    return gemm


def _kernel(name: str):
    """The library's matmul `name` as a call on tensors, or None where the library is not built."""
    lib = library()
    return None if lib is None else _wrap(getattr(lib, name))


@cache
def int8_gemm():
    """fn(x float32 (M, K) contiguous, w int8 (N, K), scale float32 (N,)) -> y float32 (M, N), or None."""
    return _kernel("int8_gemm")


@cache
def f32_gemm():
    """fn(x float32 (M, K) contiguous, w float32 (N, K) contiguous, K % 16 == 0) -> y float32 (M, N), or None."""
    return _kernel("f32_gemm")


@cache
def q41_gemm():
    """fn(x float32 (M, K), nibbles uint8 (N, K/2), d, m float32 (N, K/32)) -> y (M, N): GGUF Q4_1 weights, or None."""
    return _kernel("q41_gemm")


@cache
def q80_gemm():
    """fn(x float32 (M, K), q int8 (N, K), d float32 (N, K/32)) -> y (M, N): GGUF Q8_0 weights, or None."""
    return _kernel("q80_gemm")


def _packed_kernel(name: str):
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)

    def gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        fn(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k)
        return y

    return gemm


@cache
def q41x16_gemm():
    """fn(x float32 (M, K), packed uint8 (N / 16, K / 32, 320), N) -> y (M, N): Q4_1 weights in integer
    dot products with x rounded to int8 per block (linear.q41_packed), or None."""
    return _packed_kernel("q41x16_gemm")


@cache
def q80x16_gemm():
    """fn(x float32 (M, K), packed uint8 (N / 16, K / 32, 544), N) -> y (M, N): Q8_0 weights the same
    way (linear.q80_packed), or None."""
    return _packed_kernel("q80x16_gemm")


def _float_rows_on_cpu(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (n, V) -> (n,) int64: torch.argmax(logits, -1), the same index on ties and NaN, through
    argmax.c where the library is built and the logits are float32 rows on the CPU (a greedy round's
    choice: torch's took three times as long as this between the loop's forwards)."""
    lib = library()
    if lib is None or not _float_rows_on_cpu(logits):
        return logits.argmax(-1)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def greedy_judge(draft_tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """k drafts against k + 1 logits rows -> (k + 2,) int64: how many leading drafts equal the target's
    argmax, then the argmax of each row; in one call where argmax.c applies (torch's five small
    operators took ~40 us a round between the loop's forwards), else in torch on the logits' device."""
    lib, k = library(), draft_tokens.numel()
    if lib is None or not _float_rows_on_cpu(logits) or draft_tokens.device.type != "cpu":
        row = logits.argmax(-1)
        mismatch = (row[:k] != draft_tokens).int()
        return torch.cat([torch.cat([mismatch, mismatch.new_ones(1)]).argmax().view(1), row])
    drafts = draft_tokens.to(torch.long).contiguous()
    out = torch.empty(k + 2, dtype=torch.long)
    lib.greedy_judge(logits.data_ptr(), k, logits.shape[1], drafts.data_ptr(), out.data_ptr())
    return out


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor | None:
    """logits (n, V) -> (n, V) float32 probabilities: softmax(logits / temperature) with the top-p cut made and
    renormalised (Sampler.probs without top-k), through sampling.c; None where it does not apply (no
    library, not float32 rows on the CPU, no buffer for the nucleus's candidates). A row with a NaN or
    without a finite largest logit has no distribution: ValueError."""
    lib = library()
    if lib is None or not _float_rows_on_cpu(logits):
        return None
    out = torch.empty_like(logits)
    made = lib.warp_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], temperature, top_p, out.data_ptr())
    _refuse(made)
    return None if made else out


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """probs (n, V), u (n,) float64 in (0, 1] -> (n,) int64: each row's first token whose cumulative sum
    reaches u times the row's sum (never one of probability 0), through sampling.c; None where it does
    not apply."""
    lib = library()
    if lib is None or not _float_rows_on_cpu(probs):
        return None
    u = u.to(torch.float64).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.long)
    lib.draw_rows(probs.data_ptr(), probs.shape[0], probs.shape[1], u.data_ptr(), out.data_ptr())
    return out


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor | None:
    """logits (n, V) -> (n,) int64: draw(warp(logits, temperature, top_p), u) in one call of sampling.c,
    u = 1 - a float64 uniform from `generator` a row (as Sampler.sample draws it): the same tokens; None,
    with nothing drawn from the generator, where it does not apply."""
    lib = library()
    if lib is None or not _float_rows_on_cpu(logits):
        return None
    rand = torch.rand(logits.shape[0], dtype=torch.float64, generator=generator)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    made = lib.sample_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], temperature, top_p, rand.data_ptr(),
                           out.data_ptr())
    _refuse(made, "sample_rows")
    return out


def walk(logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, u: torch.Tensor,
         temperature: float, top_p: float, generator: torch.Generator) -> tuple[int, int] | None:
    """Sampled verification of k drafts (Sampler.walk) in one call of sampling.c: logits (k + 1, V), the
    drafts, their distributions (k, V) or None (deterministic drafts), u (k,) float32 uniforms -> (drafts
    accepted, the target's token after them), the token drawn at 1 - a float64 uniform from `generator`
    (as Sampler.sample draws it); None, with nothing drawn, where it does not apply. A draft that is not
    one of the V tokens: IndexError."""
    lib, k, V = library(), draft_tokens.numel(), logits.shape[-1]
    if lib is None or not _float_rows_on_cpu(logits) or logits.shape[0] != k + 1 or draft_tokens.device.type != "cpu":
        return None
    if draft_probs is not None and (draft_probs.shape != (k, V) or not _float_rows_on_cpu(draft_probs)):
        return None
    drafts, u = draft_tokens.to(torch.long).contiguous(), u.to(torch.float32).contiguous()
    rand = float(torch.rand(1, dtype=torch.float64, generator=generator))
    out = torch.empty(2, dtype=torch.long)
    made = lib.walk_rows(logits.data_ptr(), k, V, drafts.data_ptr(), None if draft_probs is None else draft_probs.data_ptr(),
                         u.data_ptr(), rand, temperature, top_p, out.data_ptr())
    _refuse(made, "walk_rows")
    n, token = out.tolist()
    return n, token


def _refuse(made: int, out_of_memory: str | None = None) -> None:
    """sampling.c's answer for a row without a distribution (a NaN logit, or no finite largest one), or a
    draft that is not a token (as PyTorch's indexing says it): an error, not a token drawn from nothing;
    with `out_of_memory` (the function's name) any other failure too, where the caller has no fallback."""
    if made == -3:
        raise ValueError("a logits row with a NaN or without a finite largest value has no distribution to sample")
    if made == -2:
        raise IndexError("a drafted token is not a token of the logits' vocabulary")
    if made and out_of_memory:
        raise MemoryError(f"{out_of_memory}: out of memory")
