"""``pb_utils.Logger``: model log lines go into the server's log at their level.

Inside a worker the line is queued to the server (no reply is awaited) and logged
there under ``dlserve.model.<name>``; outside one it goes to Python logging. A model's
plain Python ``logging`` records take the same way (:class:`ServerLogHandler`, on the
worker's root logger): Triton drops them.
"""

from __future__ import annotations

import enum
import logging

from dlserve.pb_utils import _runtime


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
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        runtime = _runtime.current()
        if runtime is not None:
            runtime.log(int(level), str(message))
        else:
            logging.getLogger("dlserve.model").log(PYTHON_LEVELS[LogLevel(level)], message)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, LogLevel.VERBOSE)


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
            Logger.log(self.format(record), level)
        except OSError:
            pass  # the server is gone (the worker is ending)
        except Exception:  # noqa: BLE001 - logging must never raise into the model
            self.handleError(record)
