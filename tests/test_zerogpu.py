"""ZeroGPU runs each GPU call in a process forked from the app's, after the app has loaded and warmed
its models: a turn run that way answers, and Stop pressed in the app's process reaches it."""
from __future__ import annotations

import json
import os
import select
import time

import pytest

from dynchat.app.chat import ChatService
from dynchat.app.store import Store
from dynchat.app.turns import Settings

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

from conftest import ROOT  # noqa: E402

# a bench prompt the demo target answers at length (it runs to any cap we tried)
LONG = next(json.loads(line)["prompt"] for line in (ROOT / "data" / "bench_prompts.jsonl").read_text().splitlines()
            if "There are two subtleties" in line)


def _in_child(fn):
    """Run fn() in a forked child; returns (pipe to read its messages from, its pid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                       # the child: as ZeroGPU's worker for one call
        code = 0
        try:
            fn(lambda text: os.write(w, (text + "\n").encode()))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, f"error {type(e).__name__}: {e}\n".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return r, pid


def _read_line(fd, timeout: float) -> str:
    out = b""
    deadline = time.monotonic() + timeout
    while not out.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"no answer from the forked call within {timeout} s (got {out!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            break
        out += chunk
    return out.decode().strip()


@pytest.fixture(params=[False, True], ids=["warmed-in-app", "warmed-in-call"])
def service(tmp_path, request):
    """As on ZeroGPU: models in the app's process; warmed there, or (ZeroGPU's default) in each call."""
    svc = ChatService(Store(tmp_path / "log.db"), engine_process=False, warm_in_call=request.param)
    svc.engine("demo")
    if not request.param:   # a turn in the app's process first: the engine thread then exists there
        assert list(svc.turn("warm", [], "Hi", Settings(preset="demo", mode="eagle3", max_new_tokens=8)))[-1].status == "ok"
    return svc


def test_a_turn_in_a_forked_call_answers(service):
    def call(say):
        last = list(service.turn("s1", [], "What does json.dumps do?",
                                 Settings(preset="demo", mode="eagle3", max_new_tokens=24)))[-1]
        say(f"{last.status} {len(last.reply)}")

    fd, pid = _in_child(call)
    status = _read_line(fd, 60)
    os.waitpid(pid, 0)
    assert status.startswith("ok ") and int(status.split()[1]) > 0, status


def test_stop_pressed_in_the_app_reaches_the_forked_call(service):
    def call(say):
        said = False
        for update in service.turn("s2", [], LONG, Settings(preset="demo", mode="baseline", max_new_tokens=1000,
                                                             compare=False)):
            if not said and update.reply:
                say("streaming")
                said = True
        say(update.status)

    fd, pid = _in_child(call)
    assert _read_line(fd, 60) == "streaming"
    service.stop("s2")                       # the Stop button's handler runs in the app's process
    status = _read_line(fd, 60)
    os.waitpid(pid, 0)
    assert status == "cancelled"
