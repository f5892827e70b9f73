"""``pb_utils.Logger``: model log lines go into the server's log at their level.

Inside a worker the line is queued to the server (no reply is awaited) with the model
file and line that logged it, and logged there under ``dlserve.model.<name>``; outside
one it goes to Python logging. A model's plain Python ``logging`` records take the same
way where the model configures no logging of its own (:func:`route_model_logging`; Triton
leaves them on the model process's stderr as plain Python output).
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import sys
from typing import Any

from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import incompatible_arguments
from dlserve.pb_utils.inference import binding_text


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


PYTHON_LEVELS = {
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.VERBOSE: logging.DEBUG,
}


class Logger:
    LogLevel = LogLevel
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        if not isinstance(level, LogLevel):
            signature = "message: str, level: LogLevel = <LogLevel.INFO: 0>"
            raise incompatible_arguments("log", signature, message, level)
        _log_from_caller(_text("log", message, level), level)

    @staticmethod
    def log_info(message: str) -> None:
        _log_from_caller(_text("log_info", message), LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        _log_from_caller(_text("log_warn", message), LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        _log_from_caller(_text("log_error", message), LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        _log_from_caller(_text("log_verbose", message), LogLevel.VERBOSE)


def _text(function: str, message: Any, *rest: Any) -> str:
    """The message as text, as Triton's bindings take it; anything else is refused, as
    Triton's Logger refuses it."""
    text = binding_text(message)
    if text is None:
        signature = "message: str" + (", level: LogLevel = <LogLevel.INFO: 0>" if rest else "")
        raise incompatible_arguments(function, signature, message, *rest)
    return text


def _log_from_caller(message: str, level: LogLevel) -> None:
    caller = sys._getframe(2)  # (the model's frame: past this function and Logger's method)
    _send(message, level, os.path.basename(caller.f_code.co_filename), caller.f_lineno)


def _send(message: str, level: LogLevel, filename: str, line: int) -> None:
    runtime = _runtime.current()
    if runtime is not None:
        runtime.log(int(level), message, filename, line)
    else:
        logging.getLogger("dlserve.model").log(PYTHON_LEVELS[level], message)


class ServerLogHandler(logging.Handler):
    """Python logging records of a worker, as log lines of the server (the record's
    logger name kept, tracebacks included)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        # the most severe level the record reaches (PYTHON_LEVELS the other way round)
        level = max(
            (lvl for lvl, python in PYTHON_LEVELS.items() if record.levelno >= python),
            key=PYTHON_LEVELS.__getitem__,
            default=LogLevel.VERBOSE,
        )
        try:
            _send(self.format(record), level, record.filename, record.lineno)
        except OSError:
            pass  # the server is gone (the worker is ending)
        except Exception:  # noqa: BLE001 - logging must never raise into the model
            self.handleError(record)


def route_model_logging() -> None:
    """In a worker: the model's Python logging into the server's log, where the model
    configures none of its own, as Python's last resort does (WARNING and above, only for
    records no handler takes). So what the model configures works as in Triton and plain
    Python: ``basicConfig(level=logging.INFO)``, guarded by a check for root handlers or
    not, and ``dictConfig``. The one change: the ``basicConfig()`` that ``logging.warning()``
    and its siblings call on a root logger without handlers is not made, so that their
    records too reach the server's log rather than plain stderr."""
    handler = ServerLogHandler()
    handler.setLevel(logging.WARNING)
    logging.lastResort = handler
    configure = logging.basicConfig

    @functools.wraps(configure)
    def basic_config(**kwargs: Any) -> None:
        if kwargs or sys._getframe(1).f_globals.get("__name__") != "logging":
            configure(**kwargs)

    logging.basicConfig = basic_config
