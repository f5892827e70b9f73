"""Server log settings (Triton's logging extension), applied to Python logging.

``log_info``/``log_warning``/``log_error`` switch levels on, ``log_verbose_level``
> 0 turns on DEBUG; the settings are changed at run time through the HTTP/gRPC
logging endpoints. ``log_file`` is fixed at start-up, as in Triton.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from dlserve.errors import InvalidArgumentError, UnsupportedError

LOGGER = "dlserve"
_FORMATS = ("default", "ISO8601")


@dataclasses.dataclass
class LogSettings:
    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    def apply(self) -> None:
        logger = logging.getLogger(LOGGER)
        if self.log_verbose_level > 0:
            level = logging.DEBUG
        elif self.log_info:
            level = logging.INFO
        elif self.log_warning:
            level = logging.WARNING
        elif self.log_error:
            level = logging.ERROR
        else:
            level = logging.CRITICAL + 1
        logger.setLevel(level)
        if self.log_file and not any(
            getattr(h, "baseFilename", None) == self.log_file for h in logger.handlers
        ):
            handler = logging.FileHandler(self.log_file)
            datefmt = "%Y-%m-%dT%H:%M:%S" if self.log_format == "ISO8601" else None
            handler.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt)
            )
            logger.addHandler(handler)

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
