"""The control protocol between the server and its worker ("stub") processes.

A message is ``(kind, corr, body)``: ``kind`` says what it is, ``corr`` pairs a
reply with its request (0 = needs no reply), ``body`` is made of plain Python values
(ints, floats, strings, bytes, tuples, lists, dicts, None). Frames are a 4-byte
little-endian length followed by the ``marshal`` encoding of the message: ``marshal``
is CPython's C codec for exactly these types, about 2 µs per round trip for an
execute message (measured), and it cannot build arbitrary objects the way pickle can.
Its format version 4, written here explicitly, is read back the same by Python 3.4 to
3.13 (checked for these types: 3.10-3.13), so a worker may run another Python than the
server's (ipc.environments).

Tensor bytes never travel here: a tensor is a reference into shared memory
(see :mod:`dlserve.ipc.tensors`). Either side may start an exchange, and many may be
in flight at once, so the same channel later carries decoupled responses, BLS calls,
cancellation, logs and metric updates without a redesign.
"""

from __future__ import annotations

import marshal
import signal
import struct
from typing import Any

from dlserve.errors import ErrorCode

HEADER = struct.Struct("<I")
MARSHAL_VERSION = 4
MAX_FRAME = 1 << 30
# On this signal a worker writes every Python thread's stack to its stderr (faulthandler,
# from its C handler: it works while the model holds the GIL in native code). The server
# sends it to a worker that does not finish loading in time. A real-time signal, which
# no library uses by convention as they use SIGUSR1.
STACKS_SIGNAL = signal.SIGRTMIN + 7


class Kind:
    """What a message is: plain ints, as they go on the wire. Not an IntEnum: every
    message is compared with several of these, and an enum member's lookup costs
    several times an int's."""

    # replies (either direction)
    REPLY = 1
    ERROR = 2  # body: (error code, message)
    # server -> stub
    INIT = 10
    EXECUTE = 11
    FINALIZE = 12
    AUTO_COMPLETE = 13
    IS_READY = 14
    CANCEL = 15  # no reply; body: list of request handles the server cancelled
    BLS_RESPONSE = 16  # no reply; corr: the BLS call's; body: (response, final)
    INLINE_DROP = 17  # no reply; body: names of models whose inline copies must go (ipc.inline)
    # either direction, no reply
    RELEASE = 20  # body: list of lease ids the sender no longer uses
    RETIRE = 21  # body: list of segment names the sender has unlinked
    # stub -> server
    LOG = 30  # no reply; body: (level, message, filename, line)
    METRIC_FAMILY = 31  # reply None or ERROR; body: (name, description, kind)
    METRIC = 32  # no reply; body: (op, family, labels, value or buckets)
    METRIC_VALUE = 33  # reply float; body: (family, labels)
    RESPONSE = 34  # no reply; body: (request handle, response or None, final)
    BLS = 35  # answered by BLS_RESPONSE messages with the same corr; body: see ipc.bls
    BLS_CANCEL = 36  # no reply; body: corr of the BLS call to cancel
    MODEL_CONTROL = 37  # reply; body: (operation, arguments)
    INLINE = 38  # reply: what a BLS caller needs to run the model itself, or None; body: (name, version)
    INLINE_DONE = 39  # no reply; body: an inline call for the callee's statistics (ipc.inline)

    @classmethod
    def name_of(cls, kind: int) -> str:
        """The kind's name (for logs and tests), or the number for an unknown one."""
        for name, value in vars(cls).items():
            if value == kind and name.isupper():
                return name
        return str(kind)


Message = tuple[int, int, Any]

# In an EXECUTE reply, in place of a request's response: the request is answered
# through RESPONSE messages (its response sender), before or after the reply.
STREAMED = 0
# ... or: the request was cancelled while its EXECUTE waited in the worker behind the one
# before, and it did not run (as a cancelled queued request does not).
UNRUN = 1


def refused_call(model_name: str, reason: str) -> tuple[int, str]:
    """The error of a BLS call refused before its model saw it (by the server, or by an
    inline caller's own checks): Triton's code (INTERNAL, whatever the reason) and
    prefix. The callee's own errors keep theirs."""
    return int(ErrorCode.INTERNAL), f"Model {model_name} - Error when running inference: {reason}"


def encode(kind: int, corr: int, body: Any) -> bytes:
    payload = marshal.dumps((kind, corr, body), MARSHAL_VERSION)
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes | memoryview) -> Message:
    kind, corr, body = marshal.loads(payload)
    return kind, corr, body


class FrameBuffer:
    """Reassembles frames from a byte stream fed in arbitrary chunks."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        if not self._buf and len(data) >= 4:  # (most reads: exactly one whole frame)
            (length,) = HEADER.unpack_from(data)
            if len(data) == 4 + length and length <= MAX_FRAME:
                return [decode(memoryview(data)[4:])]
        buf = self._buf
        buf += data
        out: list[Message] = []
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (length,) = HEADER.unpack_from(buf, pos)
            if length > MAX_FRAME:
                raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
            if end - pos - 4 < length:
                break
            out.append(decode(memoryview(buf)[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        if pos:
            del buf[:pos]
        return out
