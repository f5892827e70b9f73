"""Triton's log lines as dlserve writes them (dlserve/engine/logs.py), next to what
Triton 2.51 writes (measured side by side with upstream's qa/L0_logging)."""

from __future__ import annotations

import logging

import dlserve
from dlserve.engine.logs import triton_line


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("dlserve.test", logging.INFO, "/x/http_api.py", 7, message, None, None)


def test_a_message_is_one_quoted_line_with_control_characters_in_upper_case_hex():
    line = triton_line(record('say "hi"\\ \n\t\x1b end'), iso8601=False)
    assert line.endswith(' http_api.py:7] "say \\"hi\\"\\\\ \\n\\t\\u001B end"')
    assert "\n" not in line


def test_triton_s_variable_turns_escaping_off(monkeypatch):
    for value in ("0", "false"):
        monkeypatch.setenv("TRITON_SERVER_ESCAPE_LOG_MESSAGES", value)
        assert triton_line(record('raw "text"\x1b'), iso8601=False).endswith(' http_api.py:7] raw "text"\x1b')
    monkeypatch.setenv("TRITON_SERVER_ESCAPE_LOG_MESSAGES", "1")
    assert triton_line(record("quoted"), iso8601=False).endswith(' http_api.py:7] "quoted"')


def test_a_negative_verbose_level_is_zero_as_triton_shows_it():
    assert dlserve.Options(model_repository="/x", log_verbose=-1).log_settings().log_verbose_level == 0
