"""A real ``redis-server`` (Debian's) on a free port of 127.0.0.1 for the engines' tests:
:func:`running` starts it, yields its port once it answers PING, and stops it after
(tests/integration/test_celery.py and test_rq.py: the broker, result backend and RQ's queue)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from typing import Callable, Iterator, NoReturn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def running(need: Callable[[str], NoReturn], fail: Callable[[str], NoReturn]) -> Iterator[int]:
    """The port of a fresh, empty redis-server (no persistence). ``need(reason)`` is called
    when redis-server is not installed (skip outside CI, fail in CI); ``fail(reason)`` when
    it does not start."""
    exe = shutil.which("redis-server")
    if exe is None:
        need("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
