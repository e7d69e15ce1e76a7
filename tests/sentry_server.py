"""A loopback stand-in for Sentry's ingestion: an HTTP server on 127.0.0.1 that keeps the
envelopes it receives; :func:`receiving` yields a DSN pointing at it and the list its events
are put in (tests/integration/test_sentry.py, and the engines' tests for events sent from a worker)."""

from __future__ import annotations

import contextlib
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Iterator


class _Envelopes(BaseHTTPRequestHandler):
    received: list[bytes]

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.received.append(body)  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


def events_of(bodies: list[bytes]) -> list[dict]:
    """The ``event`` items of the envelopes."""
    events = []
    for body in bodies:
        lines = body.split(b"\n")
        for header, payload in zip(lines[1::2], lines[2::2]):
            if json.loads(header).get("type") == "event":
                events.append(json.loads(payload))
    return events


@contextlib.contextmanager
def receiving() -> Iterator[tuple[str, list[bytes]]]:
    """(DSN, the bodies received so far): the server runs until the block ends."""
    server = HTTPServer(("127.0.0.1", 0), _Envelopes)
    server.received = []  # type: ignore[attr-defined]
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        yield f"http://public@127.0.0.1:{server.server_port}/1", server.received  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        serving.join()
