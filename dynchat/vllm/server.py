"""vLLM's OpenAI-compatible server for a preset: started in vLLM's own virtual environment, or reached at a URL.

dynchat schedules no users itself: a preset with `engine: vllm` hands its requests to vLLM, which
batches them continuously, shards big models (tensor / pipeline parallel, several nodes through Ray)
and runs EAGLE-3 and draft-model speculation. vLLM fixes the speculative setup per server, so each
mode of a preset is one server: plain decoding (the baseline), EAGLE-3, the draft model.

vLLM pins its own torch and transformers, so it lives in its own venv (scripts/install-vllm.sh,
default .venv-vllm; DYNCHAT_VLLM_PYTHON names another interpreter). This module knows nothing of
chats or Gradio (torch only tells it whether a GPU is there): it builds command lines, starts and
watches processes, and waits for health.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from ..presets.config import ROOT, Preset

TCMALLOC = "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"   # Debian's libtcmalloc-minimal4, as vLLM's CPU build asks
START_TIMEOUT_S = float(os.environ.get("DYNCHAT_VLLM_START_TIMEOUT", "600"))
INSTALL_HINT = "install it with `bash scripts/install-vllm.sh`"

# Runs a server and takes its whole process group (API server, engine core, workers) down as soon
# as the process that started it is gone, however it went (SIGTERM, SIGKILL, a crash): a server is
# never left orphaned. The app's own stop() signals the group; this shell ignores that and exits
# with the server. Linux (/proc), as vLLM is.
GUARD = r"""
app=$1; shift
"$@" &
server=$!
trap '' TERM INT
while kill -0 "$server" 2>/dev/null; do
  read -r -a stat < /proc/$$/stat
  if [ "${stat[3]}" != "$app" ]; then
    kill -TERM -- -$$ 2>/dev/null
    for _ in $(seq 30); do kill -0 "$server" 2>/dev/null || break; sleep 1; done
    kill -KILL -- -$$
  fi
  sleep 1
done
wait "$server"
"""


class VllmUnavailable(RuntimeError):
    """vLLM is missing, would not start, or went away: one line for the user."""


def vllm_python() -> Path:
    return Path(os.environ.get("DYNCHAT_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    """One vLLM server: the target, and the speculation it runs (None: plain decoding)."""
    mode: str                                   # baseline | eagle3 | assistant
    model: str                                  # a local folder vLLM loads
    name: str                                   # served model name
    dtype: str = "auto"
    device: str = "cpu"                         # cpu | cuda
    speculative: dict | None = None             # vLLM's --speculative-config
    options: dict = field(default_factory=dict)  # the preset's vllm: section

    def args(self, port: int) -> list[str]:
        o = self.options
        args = ["-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--served-model-name", self.name,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
                "--generation-config", "vllm",            # the request's sampling, not the model's defaults
                "--max-model-len", str(o.get("max_model_len", 1024)),
                "--tensor-parallel-size", str(o.get("tensor_parallel_size", 1)),
                "--pipeline-parallel-size", str(o.get("pipeline_parallel_size", 1))]
        if o.get("distributed_executor_backend"):
            args += ["--distributed-executor-backend", str(o["distributed_executor_backend"])]
        if o.get("enforce_eager", self.device == "cpu"):     # compiling on a small CPU takes minutes
            args.append("--enforce-eager")
        if self.speculative:
            args += ["--speculative-config", json.dumps(self.speculative),
                     "--per-request-spec-decode-metrics", "detailed"]
        return args + [str(a) for a in o.get("extra_args", [])]

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.options.get("kv_cache_gb", 1)))
            # the libraries vLLM's CPU build asks to preload: tcmalloc (Debian's) and Intel OpenMP (its venv's)
            iomp = vllm_python().parent.parent / "lib" / "libiomp5.so"
            preload = [p for p in (TCMALLOC, str(iomp)) if Path(p).exists() and p not in env.get("LD_PRELOAD", "")]
            env["LD_PRELOAD"] = ":".join(filter(None, [*preload, env.get("LD_PRELOAD")]))
        env.update({k: str(v) for k, v in (self.options.get("env") or {}).items()})
        return env


class VllmServer:
    """A server dynchat started (and stops), or one it only connects to (url given)."""

    def __init__(self, spec: ServerSpec, url: str | None = None):
        self.spec, self.proc, self.log_path = spec, None, None
        self.url = url.rstrip("/") if url else None
        self.model_name = spec.name          # a server reached by URL serves its own name (read when ready)

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    def start(self) -> None:
        """Launch the process (returns at once; wait_ready() waits)."""
        if self.url:
            return
        python = vllm_python()
        if not python.exists():
            raise VllmUnavailable(f"vLLM is not installed ({python} does not exist); {INSTALL_HINT}")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile("wb", prefix=f"dynchat-vllm-{self.spec.name}-{self.spec.mode}-",
                                          suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.proc = subprocess.Popen(["bash", "-c", GUARD, "dynchat-vllm-guard", str(os.getpid()), str(python),
                                      *self.spec.args(port)], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.spec.env(), start_new_session=True)
        log.close()
        STARTED.add(self)

    def log_tail(self, lines: int = 3) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        useful = [t.strip() for t in text if t.strip() and not t.startswith((" ", "\t"))]
        return " | ".join(useful[-lines:])[-400:]

    def alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S, progress: tqdm | None = None) -> None:
        """Poll /health until the server answers; one clear line if it exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise VllmUnavailable(f"vLLM server for {self.spec.mode} exited with code {self.proc.returncode} "
                                      f"while starting: {self.log_tail()} (log: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    if not self.started_here:
                        self.model_name = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]["id"]
                    return
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                where = f"log: {self.log_path}" if self.log_path else f"at {self.url}"
                raise VllmUnavailable(f"vLLM server for {self.spec.mode} did not answer within {timeout:.0f} s ({where})")
            if progress is not None and progress.postfix != self.spec.mode:
                progress.set_postfix_str(self.spec.mode)
            time.sleep(1.0)

    def stop(self) -> None:
        STARTED.discard(self)
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass


STARTED: set[VllmServer] = set()     # servers this process started and has not stopped yet


@atexit.register
def stop_started() -> None:
    """Stop every server this process started: at exit, and when the app is told to stop."""
    for server in list(STARTED):
        server.stop()


def start_all(servers: list[VllmServer]) -> None:
    """Start every server at once (they load in parallel), then wait for each, with a progress bar."""
    with tqdm(total=len(servers), desc="starting vLLM servers", unit="server", mininterval=10) as bar:
        try:
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready(progress=bar)
                bar.update(1)
        except BaseException:
            for s in servers:
                s.stop()
            raise


def preset_device(preset: Preset) -> str:
    if preset.device.startswith("cuda"):
        return "cuda"
    if preset.device == "auto":
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"
    return "cpu"
