"""Server log settings (Triton's logging extension) and Triton's log lines.

``log_info``/``log_warning``/``log_error`` each switch their own severity on or off,
``log_verbose_level`` > 0 the verbose (DEBUG) lines; the settings are changed at run
time through the HTTP/gRPC logging endpoints. ``log_file`` is fixed at start-up, as in
Triton.

Where dlserve writes the log itself (``dlserve serve``'s stderr, a log file) it writes
Triton's lines (:func:`triton_line`), each severity shown or not as the settings say.
In-process, without a log file, the records go to the host's Python logging and the
settings only set the ``dlserve`` logger's level (the lowest severity switched on).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
from typing import Any, TextIO

from dlserve.errors import InvalidArgumentError, UnsupportedError

LOGGER = "dlserve"
# A message is quoted and escaped (one record, one line) unless this is 0 or false, as in Triton.
ESCAPE_VARIABLE = "TRITON_SERVER_ESCAPE_LOG_MESSAGES"
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_ESCAPED = str.maketrans({**{chr(c): f"\\u{c:04X}" for c in range(0x20)}, **_ESCAPES})  # (hex as Triton's)
_FORMATS = ("default", "ISO8601")
# ``extra`` of a record written after its line's header as it is (a table, as Triton's)
VERBATIM = {"verbatim": True}


@dataclasses.dataclass
class LogSettings:
    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    def shows(self, level: int) -> bool:
        """Whether a record at this Python level is logged."""
        if level >= logging.ERROR:
            return self.log_error
        if level >= logging.WARNING:
            return self.log_warning
        if level >= logging.INFO:
            return self.log_info
        return self.log_verbose_level > 0

    def start(self) -> None:
        """At server start: apply, and open the log file where one is asked for."""
        self.apply()
        if self.log_file and not any(handler.path == self.log_file for handler in _own_handlers()):
            self._open_log_file()

    def apply(self) -> None:
        levels = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)
        shown = [level for level in levels if self.shows(level)]
        logging.getLogger(LOGGER).setLevel(shown[0] if shown else logging.CRITICAL + 1)
        for handler in _own_handlers():
            handler.settings = self

    def _open_log_file(self) -> None:
        """Append to the log file; the log goes there only (``dlserve serve``'s stderr
        handler makes way). A file that cannot be opened leaves the log where it was, as
        in Triton, with one line on stderr that says why."""
        try:
            stream = open(self.log_file, "a", encoding="utf-8")  # noqa: SIM115 - open for good
        except OSError as exc:
            print(f"dlserve: cannot write the log to '{self.log_file}': {exc.strerror}",
                  file=sys.stderr, flush=True)
            self.log_file = ""  # (what the logging endpoints then say, as Triton's)
            return
        root = logging.getLogger()
        to_stderr = [handler for handler in _own_handlers() if not handler.path]
        for handler in to_stderr:
            root.removeHandler(handler)
        owner = root if to_stderr else logging.getLogger(LOGGER)
        owner.addHandler(TritonLogHandler(stream, self, self.log_file))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; unknown keys, wrong types and ``log_file`` are refused,
        a None value (JSON null) leaves its setting as it is (as Triton does)."""
        changes = {key: value for key, value in changes.items() if value is not None}
        for key, value in changes.items():
            if key == "log_file":  # (Triton's words and status)
                raise UnsupportedError("log file location can not be updated through network protocol")
            if key not in {f.name for f in dataclasses.fields(self)}:
                raise InvalidArgumentError(f"unknown log setting '{key}'")
            current = getattr(self, key)
            if isinstance(current, bool):
                if not isinstance(value, bool):
                    raise InvalidArgumentError(f"log setting '{key}' must be a boolean")
            elif isinstance(current, int):
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
                    raise InvalidArgumentError(f"log setting '{key}' must be a non-negative 32-bit integer")
            elif key == "log_format" and value not in _FORMATS:
                raise InvalidArgumentError(f"log_format must be one of {', '.join(_FORMATS)}")
        for key, value in changes.items():
            setattr(self, key, value)
        self.apply()


class TritonLogHandler(logging.StreamHandler):
    """A stream dlserve writes its log to: Triton's lines, in the format and with the
    severities the settings say at the time of each record."""

    def __init__(self, stream: TextIO, settings: LogSettings, path: str = "") -> None:
        super().__init__(stream)
        self.settings = settings
        self.path = path  # "" for stderr

    def filter(self, record: logging.LogRecord) -> bool:
        return self.settings.shows(record.levelno) and bool(super().filter(record))

    def format(self, record: logging.LogRecord) -> str:
        return triton_line(record, iso8601=self.settings.log_format == "ISO8601")


def log_to_stderr(settings: LogSettings) -> None:
    """Every log record of this process (``dlserve serve``'s) as Triton's lines on stderr."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(TritonLogHandler(sys.stderr, settings))
    settings.apply()


def triton_line(record: logging.LogRecord, iso8601: bool) -> str:
    """``I1202 06:37:19.852139 10271 model.py:12] "message"`` (ISO8601:
    ``2026-12-02T06:37:19Z I 10271 ...``): severity, UTC time, process id, the source
    line that logged it, and the message quoted so that a record is one line. A model's
    line names its own source (``extra={"source": "model.py:12"}``)."""
    severity = "E" if record.levelno >= logging.ERROR else "W" if record.levelno >= logging.WARNING else "I"
    moment = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
    if iso8601:
        stamp = moment.strftime("%Y-%m-%dT%H:%M:%SZ ") + severity
    else:
        stamp = severity + moment.strftime("%m%d %H:%M:%S.%f")
    source = getattr(record, "source", None) or f"{record.filename}:{record.lineno}"
    text = record.getMessage()
    if record.exc_info:
        text += "\n" + logging.Formatter().formatException(record.exc_info)
    raw = getattr(record, "verbatim", False) or os.environ.get(ESCAPE_VARIABLE, "").lower() in ("0", "false")
    body = text if raw else f'"{text.translate(_ESCAPED)}"'
    return f"{stamp} {record.process} {source}] {body}"


def _own_handlers() -> list[TritonLogHandler]:
    found = logging.getLogger().handlers + logging.getLogger(LOGGER).handlers
    return [handler for handler in found if isinstance(handler, TritonLogHandler)]
