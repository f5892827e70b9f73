"""Errors as a Triton Python model sees them: ``pb_utils.TritonError`` and friends."""

from __future__ import annotations

from typing import Any

from dlserve.errors import ErrorCode


class TritonError(Exception):
    """A per-request error a model returns in ``InferenceResponse(error=...)``.

    Triton's class is not raisable; ours is (an Exception subclass), which only
    widens what models may do. ``message()`` and ``code()`` are methods, as in Triton.
    """

    # Enum members, as Triton's are (``code().name`` works); they compare equal to ints.
    UNKNOWN = ErrorCode.UNKNOWN
    INTERNAL = ErrorCode.INTERNAL
    NOT_FOUND = ErrorCode.NOT_FOUND
    INVALID_ARG = ErrorCode.INVALID_ARG
    UNAVAILABLE = ErrorCode.UNAVAILABLE
    UNSUPPORTED = ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = ErrorCode.ALREADY_EXISTS
    CANCELLED = ErrorCode.CANCELLED

    def __init__(self, message: str, code: int = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self._message = str(message)
        self._code = ErrorCode(code)

    def message(self) -> str:  # type: ignore[override]
        return self._message

    def code(self) -> ErrorCode:
        return self._code

    def __str__(self) -> str:
        return self._message


class TritonModelException(Exception):
    """Raised by models (and by pb_utils) for errors in initialize/execute/finalize."""


def incompatible_arguments(
    function: str, signature: str, *args: Any, constructor: str | None = None
) -> TypeError:
    """The TypeError of Triton's bindings (pybind11) for arguments they do not take: a
    function's, or the ``constructor`` (its class's name) of a class."""
    kind, overload = ("function", f"({signature}) -> None") if constructor is None else (
        "constructor", f"{constructor}({signature})"
    )
    return TypeError(
        f"{function}(): incompatible {kind} arguments. The following argument types are "
        f"supported:\n    1. {overload}\n\nInvoked with: {', '.join(map(repr, args))}"
    )
