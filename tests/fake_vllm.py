"""A stand-in for vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server ...`): answers
/health, /v1/models and streamed /v1/completions (echoing the prompt's first tokens), and starts a
child process as vLLM's engine core does. Each process writes its pid into $FAKE_VLLM_PIDS, so a
test can check that none outlives the app that started it."""
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
name = args[args.index("--served-model-name") + 1]
pids = Path(os.environ["FAKE_VLLM_PIDS"])
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])   # the "engine core"
(pids / f"server-{os.getpid()}").write_text("")
(pids / f"core-{core.pid}").write_text("")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._json({})
        elif self.path == "/v1/models":
            self._json({"data": [{"id": name}]})
        else:
            self._json({}, 404)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, t in enumerate(req["prompt"][:min(4, req["max_tokens"])]):
            done = "length" if i == min(4, req["max_tokens"]) - 1 else None
            chunk = {"choices": [{"token_ids": [t], "finish_reason": done}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


time.sleep(0.5)
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
