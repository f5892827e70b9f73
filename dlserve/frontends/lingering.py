"""Lingering close, as nginx's: ending a connection whose client may still be sending.

Closing a socket with unread bytes makes the kernel send a reset, not a FIN, and drop what
it still had to send: a client that writes its whole request before reading fails on the
write, and one whose last answer (an HTTP error, an HTTP/2 GOAWAY) is still in flight, or
whose stack drops what it holds on a reset, loses it. So the last bytes are followed by a
FIN, and what the client still sends is read and dropped, within bounds, before the close.
The HTTP server uses it after an early answer, the gRPC transport after a connection error.
"""

from __future__ import annotations

import asyncio

# What the client still sends is read and dropped for at most this long, this long
# without a byte, and this many bytes.
LINGER_SECONDS = 5.0
LINGER_IDLE_SECONDS = 1.0
LINGER_BYTES = 64 << 20


class Lingering:
    """A connection half-closed by :func:`linger`: its protocol hands it the count of
    each read's bytes (:meth:`received`), dropped, and calls :meth:`cancel` once the
    connection is lost. A closing server closes its transport at once, as usual."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.until = self.loop.time() + LINGER_SECONDS
        self.dropped = 0
        self.timer: asyncio.TimerHandle | None = None
        self._close_later()

    def received(self, nbytes: int) -> None:
        self.dropped += nbytes
        self._close_later()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _close_later(self) -> None:
        """(Re)arm the close: after a pause in what the client sends, or at once past
        the bounds."""
        self.cancel()
        wait = min(LINGER_IDLE_SECONDS, self.until - self.loop.time())
        if wait <= 0 or self.dropped > LINGER_BYTES:
            self.transport.close()
        else:
            self.timer = self.loop.call_later(wait, self.transport.close)


def linger(transport: asyncio.Transport) -> Lingering | None:
    """Send what ``transport`` holds, then a FIN, and read on, dropping what comes, until
    the client closes or the bounds run out (None: closed at once, as TLS is: its
    close sends close_notify first)."""
    if not transport.can_write_eof():
        transport.close()
        return None
    transport.write_eof()
    lingering = Lingering(transport)
    transport.resume_reading()
    return lingering


__all__ = ["LINGER_BYTES", "LINGER_IDLE_SECONDS", "LINGER_SECONDS", "Lingering", "linger"]
