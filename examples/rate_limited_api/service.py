"""A pretend API that allows one request per 100 ms and answers 429 to the rest.

Like an API gateway's limiter, it tolerates a little network jitter (``--jitter``,
default 10 ms): a request is accepted when at least ``min_gap - jitter`` has passed since
the last accepted one. It counts answers per caller (the ``caller`` query parameter);
``GET /stats`` returns the counts as JSON, ``POST /reset`` clears them.

    python service.py --port 8080       # run it on its own
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


class LimitedService(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int = 0, min_gap: float = 0.1, jitter: float = 0.01) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.min_gap, self.jitter = min_gap, jitter
        self.lock = threading.Lock()
        self.last_accepted = float("-inf")
        self.answers: defaultdict[str, Counter[int]] = defaultdict(Counter)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def admit(self, caller: str) -> int:
        with self.lock:
            now = time.monotonic()
            status = 200 if now - self.last_accepted >= self.min_gap - self.jitter else 429
            if status == 200:
                self.last_accepted = now
            self.answers[caller][status] += 1
            return status

    def stats(self) -> dict[str, dict[str, int]]:
        with self.lock:
            return {caller: {str(k): v for k, v in counts.items()} for caller, counts in self.answers.items()}

    def reset(self) -> None:
        with self.lock:
            self.answers.clear()
            self.last_accepted = float("-inf")

    def start_in_background(self) -> LimitedService:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _Handler(BaseHTTPRequestHandler):
    server: LimitedService

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/stats":
            self._reply(200, self.server.stats())
            return
        caller = parse_qs(url.query).get("caller", ["anonymous"])[0]
        status = self.server.admit(caller)
        self._reply(status, {"ok": status == 200}, retry_after=status == 429)

    def do_POST(self) -> None:
        if urlparse(self.path).path != "/reset":
            self._reply(404, {"error": "not found"})
            return
        self.server.reset()
        self._reply(200, {"ok": True})

    def _reply(self, status: int, body: Any, retry_after: bool = False) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if retry_after:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: Any) -> None:  # quiet: the script prints the counts
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--jitter", type=float, default=0.01, help="seconds of tolerated jitter (default 0.01)")
    args = parser.parse_args()
    service = LimitedService(args.port, jitter=args.jitter)
    print(f"pretend API on {service.url}: 1 request per 100 ms, 429 otherwise")
    service.serve_forever()


if __name__ == "__main__":
    main()
