"""A small local streaming HTTP server standing in for the AI provider.

``GET /v1/stream?report=ID&inject=MODE`` streams a few lines, a chunk at a time. ``inject``
asks for a fault, on the first request for a report only ("-once") or on every one:

* ``hang-once``: two chunks, then nothing (the connection stays open) — a stream that stops
  mid-way; the next request for that report streams normally;
* ``stop-once``: the server closes the connection after two chunks;
* ``slow``: the first chunk comes late (``slow_first`` seconds).

It is a plain ``ThreadingHTTPServer``: tests and the demo start it in a thread.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

__all__ = ["AIServer"]

CHUNKS = ["The", "report", "is", "ready:", "all", "facts", "were", "summarised."]


class AIServer:
    """The stand-in AI provider, on ``127.0.0.1:port`` (0 picks a free port)."""

    def __init__(
        self, port: int = 0, *, chunk_pause: float = 0.15, slow_first: float = 5.0, hang: float = 60.0
    ) -> None:
        self.requests: Counter[str] = Counter()
        self.chunk_pause = chunk_pause
        self.slow_first = slow_first
        self.hang = hang
        self._closing = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query)
                report = query.get("report", [""])[0]
                inject = query.get("inject", [""])[0]
                server.requests[report] += 1
                first_time = server.requests[report] == 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    server._stream(self, inject, first_time)
                except (BrokenPipeError, ConnectionResetError):
                    return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ai-server", daemon=True)

    def _stream(self, handler: BaseHTTPRequestHandler, inject: str, first_time: bool) -> None:
        def send(text: str) -> None:
            data = (text + "\n").encode()
            handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            handler.wfile.flush()

        if inject == "slow":
            self._closing.wait(self.slow_first)
        for index, chunk in enumerate(CHUNKS):
            if index == 2 and first_time and inject == "hang-once":
                self._closing.wait(self.hang)  # the stream stops mid-way and stays open
                return
            if index == 2 and first_time and inject == "stop-once":
                handler.close_connection = True
                return
            send(chunk)
            time.sleep(self.chunk_pause)
        handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()

    def start(self) -> AIServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="the example project's stand-in AI provider")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    ai = AIServer(args.port).start()
    print(f"AI stand-in on {ai.url}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        ai.stop()
