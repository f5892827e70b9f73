"""dlserve's one exception tree, keyed by Triton's error codes.

Every layer raises these; each frontend maps :class:`ErrorCode` to its own status
(HTTP status, gRPC code). Nothing here knows about a transport.

    TritonError (code)
     ├── UnknownError          UNKNOWN
     ├── InternalError         INTERNAL
     ├── NotFoundError         NOT_FOUND
     ├── InvalidArgumentError  INVALID_ARG
     ├── UnavailableError      UNAVAILABLE
     ├── UnsupportedError      UNSUPPORTED
     ├── AlreadyExistsError    ALREADY_EXISTS
     └── CancelledError        CANCELLED

The module sits at the package root, outside the four rooms, because every room
(memory, ipc, engine, frontends) and the worker process raise and carry these codes.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """``TRITONSERVER_Error_Code`` values; the integers travel between processes."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    @property
    def words(self) -> str:
        """How Triton's messages name the code (``Invalid argument: ...``)."""
        return _WORDS[self]


_WORDS = {
    ErrorCode.UNKNOWN: "Unknown",
    ErrorCode.INTERNAL: "Internal",
    ErrorCode.NOT_FOUND: "Not found",
    ErrorCode.INVALID_ARG: "Invalid argument",
    ErrorCode.UNAVAILABLE: "Unavailable",
    ErrorCode.UNSUPPORTED: "Unsupported",
    ErrorCode.ALREADY_EXISTS: "Already exists",
    ErrorCode.CANCELLED: "Cancelled",
}


class TritonError(Exception):
    """Base of every dlserve error; ``code`` says which kind it is."""

    code: ErrorCode = ErrorCode.UNKNOWN

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    @staticmethod
    def from_code(code: int | ErrorCode, message: str) -> TritonError:
        """Build the subclass that matches ``code`` (unknown codes become UNKNOWN)."""
        try:
            cls = _BY_CODE[ErrorCode(code)]
        except ValueError:
            cls = UnknownError
        return cls(message)


class UnknownError(TritonError):
    code = ErrorCode.UNKNOWN


class InternalError(TritonError):
    code = ErrorCode.INTERNAL


class NotFoundError(TritonError):
    code = ErrorCode.NOT_FOUND


class InvalidArgumentError(TritonError):
    code = ErrorCode.INVALID_ARG


class UnavailableError(TritonError):
    code = ErrorCode.UNAVAILABLE


class UnsupportedError(TritonError):
    code = ErrorCode.UNSUPPORTED


class AlreadyExistsError(TritonError):
    code = ErrorCode.ALREADY_EXISTS


class CancelledError(TritonError):
    code = ErrorCode.CANCELLED


_BY_CODE: dict[ErrorCode, type[TritonError]] = {
    cls.code: cls
    for cls in (
        UnknownError,
        InternalError,
        NotFoundError,
        InvalidArgumentError,
        UnavailableError,
        UnsupportedError,
        AlreadyExistsError,
        CancelledError,
    )
}

__all__ = [
    "AlreadyExistsError",
    "CancelledError",
    "ErrorCode",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "TritonError",
    "UnavailableError",
    "UnknownError",
    "UnsupportedError",
]
