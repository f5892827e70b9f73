"""The pieces the report's Markdown tables are made of: getters that read one number out of a
server's results (marked relaxed or failed), a table with a dlserve/peer ratio per peer, the
notes under it, and the exact commands that were run."""

from __future__ import annotations

import shlex
from collections.abc import Callable

import measure
from measure import Measurement
from peers import ANCHORS, REFERENCE, ROOT
from sections import Results, Served

Value = tuple["float | None", str]  # (number, mark: "" | "†" relaxed | "failed")
Getter = Callable[[Results], Value]


def metric(label: str, concurrency: int | None = None, key: str = "throughput") -> Getter:
    def get(results: Results) -> Value:
        m = results.get(label)
        if not isinstance(m, Measurement):
            return None, ""
        if not m.ok:
            return None, "failed"
        if key in m.extra or key in ("batch", "executions_per_s", "hit_share"):
            return m.extra.get(key), "†" if m.relaxed else ""
        level = m.at(concurrency)
        value = None if level is None else getattr(level, key)
        return value, "†" if m.relaxed else ""

    return get


def combine(op: Callable[[float, float], float], a: Getter, b: Getter) -> Getter:
    def get(results: Results) -> Value:
        (x, mx), (y, my) = a(results), b(results)
        if x is None or y is None or (op is over and not y):
            return None, "failed" if "failed" in (mx, my) else ""
        return op(x, y), "†" if "†" in (mx, my) else ""

    return get


def minus(x: float, y: float) -> float:
    return x - y


def over(x: float, y: float) -> float:
    return x / y


def streamed(key: str) -> Getter:
    def get(results: Results) -> Value:
        stream = results.get("stream")
        if isinstance(stream, dict):
            return stream.get(key), ""
        return None, "failed" if stream else ""

    return get


def fmt(value: Value, digits: int) -> str:
    number, mark = value
    if number is None:
        return mark or "—"
    return f"{number:,.{digits}f}{mark}"


Row = tuple[str, Getter, int]  # label (ending in ↑ or ↓), getter, digits


def table(rows: list[Row], served: dict[str, Served], names: list[str]) -> list[str]:
    """Rows of one metric each; a column per server and a dlserve/peer ratio per peer."""
    others = [n for n in names if n != "dlserve"]
    head = "| | dlserve | " + " | ".join(f"{p} | dlserve/{p}" for p in others) + " |"
    lines = [head, "|---|---:|" + "---:|---:|" * len(others)]
    mine = served.get("dlserve", Served("dlserve")).results
    for label, get, digits in rows:
        a = get(mine)
        cells = [fmt(a, digits)]
        for peer in others:
            b = get(served.get(peer, Served(peer)).results)
            cells.append(fmt(b, digits))
            # a ratio of differences that can be negative (an overhead within noise) means nothing
            meaningful = a[0] is not None and b[0] is not None and a[0] > 0 and b[0] > 0
            cells.append(f"**{a[0] / b[0]:.2f}×**" if meaningful else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def notes(served: dict[str, Served]) -> list[str]:
    """Wrong answers, servers that did not start, failed and relaxed measurements."""
    out: list[str] = []
    for name, record in served.items():
        if record.error:
            out.append(f"**{name} failed:** {record.error}  ")
        for problem in record.results.get("problems", []):
            out.append(f"**{name} answered wrongly:** {problem}  ")
        relaxed = []
        for label, m in record.results.items():
            if isinstance(m, Measurement) and m.error:
                out.append(f"{name}, {m.tool} `{label}`: failed: {m.error}  ")
            elif isinstance(m, Measurement) and m.relaxed:
                relaxed.append(f"`{label}` ({m.tool})")
        if relaxed:
            out.append(
                f"† {name}: not stable within the window's stability percentage in the allowed "
                f"windows, measured again with `-s {measure.RELAXED:g}` (check off): {', '.join(relaxed)}  "
            )
    return out


def shorten(text: str) -> str:
    for path, name in ((str(REFERENCE), "$REF"), (str(ANCHORS), "$ANCHORS"), (str(ROOT) + "/", "")):
        text = text.replace(path, name)
    return text


def command_lines(served: dict[str, Served], labels: list[str] | None = None) -> list[str]:
    """Each client command once (ports as $HTTP_PORT/$GRPC_PORT: the same for every server)."""
    seen: dict[str, None] = {}
    for record in served.values():
        for label, m in record.results.items():
            if not isinstance(m, Measurement) or not m.command or (labels and label not in labels):
                continue
            words = []
            for word in (m.attempts or [m.command])[0]:  # a relaxed retry differs only in -s
                for key, port in record.ports.items():
                    word = word.replace(f"127.0.0.1:{port}", f"127.0.0.1:${key.upper()}_PORT")
                words.append("OUT.csv" if word.endswith("out.csv") else word)
            seen.setdefault(shorten(shlex.join(words)).replace("'", ""), None)
    return [f"- `{c}`" for c in seen]


def server_lines(served: dict[str, Served]) -> list[str]:
    return [
        f"- {name} {record.version}: `{shorten(record.command)}`" for name, record in served.items()
    ]
