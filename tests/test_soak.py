"""A long-running Space stays bounded: 1,000 chats through the app's API, and the app's memory
(its process and the engine worker) after the last is within 50 MB of after the first hundred.

Per-chat state (lookahead policies, stop flags, CSV files) is kept for the newest DYNCHAT_MAX_CHATS
chats; the test sets it to 100, so 900 chats are evicted on the way."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT

from dynchat.vllm.server import free_port

pytestmark = pytest.mark.slow
CHATS, KEPT = 1000, 100
MODES = ("baseline", "lookup", "assistant", "eagle3")


def resident_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, StopIteration):
            pass
    return total


def test_a_thousand_chats_leave_memory_bounded(tmp_path):
    from gradio_client import Client

    port = free_port()
    env = {**os.environ, "DYNCHAT_PRESET": "demo", "DYNCHAT_DB": str(tmp_path / "soak.db"), "TMPDIR": str(tmp_path),
           "GRADIO_SERVER_PORT": str(port), "DYNCHAT_MAX_CHATS": str(KEPT)}
    app = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()
    threading.Thread(target=lambda: [ready.set() for line in app.stdout if "Running on" in line], daemon=True).start()
    try:
        assert ready.wait(300), "the app did not start"
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        after_100 = None
        for i in range(CHATS):
            out = client.predict(message=f"What does str.split do? ({i})", history=[], client_id=f"soak-{i}",
                                 preset="demo", mode=MODES[i % len(MODES)], policy="dynamic", max_new=8,
                                 temperature=0.0, top_p=1.0, compare=False, api_name="/chat")
            assert out[0][-1]["role"] == "assistant"
            if i + 1 == 100:
                after_100 = resident_mb(app.pid)
        after_all = resident_mb(app.pid)
        print(f"resident memory: {after_100:.0f} MB after 100 chats, {after_all:.0f} MB after {CHATS}")
        assert after_all - after_100 < 50, f"resident memory grew {after_all - after_100:.0f} MB over 900 chats"
        csv_files = list((tmp_path / "dynchat-csv").glob("*.csv"))
        assert 0 < len(csv_files) <= KEPT          # one per kept chat: evicted chats' files are deleted
    finally:
        app.terminate()
        app.wait(60)
