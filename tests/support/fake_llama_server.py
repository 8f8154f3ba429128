"""A stand-in for llama.cpp's llama-server on loopback, for the benchmark's tests.

It speaks the part of llama-server's HTTP API that ``benchmarks.vs_llama_server``
and ``benchmarks.llama_server.LlamaServer`` use: ``GET /health``, ``GET
/v1/models``, ``POST /completion`` (one JSON answer) and ``POST
/v1/completions`` with ``stream``: one ``text_completion`` chunk per token
(text ``" t0"``, ``" t1"``, ... ``max_tokens`` of them, ``STEP_S`` apart),
then a chunk with ``finish_reason`` "length", empty text and ``usage``, then
``data: [DONE]``. By default it closes the connection after each response, as
llama-server does after a streamed one (``close=False`` keeps it open, with
chunked encoding). It records each request's JSON body and counts the
connections it accepted.

``python tests/support/fake_llama_server.py --port P [llama-server's flags]``
runs it as a process, as ``LlamaServer`` runs the real binary; with
``--die-unless-seccomp SIGNAL`` (e.g. SIGILL) it kills itself with that signal
unless a seccomp filter is installed in it (``Seccomp: 2`` in
``/proc/self/status``), as an AMX build dies on a machine that faults on AMX
unless AMX is denied to it; with
``--exit N`` it prints a line and exits with N.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEP_S = 0.002


class FakeLlamaServer(ThreadingHTTPServer):
    """The server; ``bodies``: (path, JSON body) of each POST, ``connections``: accepted count."""

    daemon_threads = True

    def __init__(self, port: int = 0, close: bool = True):
        self.close_after_response = close
        self.bodies: list[tuple[str, dict]] = []
        self.connections = 0
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

    def process_request(self, request, client_address):
        with self._lock:
            self.connections += 1
        super().process_request(request, client_address)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeLlamaServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, obj: dict, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.server.close_after_response:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/health"):
            self._json({"status": "ok"})
        elif self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": "fake-gemma.gguf", "object": "model"}]})
        else:
            self._json({"error": {"code": 404, "message": "File Not Found"}}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with self.server._lock:
            self.server.bodies.append((self.path, body))
        n = int(body.get("n_predict", body.get("max_tokens", 16)))
        if self.path == "/completion" or not body.get("stream"):
            self._json({"content": "".join(f" t{i}" for i in range(n)), "tokens_predicted": n})
            return
        prompt = body.get("prompt")
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        chunked = not self.server.close_after_response
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

        def send(event: str) -> None:
            data = event.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            self.wfile.flush()

        base = {"object": "text_completion", "model": "fake-gemma.gguf", "id": "cmpl-fake", "created": 0}
        for i in range(n):
            time.sleep(STEP_S)
            send("data: " + json.dumps({**base, "choices": [
                {"text": f" t{i}", "index": 0, "logprobs": None, "finish_reason": None}]}) + "\n\n")
        send("data: " + json.dumps({**base, "choices": [
            {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}}) + "\n\n")
        send("data: [DONE]\n\n")
        if chunked:
            self.wfile.write(b"0\r\n\r\n")


def _seccomp_filtered() -> bool:
    with open("/proc/self/status") as f:
        return any(line.split() == ["Seccomp:", "2"] for line in f)


def main(argv: list[str]) -> None:
    if "--exit" in argv:
        print("fake llama-server: failing on purpose", flush=True)
        sys.exit(int(argv[argv.index("--exit") + 1]))
    if "--die-unless-seccomp" in argv and not _seccomp_filtered():
        print("fake llama-server: AMX tile instruction", flush=True)
        os.kill(os.getpid(), signal.Signals[argv[argv.index("--die-unless-seccomp") + 1]])
    port = int(argv[argv.index("--port") + 1])
    print(f"fake llama-server: listening on {port}, args {argv}", flush=True)
    FakeLlamaServer(port).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
