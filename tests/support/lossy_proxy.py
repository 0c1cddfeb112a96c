"""A TCP proxy in front of Redis that loses the reply to one request: the server ran the
command, the client never hears of it (its connection is cut), and the client's retry sends it
again. redis-py (6 and later) retries a command or a pipeline on a connection error by default,
so every script must answer a repeated call as it answered the first.
"""

from __future__ import annotations

import threading

from tests.support.replication import HoldingProxy, _close, _Link

__all__ = ["ReplyDroppingProxy"]


class ReplyDroppingProxy(HoldingProxy):
    """Passes connections to ``target_port``; :meth:`drop_reply_to` arms it to lose one reply.

    The next request whose bytes contain the marker reaches the server; the server's reply
    to it is not passed on, and that connection is closed.
    """

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self._marker: bytes | None = None
        self._dropping: set[int] = set()
        self._marker_lock = threading.Lock()
        self.dropped = 0

    def drop_reply_to(self, marker: bytes) -> None:
        """Lose the reply to the next request that contains ``marker``."""
        with self._marker_lock:
            self._marker = marker

    def _pass(self, link: _Link, upstream: bool) -> None:
        source, sink = (link.client, link.server) if upstream else (link.server, link.client)
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                with self._marker_lock:
                    if upstream and self._marker is not None and self._marker in data:
                        self._marker = None
                        self._dropping.add(id(link))
                    elif not upstream and id(link) in self._dropping:
                        self._dropping.discard(id(link))
                        self.dropped += 1
                        break  # the reply is lost with the connection
                sink.sendall(data)
        except OSError:
            pass
        _close(link.client, link.server)
