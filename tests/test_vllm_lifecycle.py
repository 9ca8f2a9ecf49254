"""vLLM presets everywhere: the command line serves them through vLLM as the app does, and the
servers dynchat starts end with it: on SIGTERM, on Ctrl-C, on a normal exit, and when the app is
killed outright (each server runs under a guard that watches the process that started it).

The servers here are tests/fake_vllm.py (a stand-in that speaks the same HTTP and starts an
"engine core" child, as vLLM does), so these run without vLLM installed."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT

from dynchat.vllm.server import free_port

pytestmark = pytest.mark.slow
SERVERS = 3            # demo-vllm: baseline, EAGLE-3, assistant


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"     # a zombie has ended
    except (FileNotFoundError, IndexError):
        return False


def server_pids(folder: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in folder.iterdir()]


@pytest.fixture
def fake_vllm(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nexec {sys.executable} {ROOT / "tests" / "fake_vllm.py"} "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "DYNCHAT_VLLM_PYTHON": str(python), "FAKE_VLLM_PIDS": str(pids),
           "DYNCHAT_PRESET": "demo-vllm", "DYNCHAT_DB": str(tmp_path / "log.db"),
           "GRADIO_SERVER_PORT": str(free_port())}
    yield pids, env
    for pid in server_pids(pids):       # whatever a failed test left
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def start(cmd: list[str], env: dict, ready: str) -> subprocess.Popen:
    """Start the app (or a script) and wait until it prints `ready` with its servers up."""
    # Ctrl-C as from a terminal: a suite started in the background (`cmd &`) hands its children SIGINT
    # ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = threading.Event()
    out: list[str] = []

    def read():
        for line in proc.stdout:
            out.append(line)
            if ready in line:
                seen.set()

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(180), f"{ready!r} never came; output: {''.join(out)[-2000:]}"
    proc.output = out
    return proc


def assert_all_end(pids: Path, within: float) -> None:
    started = server_pids(pids)
    assert len(started) == 2 * SERVERS, started
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(running(p) for p in started):
        time.sleep(0.5)
    assert not [p for p in started if running(p)], "vLLM server processes outlived the app"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_servers_end_with_the_app_on_a_signal(fake_vllm, sig):
    pids, env = fake_vllm
    app = start([sys.executable, "app.py"], env, "Running on")
    app.send_signal(sig)
    assert app.wait(30) in (0, 130, -sig), "".join(app.output)[-2000:]
    assert_all_end(pids, within=10)
    assert "Traceback" not in "".join(app.output)


def test_servers_end_with_a_normal_exit(fake_vllm, tmp_path):
    pids, env = fake_vllm
    script = ("from dynchat.app.chat import ChatService; from dynchat.app.store import Store; "
              f"s = ChatService(Store({str(tmp_path / 'x.db')!r}), engine_process=False); "
              "print('modes', s.engine('demo-vllm').modes, flush=True)")
    proc = start([sys.executable, "-c", script], env, "modes")
    assert proc.wait(30) == 0
    assert_all_end(pids, within=10)


def test_servers_end_even_when_the_app_is_killed(fake_vllm):
    pids, env = fake_vllm
    app = start([sys.executable, "app.py"], env, "Running on")
    app.kill()
    app.wait(10)
    assert_all_end(pids, within=40)


def test_the_command_line_serves_a_vllm_preset_through_vllm(fake_vllm):
    pids, env = fake_vllm
    r = subprocess.run([sys.executable, "-m", "dynchat", "generate", "--preset", "demo-vllm", "--mode", "baseline",
                        "--prompt", "Hello there, how are you", "--json", "--raw"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stats"]["new_tokens"] == 4            # the stand-in server echoes four prompt tokens
    assert_all_end(pids, within=10)                   # served by vLLM servers, stopped on exit


def test_the_engine_bench_says_how_to_measure_a_vllm_preset(fake_vllm):
    pids, env = fake_vllm
    r = subprocess.run([sys.executable, "-m", "dynchat", "bench", "--preset", "demo-vllm"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--concurrency" in r.stderr and "Traceback" not in r.stderr
    assert not list(pids.iterdir())            # said before any server started
