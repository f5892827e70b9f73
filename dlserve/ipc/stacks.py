"""Reading a worker's Python stacks, as faulthandler writes them on ``STACKS_SIGNAL``.

The dump lists every thread, newest first, each under a ``Thread 0x... (most recent call
first):`` header (``Current thread`` for the one the signal interrupted), one ``  File
"...", line N in function`` line per frame, innermost first, its paths in ASCII (others
as backslash escapes). The worker's main thread is the oldest, so its outermost frame
ends the dump: runpy's, or the ``-c`` bootstrap's of a worker in an execution
environment. Past 100 threads faulthandler stops with a ``...`` line instead, the oldest
left out. The server's log gets all of it; an error message gets the frames of the
thread that is in the model's code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# The outermost frame of the worker's main thread (``python -m dlserve.ipc.stub``, or
# ``python -c <bootstrap>``): the last line of a whole dump.
DUMP_END = re.compile(r' in _run_module_as_main$|^  File "<string>", line \d+ in <module>$', re.M)
THREADS_LEFT_OUT = re.compile(r"^\.\.\.$", re.M)  # (past 100 threads)
SHOWN_FRAMES = 20  # an error shows at most this many, the innermost and the outermost half
# (newer Pythons write the thread's name between its id and the parenthesis)
_HEADER = re.compile(
    r"^(?:Current thread|Thread) 0x[0-9a-f]+\b[^\n]*\(most recent call first\):$", re.M
)
_FRAME = re.compile(r'^  File "(?P<path>[^"]*)", line \d+ in ')


def _threads(dump: str) -> list[list[str]]:
    """Each thread's frame lines, in the dump's order (what precedes the first header,
    cut off at the front of a dump longer than was kept, counts as a thread too)."""
    return [
        [line for line in block.splitlines() if _FRAME.match(line)]
        for block in _HEADER.split(dump)
    ]


def model_frames(dump: str, code_dirs: Iterable[str]) -> list[str]:
    """The frames, innermost first, of the oldest thread that is in the model's code (a
    file under one of ``code_dirs``), down to the model's outermost frame: the worker's
    own frames below it tell the model's author nothing. [] when no thread is."""
    prefixes = tuple(
        (d.rstrip("/") + "/").encode("ascii", "backslashreplace").decode() for d in code_dirs
    )

    def in_model(line: str) -> bool:
        match = _FRAME.match(line)
        return match is not None and match["path"].startswith(prefixes)

    for frames in reversed(_threads(dump)):  # (oldest first: the main or the model's loop)
        marks = [i for i, line in enumerate(frames) if in_model(line)]
        if marks:
            frames = frames[: marks[-1] + 1]
            if len(frames) > SHOWN_FRAMES:
                half = SHOWN_FRAMES // 2
                frames = [*frames[:half], "  ...", *frames[-half:]]
            return frames
    return []


__all__ = ["DUMP_END", "SHOWN_FRAMES", "THREADS_LEFT_OUT", "model_frames"]
