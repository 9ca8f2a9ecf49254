"""A preset served by vLLM, behind the same interface as the in-process Engine.

The chat (chat.py) builds prompt ids with the preset's tokenizer, as for any engine; the decoder
sends them to vLLM's /v1/completions as token ids and streams the reply back as RoundEvents and a
Summary. Each streamed chunk is one engine step of this request (prefill, then one verification per
chunk), so the live figures count a chunk's tokens but its last as accepted drafts. The final figures
are vLLM's own per-request metrics (`--per-request-spec-decode-metrics detailed`), trimmed to the
tokens the reply kept: vLLM always drafts k tokens and counts those its last step accepted past
the end of the reply (after EOS or max_tokens), which dynchat's loop neither drafts nor counts.
Where a server has no per-request metrics, deltas of its /metrics counters around the request stand
in, flagged `shared` when other requests ran meanwhile.

Requests run concurrently: vLLM batches them, so this engine takes no lock.
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..engine.events import RoundEvent, Summary
from ..engine.sampling import SamplingParams
from ..presets.config import Preset
from ..presets.loading import ModelLoadError, load_tokenizer, local_source
from ..presets.runtime import TokenizedPreset
from .server import ServerSpec, VllmServer, VllmUnavailable, preset_device, start_all

COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total", "vllm:num_requests_running")


MAX_CONCURRENT = 256
# vLLM's CPU worker busy-polls for a second after its last step (shm_broadcast's busy_loop_s); on a
# small CPU the servers of one preset share cores, so a request right after another server's ran
# slower (measured: time to first token 0.06 -> 0.5-1.0 s). Requests wait this long after another
# server's last request, so speculative and plain replies are measured with the other servers idle.
QUIET_AFTER_S = 1.1


class VllmRequestError(ValueError):
    """vLLM refused a request (HTTP 4xx): its message, for the user."""


@dataclass
class VllmLookahead:
    """What sizes vLLM's drafts: a fixed number of speculative tokens per server."""
    k: int

    def describe(self) -> str:
        return f"vLLM num_speculative_tokens={self.k}"


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> {counter: value summed over label sets} for the counters dynchat reads."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def trim_to_reply(per_step_accepted: list[int], new_tokens: int) -> list[int]:
    """Accepted drafts per step, less those past the end of the reply.

    A reply of n tokens from s verification steps holds n - 1 - s accepted drafts (the prefill and
    each step add one token of the target's own); vLLM's last step may report more.
    """
    acc = list(per_step_accepted)
    excess = sum(acc) - max(new_tokens - 1 - len(acc), 0)
    for i in range(len(acc) - 1, -1, -1):
        if excess <= 0:
            break
        cut = min(excess, acc[i])
        acc[i] -= cut
        excess -= cut
    return acc


class VllmEngine(TokenizedPreset):
    """What ChatService needs of an Engine, served by one vLLM server per mode."""
    serves_concurrently = True

    def __init__(self, preset: Preset):
        self.preset = preset
        self.lock = threading.BoundedSemaphore(MAX_CONCURRENT)     # vLLM batches: no turn waits for another
        opts = preset.vllm
        self.device = preset_device(preset)
        target = local_source("target", preset.target)
        self.tokenizer = load_tokenizer("target", target)
        self.eos_token_ids = self._eos_ids(target)
        self.context_length = int(opts.get("max_model_len", 1024))
        dtype = preset.dtype if preset.dtype != "auto" else ("bfloat16" if self.device == "cuda" else "float32")
        self.weights = f"{dtype} (vLLM)"
        gen, urls = preset.generation, opts.get("urls") or {}
        self.k = {"eagle3": int(opts.get("num_speculative_tokens", gen.get("eagle3_num_draft_tokens", 4))),
                  "assistant": int(opts.get("num_speculative_tokens", gen.get("num_draft_tokens", 3)))}
        specs = {}
        if opts.get("baseline", True) or "baseline" in urls:
            specs["baseline"] = None
        if preset.eagle3:
            specs["eagle3"] = {"method": "eagle3", "model": local_source("EAGLE-3 head", preset.eagle3),
                               "num_speculative_tokens": self.k["eagle3"]}
        if preset.assistant:
            draft = preset.assistant if "assistant" in urls else self._draft_folder(target)
            specs["assistant"] = {"method": "draft_model", "model": draft,
                                  "num_speculative_tokens": self.k["assistant"]}
        self.last_request_end: dict[str, float] = {}
        self._quiet = threading.Lock()
        self.servers = {mode: VllmServer(ServerSpec(mode, target, preset.name, dtype, self.device, spec, opts),
                                         urls.get(mode)) for mode, spec in specs.items()}
        start_all(list(self.servers.values()))
        self.modes = list(self.servers)

    def _draft_folder(self, target: str) -> str:
        from .models import vllm_ready_draft

        folder = local_source("assistant", self.preset.assistant)
        try:
            return vllm_ready_draft(folder, target, self.device)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"the assistant {folder!r} cannot be prepared for vLLM: {e}") from None

    def _eos_ids(self, target: str) -> list[int]:
        ids = {self.tokenizer.eos_token_id} - {None}
        gen = Path(target) / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return sorted(ids)

    def wait_for_quiet(self, mode: str) -> None:
        """On a CPU, let the other servers' workers stop polling first (see QUIET_AFTER_S)."""
        if self.device != "cpu":
            return
        with self._quiet:
            others = [t for m, t in self.last_request_end.items() if m != mode]
        wait = max(others, default=0.0) + QUIET_AFTER_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def request_ended(self, mode: str) -> None:
        with self._quiet:
            self.last_request_end[mode] = time.monotonic()

    def policy(self, mode: str, name: str | None = None, k: int | None = None, tree="preset"):
        return VllmLookahead(self.k[mode]) if mode in self.k and mode in self.modes else None

    @property
    def tree(self):
        return None                       # vLLM drafts chains here

    def decoder(self, mode: str, tree=None) -> VllmDecoder:
        """tree: as for the in-process engine; vLLM drafts chains only."""
        if tree is not None and tree != "preset":
            raise ValueError("vLLM drafts EAGLE-3 chains here, not trees; use --eagle3-drafting chain")
        self.require_mode(mode)
        return VllmDecoder(self, mode)

    def warm_up(self) -> None:
        ids = self.encode("Hello")
        for mode in self.modes:
            for _ in self.decoder(mode).generate(ids, 4):
                pass

    def close(self) -> None:
        for s in self.servers.values():
            s.stop()


class VllmDecoder:
    def __init__(self, engine: VllmEngine, mode: str):
        self.engine, self.mode = engine, mode
        self.server = engine.servers[mode]

    def _body(self, ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> dict:
        e = self.engine
        body = {"model": self.server.model_name, "prompt": list(ids), "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, "skip_special_tokens": False,
                "max_tokens": max(1, min(max_new_tokens, e.context_length - len(ids))),
                "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                "stop_token_ids": e.eos_token_ids}
        if sampling.top_k:
            body["top_k"] = int(sampling.top_k)
        if sampling.seed is not None:
            body["seed"] = int(sampling.seed)
        return body

    def _counters(self) -> dict[str, float] | None:
        try:
            return parse_counters(httpx.get(f"{self.server.url}/metrics", timeout=5).text)
        except httpx.HTTPError:
            return None

    def generate(self, prompt_ids, max_new_tokens, sampling: SamplingParams = SamplingParams(), policy=None, stop=None,
                 max_reuse=None, session=None):
        """Stream one reply from vLLM as RoundEvents, then a Summary (see the module doc). vLLM caches
        prefixes itself (max_reuse and session do not apply)."""
        speculative = self.mode != "baseline"
        k = self.engine.k.get(self.mode, 0)
        self.engine.wait_for_quiet(self.mode)
        # counters are the fallback for servers without per-request metrics (those dynchat starts have them)
        before = self._counters() if speculative and not self.server.started_here else None
        summary, tokens, metrics, finish = Summary(), [], None, ""
        t0 = last = time.perf_counter()
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=self._body(prompt_ids, max_new_tokens, sampling),
                              timeout=httpx.Timeout(600, connect=10)) as r:
                if r.status_code >= 400:
                    raise VllmRequestError(self._error_text(r))
                for line in r.iter_lines():
                    if stop is not None and stop.is_set():
                        finish = "stopped"             # leaving the stream aborts the request in vLLM
                        break
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        raise VllmRequestError(str(chunk["error"].get("message", chunk["error"]))[:300])
                    if chunk.get("metrics"):
                        metrics = chunk["metrics"]
                    for choice in chunk.get("choices") or []:
                        new = choice.get("token_ids") or []
                        finish = choice.get("finish_reason") or finish
                        if not new:
                            continue
                        now = time.perf_counter()
                        first = not tokens
                        drafted = k if speculative and not first else 0
                        accepted = min(len(new) - 1, drafted)
                        tokens += new
                        yield RoundEvent(new, [True] * accepted + [False] * (len(new) - accepted), drafted, accepted,
                                         k, 0.0, now - last, now - t0)
                        if first:
                            summary.ttft_s = now - t0
                        last = now
        except httpx.HTTPError as e:
            alive = self.server.alive()
            raise VllmUnavailable(f"the vLLM server for {self.mode} at {self.server.url} "
                                  f"{'failed the request' if alive else 'went away'} ({type(e).__name__})") from None
        finally:
            self.engine.request_ended(self.mode)
        summary.wall_s = time.perf_counter() - t0
        summary.new_tokens = len(tokens)
        summary.finish_reason = {"stop": "eos", "length": "length", "stopped": "stopped"}.get(finish, finish or "eos")
        if speculative:
            self._acceptance(summary, (metrics or {}).get("speculative_decoding"), before, k)
        else:
            summary.target_forwards = len(tokens)
        yield summary

    def _acceptance(self, summary: Summary, sd: dict | None, before: dict | None, k: int) -> None:
        if sd and "per_step_accepted" in sd:
            for drafted, accepted in zip(sd["per_step_drafted"], trim_to_reply(sd["per_step_accepted"], summary.new_tokens)):
                summary.record_round(drafted, accepted)
            summary.target_forwards = 1 + sd["num_spec_steps"]
            return
        after = self._counters()
        if before is None or after is None:
            return
        delta = {c: after[c] - before[c] for c in COUNTERS[:3]}
        summary.draft_rounds = int(delta[COUNTERS[0]])
        summary.draft_tokens = int(delta[COUNTERS[1]])
        summary.accepted_tokens = int(delta[COUNTERS[2]])
        summary.target_forwards = 1 + summary.draft_rounds
        # other requests ran meanwhile: the figure is theirs as much as this one's
        summary.shared = before[COUNTERS[3]] > 0 or after[COUNTERS[3]] > 0 or summary.draft_rounds > summary.new_tokens

    @staticmethod
    def _error_text(r: httpx.Response) -> str:
        try:
            r.read()
            err = r.json().get("error") or {}
            return str(err.get("message") if isinstance(err, dict) else err)[:300] or f"HTTP {r.status_code}"
        except (ValueError, httpx.HTTPError):
            return f"HTTP {r.status_code}"
