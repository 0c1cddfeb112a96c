"""What a benchmark task's body waits on, the same for the plain and the fenced app."""

from __future__ import annotations

import contextlib
import socket


def wait_on_a_socket(seconds: float) -> None:
    """Wait ``seconds`` in a socket read that gets nothing (a downstream call's wait)."""
    reader, writer = socket.socketpair()
    try:
        reader.settimeout(seconds)
        with contextlib.suppress(TimeoutError):
            reader.recv(1)
    finally:
        reader.close()
        writer.close()
