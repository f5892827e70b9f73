"""``--collect-metrics``: the server's GPU gauges, read while the benchmark runs.

As perf_analyzer does: every ``--metrics-interval`` ms a thread reads the Prometheus text
at ``--metrics-url`` (in-process: the server's own) and keeps four gauges per GPU, by
``gpu_uuid``. A level reports, over the reads taken during its last 3 windows, each GPU's
average utilization and power, its largest memory used, and its total memory (as the
level's first read saw it). A gauge the text lacks is warned about once, as is a server
that cannot be reached; the benchmark goes on, with that gauge empty.
"""

from __future__ import annotations

import re
import sys
import threading
import urllib.request
from collections.abc import Callable


def _average(values: list[float]) -> float:
    return sum(values) / len(values)


def _first(values: list[float]) -> float:
    return values[0]


# Prometheus name -> (perf_analyzer's title for it, how a level merges its reads, unit)
GAUGES: dict[str, tuple[str, Callable[[list[float]], float], str]] = {
    "nv_gpu_utilization": ("Avg GPU Utilization", _average, "fraction"),
    "nv_gpu_power_usage": ("Avg GPU Power Usage", _average, "watts"),
    "nv_gpu_memory_used_bytes": ("Max GPU Memory Usage", max, "bytes"),
    "nv_gpu_memory_total_bytes": ("Total GPU Memory", _first, "bytes"),
}
UNITS = {title: unit for title, _, unit in GAUGES.values()}  # title -> unit
Read = dict[str, dict[str, float]]  # gauge -> GPU uuid -> value, one read of the text
Merged = dict[str, dict[str, float]]  # console title -> GPU uuid -> value, over a level

_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)")
_UUID = re.compile(r'gpu_uuid="([^"]*)"')


def parse(text: str) -> Read:
    """The four gauges' values per GPU in a Prometheus text (what it lacks is left out)."""
    read: Read = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in GAUGES:
            continue
        uuid = _UUID.search(match.group(2))
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if uuid is not None:
            read.setdefault(match.group(1), {})[uuid.group(1)] = value
    return read


def merge(reads: list[Read]) -> Merged:
    """A level's figures from its reads, in order."""
    merged: Merged = {}
    for gauge, (title, figure, _) in GAUGES.items():
        series: dict[str, list[float]] = {}
        for read in reads:
            for uuid, value in read.get(gauge, {}).items():
                series.setdefault(uuid, []).append(value)
        merged[title] = {uuid: figure(values) for uuid, values in sorted(series.items())}
    return merged


def http_fetcher(url: str) -> Callable[[], str]:
    """A GET of ``url`` (``host:port/path``, as perf_analyzer takes it, or a full URL)."""
    full = url if "://" in url else f"http://{url}"

    def fetch() -> str:
        with urllib.request.urlopen(full, timeout=5) as answer:  # noqa: S310 - the user's own URL
            return answer.read().decode("utf-8", "replace")

    return fetch


class MetricsCollector:
    """Reads the metrics every ``interval_s`` on a thread of its own until :meth:`stop`;
    :meth:`take` hands over the reads since the last take."""

    def __init__(self, fetch: Callable[[], str], interval_s: float, url: str) -> None:
        self._fetch = fetch
        self._interval_s = interval_s
        self._url = url
        self._reads: list[Read] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="dlserve-perf-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join()

    def take(self) -> list[Read]:
        with self._lock:
            reads, self._reads = self._reads, []
        return reads

    def _run(self) -> None:
        while True:
            self._read_once()
            if self._stopping.wait(self._interval_s):
                return

    def _read_once(self) -> None:
        try:
            text = self._fetch()
        except Exception as exc:  # noqa: BLE001 - said once; the benchmark goes on without them
            self._warn("connect", f"Unable to connect to Metrics endpoint {self._url} ({exc})")
            return
        read = parse(text)
        for gauge in GAUGES:
            if gauge not in read:  # (perf_analyzer's words)
                self._warn(gauge, f"WARNING: Unable to parse '{gauge}' metric.")
        with self._lock:
            self._reads.append(read)

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            print(message, file=sys.stderr)
