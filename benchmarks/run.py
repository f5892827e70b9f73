"""dlserve side by side with real Triton and MLServer: one entry point, one run, one report.

    .venv/bin/python benchmarks/run.py [--quick] [--only SECTION ...] [--out benchmarks/RESULTS.md]

Sets up the peers when they are missing (../shared/tools/reference-servers/setup.sh into
$ANCHORS: Triton 2.51 from the nvidia-pytriton wheel, perf_analyzer from the tritonclient 2.50
wheel, MLServer 1.7.1), then, section by section, serves the same models from dlserve and from
each peer one after the other (each on free loopback ports, started fresh for the section and
stopped after it) and measures them with the same client and the same flags. Writes the
report (machine, versions, tables with dlserve/peer ratios, the exact commands) to --out and
its plots to plots/ next to it.

Sections (--only takes any of them; default all):

  add_sub    add_sub over HTTP and gRPC, concurrency sweep 1..16: perf_analyzer (dlserve,
             Triton), dlserve perf (dlserve, Triton, MLServer), tritonclient loadgen at 1 and 16
             (dlserve, Triton, MLServer, HTTP with JSON tensors); latency/throughput plots; and
             the load-generator check (dlserve perf vs perf_analyzer on the same server)
  identity   identity FP32 at 4 KiB, 1 MiB, 16 MiB, 64 MiB over HTTP, gRPC and gRPC + system
             shared memory (perf_analyzer; dlserve vs Triton)
  bytes      string_upper (BYTES) over HTTP and gRPC (perf_analyzer; dlserve vs Triton)
  bls        BLS overhead per call, BLS with a 4 MiB tensor, decoupled streaming responses/s
             (perf_analyzer and a tritonclient stream; dlserve vs Triton)
  batching   a dynamically batched model at concurrency 16: throughput and the server-side
             average batch size (perf_analyzer and the statistics extension; dlserve vs Triton)

A full run takes about 20 minutes on 2 cores, --quick about 6 (fewer levels, sizes and cases,
shorter windows). Every server it starts is stopped when it ends, also on Ctrl-C or SIGTERM,
and no /dev/shm segment of its servers or clients is left behind.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clients
import peers
from clients import BIG, STREAM_LEN, TINY, size
from peers import (
    ANCHORS,
    BENCH_MODELS,
    EXAMPLES,
    REFERENCE,
    ROOT,
    Measurement,
    Server,
    Window,
    log,
)

SECTIONS = ("add_sub", "identity", "bytes", "bls", "batching")
PEERS = ("Triton", "MLServer")


@dataclass
class Plan:
    """How much to measure: the full run or --quick."""

    quick: bool
    sweep: str = "1:16:5"  # --concurrency-range of the add_sub sweeps
    small: Window = field(default_factory=lambda: Window(2000, 30, 4))  # small tensors
    big: Window = field(default_factory=lambda: Window(3000, 1000, 3))  # MiB tensors: stability off
    loadgen_s: float = 4.0
    loadgen_warmup: float = 1.0
    stream_s: float = 10.0

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if not quick:
            return cls(False)
        return cls(
            True,
            sweep="1:16:15",
            small=Window(1000, 30, 4),
            big=Window(2000, 1000, 3),
            loadgen_s=2.0,
            loadgen_warmup=0.5,
            stream_s=3.0,
        )

    @property
    def levels(self) -> list[int]:
        start, end, step = (int(x) for x in self.sweep.split(":"))
        return list(range(start, end + 1, step))


Results = dict[str, Any]  # one server's results in one section: label -> Measurement | other


# ---------------------------------------------------------------- sections: what to measure


def pa_or_perf(
    tool: Callable[..., Measurement], server: Server, args: list[str], window: Window
) -> Measurement:
    protocol = args[args.index("-i") + 1]
    measurement = tool(args, server.url(protocol), window)
    shown = (
        f"{measurement.levels[-1].throughput:,.1f}/s p50 {measurement.levels[-1].p50_us:,.0f} µs"
        f"{' (relaxed)' if measurement.relaxed else ''}"
        if measurement.ok
        else f"FAILED {measurement.error}"
    )
    log(f"    {server.name:8s} {measurement.tool:13s} {' '.join(args):70s} {shown}")
    return measurement


def add_sub_args(protocol: str, plan: Plan) -> list[str]:
    return ["-m", "add_sub", "-i", protocol, "--concurrency-range", plan.sweep]


def measure_add_sub(server: Server, plan: Plan, out: Results) -> None:
    if server.name != "MLServer":
        out["problems"] = clients.check_add_sub(server.url("grpc"))
        for protocol in ("http", "grpc"):
            args = add_sub_args(protocol, plan)
            out[f"pa {protocol}"] = pa_or_perf(peers.perf_analyzer, server, args, plan.small)
            out[f"dp {protocol}"] = pa_or_perf(peers.dlserve_perf, server, args, plan.small)
    else:
        out["problems"] = []
        out["dp http"] = Measurement(
            "dlserve perf",
            [],
            error=(
                "not run: these HTTP runs send binary tensors, which MLServer's REST API lacks "
                "(the loadgen table compares all three servers with JSON tensors)"
            ),
        )
        out["dp grpc"] = pa_or_perf(
            peers.dlserve_perf, server, add_sub_args("grpc", plan), plan.small
        )
    for protocol in ("http", "grpc"):
        for c in (1, 16):
            m = peers.loadgen(
                server.url(protocol),
                protocol,
                "add_sub",
                c,
                plan.loadgen_s,
                plan.loadgen_warmup,
                json_tensors=protocol == "http",
            )
            out[f"lg {protocol} c{c}"] = m
            shown = (
                f"{m.levels[0].throughput:,.1f}/s p50 {m.levels[0].p50_us:,.0f} µs"
                if m.ok
                else f"FAILED {m.error}"
            )
            log(
                f"    {server.name:8s} loadgen       {protocol} c{c}{' JSON' if protocol == 'http' else ''}: {shown}"
            )


IDENTITY_SIZES = (1 << 10, 1 << 18, 1 << 22, 1 << 24)  # FP32 elements: 4 KiB, 1 MiB, 16 MiB, 64 MiB
TRANSPORTS = ("http", "grpc", "grpc+sysshm")


def identity_cases(plan: Plan) -> list[tuple[str, list[str], bool]]:
    """(label, perf_analyzer arguments, big) for the identity section."""
    sizes = (1 << 10, 1 << 24) if plan.quick else IDENTITY_SIZES
    out = []
    for n in sizes:
        for transport in TRANSPORTS:
            args = [
                "-m",
                "identity_fp32",
                "--shape",
                f"INPUT0:{n}",
                "--concurrency-range",
                "1",
                "-i",
                transport.split("+")[0],
            ]
            if transport.endswith("sysshm"):
                args += ["--shared-memory", "system", "--output-shared-memory-size", str(4 * n)]
            out.append((f"{size(n)} {transport}", args, 4 * n >= 1 << 20))
    return out


def measure_identity(server: Server, plan: Plan, out: Results) -> None:
    sizes = tuple(sorted({int(args[3].split(":")[1]) for _, args, _ in identity_cases(plan)}))
    out["problems"] = clients.check_identity(server.url("grpc"), ("identity_fp32",), sizes)
    for label, args, big in identity_cases(plan):
        out[label] = pa_or_perf(peers.perf_analyzer, server, args, plan.big if big else plan.small)


def bytes_cases(plan: Plan) -> list[tuple[str, list[str]]]:
    cases = [(16, 1, "http"), (16, 1, "grpc")]
    cases += (
        [(4096, 1, "grpc")]
        if plan.quick
        else [(16, 16, "http"), (16, 16, "grpc"), (4096, 1, "http"), (4096, 1, "grpc")]
    )
    return [
        (
            f"{n} × 128 B {protocol} c{c}",
            [
                "-m",
                "string_upper",
                "--shape",
                f"INPUT0:{n}",
                "--string-length",
                "128",
                "--concurrency-range",
                str(c),
                "-i",
                protocol,
            ],
        )
        for n, c, protocol in cases
    ]


def measure_bytes(server: Server, plan: Plan, out: Results) -> None:
    out["problems"] = clients.check_string_upper(server.url("grpc"))
    for label, args in bytes_cases(plan):
        out[label] = pa_or_perf(peers.perf_analyzer, server, args, plan.small)


def bls_cases(plan: Plan) -> list[tuple[str, list[str], bool]]:
    """(label, perf_analyzer arguments, big); the label names the protocol."""
    out = []
    for protocol in ("grpc",) if plan.quick else ("grpc", "http"):
        for model in ("add_sub", "bls_sync"):
            out.append(
                (
                    f"{model} {protocol}",
                    ["-m", model, "-i", protocol, "--concurrency-range", "1"],
                    False,
                )
            )
    for n in (TINY, BIG):
        for model in ("identity_fp32", "bls_identity"):
            base = ["-m", model, "--shape", f"INPUT0:{n}", "--concurrency-range", "1", "-i", "grpc"]
            out.append(
                (
                    f"{model} {size(n)} grpc+sysshm",
                    [*base, "--shared-memory", "system", "--output-shared-memory-size", str(4 * n)],
                    n == BIG,
                )
            )
            if not plan.quick and n == BIG:
                out.append((f"{model} {size(n)} grpc", base, True))
    return out


def measure_bls(server: Server, plan: Plan, out: Results) -> None:
    url = server.url("grpc")
    problems = clients.check_add_sub(url, ("add_sub", "bls_sync"), n=4)
    problems += clients.check_identity(url, ("bls_identity",), (TINY, BIG))
    out["problems"] = problems
    for label, args, big in bls_cases(plan):
        out[label] = pa_or_perf(peers.perf_analyzer, server, args, plan.big if big else plan.small)
    out["stream"] = clients.streaming(url, plan.stream_s)
    stream = out["stream"]
    shown = (
        f"{stream['responses_per_s']:,.0f} responses/s"
        if isinstance(stream, dict)
        else f"FAILED {stream}"
    )
    log(f"    {server.name:8s} stream        repeat, {STREAM_LEN} responses per request: {shown}")


def batching_cases(plan: Plan) -> list[tuple[str, list[str]]]:
    return [
        (f"{protocol} c16", ["-m", "add_sub_batched", "-i", protocol, "--concurrency-range", "16"])
        for protocol in (("grpc",) if plan.quick else ("http", "grpc"))
    ]


def measure_batching(server: Server, plan: Plan, out: Results) -> None:
    out["problems"] = clients.check_add_sub(server.url("grpc"), ("add_sub_batched",), batched=True)
    for label, args in batching_cases(plan):
        before = server.stats("add_sub_batched")
        out[label] = m = pa_or_perf(peers.perf_analyzer, server, args, plan.small)
        after = server.stats("add_sub_batched")
        executions = after.get("execution_count", 0) - before.get("execution_count", 0)
        if executions > 0:
            m.extra["batch"] = (after["inference_count"] - before["inference_count"]) / executions
            m.extra["executions_per_s"] = executions / m.wall_s
            log(f"    {server.name:8s}               average batch {m.extra['batch']:.2f}")


@dataclass
class Section:
    key: str
    title: str
    sources: list[Path]  # model folders served by dlserve and Triton
    measure: Callable[[Server, Plan, Results], None]  # fills the results as it goes
    mlserver: list[Path] = field(
        default_factory=list
    )  # MLServer model folders (MLServer takes part)


def sections() -> dict[str, Section]:
    ref, ml = REFERENCE / "models", REFERENCE / "mlserver"
    return {
        s.key: s
        for s in (
            Section(
                "add_sub",
                "add_sub: small requests, HTTP and gRPC, concurrency 1 to 16",
                [ref / "add_sub"],
                measure_add_sub,
                [ml / "add_sub"],
            ),
            Section(
                "identity",
                "identity FP32: 4 KiB to 64 MiB over HTTP, gRPC and gRPC + system shared memory",
                [ref / "identity_fp32"],
                measure_identity,
            ),
            Section("bytes", "BYTES: string_upper", [EXAMPLES / "string_upper"], measure_bytes),
            Section(
                "bls",
                "BLS and decoupled streaming",
                [
                    EXAMPLES / "add_sub",
                    EXAMPLES / "bls_sync",
                    EXAMPLES / "repeat",
                    ref / "identity_fp32",
                    BENCH_MODELS / "bls_identity",
                ],
                measure_bls,
            ),
            Section(
                "batching", "Dynamic batching", [BENCH_MODELS / "add_sub_batched"], measure_batching
            ),
        )
    }


@dataclass
class Served:
    """What one server did in one section."""

    name: str
    results: Results = field(default_factory=dict)
    version: str = ""
    command: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # the server did not start, or the section broke off


def run_section(section: Section, plan: Plan, served: dict[str, Served]) -> None:
    """Serve the section's models from dlserve and each peer in turn and measure each; fills
    ``served`` as it goes (so an interrupted run still reports what it measured)."""
    runs: list[tuple[Callable[..., Server], list[Path], list[Path]]] = [
        (peers.dlserve, section.sources, []),
        (peers.triton, section.sources, []),
    ]
    if section.mlserver:
        runs.append((peers.mlserver, section.mlserver, [REFERENCE / "mlserver" / "runtimes.py"]))
    for make, sources, extra in runs:
        with peers.repository(sources, extra) as repo:
            server = make(repo, [s.name for s in sources])
            record = served[server.name] = Served(
                server.name, command=server.shown_command(), ports=server.ports
            )
            try:
                with server:
                    record.version = server.version
                    section.measure(server, plan, record.results)
            except KeyboardInterrupt:
                raise
            except Exception as error:  # noqa: BLE001 -- reported, the run goes on
                log(traceback.format_exc())
                record.error = f"{type(error).__name__}: {str(error)[:600]}"


# ---------------------------------------------------------------- report helpers

Value = tuple["float | None", str]  # (number, mark: "" | "†" relaxed | "failed")
Getter = Callable[[Results], Value]


def metric(label: str, concurrency: int | None = None, key: str = "throughput") -> Getter:
    def get(results: Results) -> Value:
        m = results.get(label)
        if not isinstance(m, Measurement):
            return None, ""
        if not m.ok:
            return None, "failed"
        if key in m.extra or key in ("batch", "executions_per_s"):
            return m.extra.get(key), "†" if m.relaxed else ""
        level = m.at(concurrency)
        value = None if level is None else getattr(level, key)
        return value, "†" if m.relaxed else ""

    return get


def combine(op: Callable[[float, float], float], a: Getter, b: Getter) -> Getter:
    def get(results: Results) -> Value:
        (x, mx), (y, my) = a(results), b(results)
        if x is None or y is None or (op is _over and not y):
            return None, "failed" if "failed" in (mx, my) else ""
        return op(x, y), "†" if "†" in (mx, my) else ""

    return get


def _minus(x: float, y: float) -> float:
    return x - y


def _over(x: float, y: float) -> float:
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
            cells.append(f"**{a[0] / b[0]:.2f}×**" if a[0] is not None and b[0] else "—")
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
                f"windows, measured again with `-s {peers.RELAXED:g}` (check off): {', '.join(relaxed)}  "
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


# ---------------------------------------------------------------- report: sections


def report_add_sub(served: dict[str, Served], plan: Plan, plots: Path, link: str) -> list[str]:
    protocols = (("http", "HTTP"), ("grpc", "gRPC"))
    rows: dict[str, list[Row]] = {"pa": [], "dp": [], "lg": []}
    for protocol, shown in protocols:
        for c in (1, 16):
            for tool in ("pa", "dp"):
                rows[tool] += [
                    (f"{shown} c{c}: infer/s ↑", metric(f"{tool} {protocol}", c), 1),
                    (f"{shown} c{c}: p50 µs ↓", metric(f"{tool} {protocol}", c, "p50_us"), 0),
                ]
            lg = f"lg {protocol} c{c}"
            what = f"{shown}{' (JSON tensors)' if protocol == 'http' else ''} c{c}"
            rows["lg"] += [
                (f"{what}: infer/s ↑", metric(lg), 1),
                (f"{what}: p50 µs ↓", metric(lg, key="p50_us"), 0),
            ]
    lines = [
        (
            f"Model: add_sub (2 × FP32[16] in, a + b and a − b out; one CPU instance), "
            f"reference-servers/models/add_sub for dlserve and Triton, reference-servers/mlserver "
            f"(runtimes.AddSub, default parallel workers = 1) for MLServer. Sweeps: "
            f"`--concurrency-range {plan.sweep}`."
        ),
        "",
        (
            "**perf_analyzer** (NVIDIA's C++ client; it cannot drive MLServer: it needs the model-config "
            "and statistics endpoints MLServer lacks):"
        ),
        "",
        *table(rows["pa"], served, ["dlserve", "Triton"]),
        "",
        "**dlserve perf** (dlserve's load generator, same flags):",
        "",
        *table(rows["dp"], served, ["dlserve", "Triton", "MLServer"]),
        "",
        (
            f"**tritonclient loadgen** (reference-servers/loadgen.py: Python, one thread and one sync "
            f"client per request in flight, {plan.loadgen_warmup:g} s warm-up + {plan.loadgen_s:g} s; "
            "HTTP with JSON tensors, the one HTTP encoding all three servers take):"
        ),
        "",
        *table(rows["lg"], served, ["dlserve", "Triton", "MLServer"]),
        "",
    ]
    lines += notes(served)
    files = plot_add_sub(served, plots)
    if files:
        lines += [
            "",
            "Latency (p50) against throughput over the concurrency sweep, each server, each client:",
            "",
        ]
        lines += [f"![add_sub {p}]({link}/{f.name})" for p, f in files]
    return lines


def report_loadgen_check(served: dict[str, Served]) -> list[str]:
    lines = [
        (
            "The add_sub sweeps above ran perf_analyzer and dlserve perf one after the other against the "
            "same server with the same flags. If dlserve perf were the bottleneck it would report less "
            "than perf_analyzer; ratio = dlserve perf / perf_analyzer (≥ 1: dlserve perf keeps up). "
            "Client CPU: cores the client kept busy on average over its whole sweep (client and server "
            "share the machine's cores)."
        ),
        "",
        (
            "| server | protocol | concurrency | perf_analyzer infer/s | dlserve perf infer/s | "
            "dlserve perf / perf_analyzer | p50 µs (PA / dlserve perf) | client CPU cores (PA / dlserve perf) |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("dlserve", "Triton"):
        results = served.get(name, Served(name)).results
        for protocol in ("http", "grpc"):
            pa, dp = results.get(f"pa {protocol}"), results.get(f"dp {protocol}")
            if not (
                isinstance(pa, Measurement) and isinstance(dp, Measurement) and pa.ok and dp.ok
            ):
                lines.append(f"| {name} | {protocol} | — | failed | failed | — | — | — |")
                continue
            for level in pa.levels:
                other = dp.at(level.concurrency)
                if other is None:
                    continue
                lines.append(
                    f"| {name} | {protocol} | {level.concurrency} | {level.throughput:,.1f} | "
                    f"{other.throughput:,.1f} | **{other.throughput / level.throughput:.2f}×** | "
                    f"{level.p50_us:,.0f} / {other.p50_us:,.0f} | {pa.cpu_cores:.2f} / {dp.cpu_cores:.2f} |"
                )
    return lines


def report_identity(served: dict[str, Served], plan: Plan) -> list[str]:
    rows: list[Row] = []
    for label, _, _ in identity_cases(plan):
        rows += [
            (f"{label}: infer/s ↑", metric(label), 1),
            (f"{label}: p50 µs ↓", metric(label, key="p50_us"), 0),
        ]
    lines = [
        (
            "Model: identity_fp32 (FP32[-1] in, a copy out; reference-servers/models), perf_analyzer, "
            "concurrency 1. `grpc+sysshm`: inputs and outputs in system shared memory registered with "
            f"the server, so the wire carries no tensor bytes. MiB-sized cases run with "
            f"`-s {plan.big.stability:g}` (the stability check off) and {plan.big.interval_ms} ms windows: "
            "on a small machine they never settle within 30 %. MLServer is not in this section "
            "(perf_analyzer cannot drive it; ../shared/reference/measurements-triton-mlserver.md has "
            "its identity numbers with loadgen: 58 ms at 1 MiB over gRPC, 7.9 s at 64 MiB)."
        ),
        "",
        *table(rows, served, ["dlserve", "Triton"]),
        "",
    ]
    return lines + notes(served)


def report_bytes(served: dict[str, Served], plan: Plan) -> list[str]:
    rows: list[Row] = []
    for label, _ in bytes_cases(plan):
        rows += [
            (f"{label}: infer/s ↑", metric(label), 1),
            (f"{label}: p50 µs ↓", metric(label, key="p50_us"), 0),
        ]
    lines = [
        (
            "Model: string_upper (examples/models: BYTES[-1] in, each element upper-cased out), "
            "perf_analyzer with generated 128-byte strings (`--string-length 128`), N strings per "
            "request. MLServer is not in this section: perf_analyzer cannot drive it and loadgen "
            "sends FP32 only."
        ),
        "",
        *table(rows, served, ["dlserve", "Triton"]),
        "",
    ]
    return lines + notes(served)


def report_bls(served: dict[str, Served], plan: Plan) -> list[str]:
    names = ["dlserve", "Triton"]
    rows: list[Row] = []
    for protocol in ("grpc",) if plan.quick else ("grpc", "http"):
        direct, bls = f"add_sub {protocol}", f"bls_sync {protocol}"
        rows += [
            (f"add_sub {protocol} p50 µs ↓", metric(direct, key="p50_us"), 0),
            (f"bls_sync {protocol} p50 µs ↓", metric(bls, key="p50_us"), 0),
            (
                f"**BLS overhead {protocol}: p50(bls_sync) − p50(add_sub) µs ↓**",
                combine(_minus, metric(bls, key="p50_us"), metric(direct, key="p50_us")),
                0,
            ),
            (
                f"BLS overhead {protocol}, server compute infer µs ↓",
                combine(
                    _minus,
                    metric(bls, key="compute_infer_us"),
                    metric(direct, key="compute_infer_us"),
                ),
                0,
            ),
            (f"add_sub {protocol} infer/s ↑", metric(direct), 1),
            (f"bls_sync {protocol} infer/s ↑", metric(bls), 1),
        ]
    lines = [
        (
            "Models (examples/models, reference-servers/models, benchmarks/models): add_sub; bls_sync "
            "(one blocking BLS call to add_sub per request); identity_fp32; bls_identity (hands its "
            "FP32[-1] INPUT0 to identity_fp32 with a blocking BLS call); repeat (decoupled). "
            "perf_analyzer at concurrency 1; MiB cases with the stability check off. MLServer has no "
            "BLS, decoupled models or Triton-style dynamic batching: these sections are dlserve vs Triton."
        ),
        "",
        "### BLS overhead per call (concurrency 1)",
        "",
        *table(rows, served, names),
    ]
    tiny, big = size(TINY), size(BIG)
    rows = [
        (
            f"identity_fp32 {tiny} grpc+sysshm p50 µs ↓",
            metric(f"identity_fp32 {tiny} grpc+sysshm", key="p50_us"),
            0,
        ),
        (
            f"bls_identity {tiny} grpc+sysshm p50 µs ↓",
            metric(f"bls_identity {tiny} grpc+sysshm", key="p50_us"),
            0,
        ),
        (
            f"BLS overhead {tiny} grpc+sysshm: p50(bls_identity) − p50(identity_fp32) µs ↓",
            combine(
                _minus,
                metric(f"bls_identity {tiny} grpc+sysshm", key="p50_us"),
                metric(f"identity_fp32 {tiny} grpc+sysshm", key="p50_us"),
            ),
            0,
        ),
    ]
    for transport in ("grpc+sysshm",) if plan.quick else ("grpc+sysshm", "grpc"):
        direct, bls = f"identity_fp32 {big} {transport}", f"bls_identity {big} {transport}"
        rows += [
            (f"identity_fp32 {big} {transport} p50 µs ↓", metric(direct, key="p50_us"), 0),
            (f"bls_identity {big} {transport} p50 µs ↓", metric(bls, key="p50_us"), 0),
            (
                f"**bls_identity p50: {big} {transport} / {tiny} grpc+sysshm ↓**",
                combine(
                    _over,
                    metric(bls, key="p50_us"),
                    metric(f"bls_identity {tiny} grpc+sysshm", key="p50_us"),
                ),
                2,
            ),
            (
                f"BLS overhead {big} {transport}: p50(bls_identity) − p50(identity_fp32) µs ↓",
                combine(_minus, metric(bls, key="p50_us"), metric(direct, key="p50_us")),
                0,
            ),
            (
                f"BLS overhead {big} {transport}, server compute infer µs ↓",
                combine(
                    _minus,
                    metric(bls, key="compute_infer_us"),
                    metric(direct, key="compute_infer_us"),
                ),
                0,
            ),
        ]
    lines += [
        "",
        f"### BLS with a {big} FP32 tensor (bls_identity → identity_fp32, concurrency 1)",
        "",
        *table(rows, served, names),
    ]
    rows = [
        ("**responses/s ↑**", streamed("responses_per_s"), 0),
        (f"ms per request ({STREAM_LEN} responses + final), median ↓", streamed("request_ms"), 1),
        ("ms to the first response, median ↓", streamed("first_ms"), 2),
    ]
    lines += [
        "",
        f"### Decoupled streaming: repeat, {STREAM_LEN} responses per request, one gRPC stream",
        "",
        (
            f"tritonclient gRPC stream: `async_stream_infer('repeat', IN=INT32[{STREAM_LEN}], "
            "enable_empty_final_response=True)`, one request at a time, each waited for until its "
            f"flag-only final, for {plan.stream_s:g} s after one checked warm-up request."
        ),
        "",
        *table(rows, served, names),
        "",
    ]
    for name, record in served.items():
        stream = record.results.get("stream")
        if isinstance(stream, dict):
            lines.append(f"{name}: {stream['requests']} requests timed.  ")
        elif stream:
            lines.append(f"**{name} streaming failed:** {stream}  ")
    return lines + notes(served)


def report_batching(served: dict[str, Served], plan: Plan) -> list[str]:
    rows: list[Row] = []
    for label, _ in batching_cases(plan):
        rows += [
            (f"{label}: infer/s ↑", metric(label), 1),
            (f"{label}: p50 µs ↓", metric(label, key="p50_us"), 0),
            (f"{label}: average batch (server) ↑", metric(label, key="batch"), 2),
            (f"{label}: execute() calls/s", metric(label, key="executions_per_s"), 0),
        ]
    lines = [
        (
            "Model: benchmarks/models/add_sub_batched (add_sub over FP32[-1, 16], `max_batch_size: 16`, "
            "`dynamic_batching { }`, one instance; each execute() joins its requests' inputs, waits a "
            "fixed 2 ms -- a stand-in for a per-call cost such as a kernel launch -- and splits the answer). "
            "perf_analyzer at concurrency 16, batch size 1 per request. Average batch = Δ inference_count "
            "/ Δ execution_count from the server's statistics extension around the perf_analyzer run. "
            "Without batching this model peaks at 500 infer/s."
        ),
        "",
        *table(rows, served, ["dlserve", "Triton"]),
        "",
    ]
    return lines + notes(served)


# ---------------------------------------------------------------- plots


def plot_add_sub(served: dict[str, Served], plots: Path) -> list[tuple[str, Path]]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log("matplotlib missing: no plots (pip install matplotlib)")
        return []
    plots.mkdir(parents=True, exist_ok=True)
    colors = {"dlserve": "tab:blue", "Triton": "tab:green", "MLServer": "tab:orange"}
    styles = {
        "pa": ("-", "o", "perf_analyzer"),
        "dp": ("--", "s", "dlserve perf"),
        "lg": (":", "^", "loadgen"),
    }
    files = []
    for protocol, shown in (("http", "HTTP"), ("grpc", "gRPC")):
        fig, ax = plt.subplots(figsize=(8, 5))
        drawn = False
        for name, record in served.items():
            for tool, (style, marker, tool_name) in styles.items():
                if tool == "lg":
                    ms = [record.results.get(f"lg {protocol} c{c}") for c in (1, 16)]
                    levels = [m.levels[0] for m in ms if isinstance(m, Measurement) and m.ok]
                else:
                    m = record.results.get(f"{tool} {protocol}")
                    levels = m.levels if isinstance(m, Measurement) and m.ok else []
                if not levels:
                    continue
                drawn = True
                x, y = [lv.throughput for lv in levels], [lv.p50_us / 1000 for lv in levels]
                label = f"{name} · {tool_name}" + (
                    " (JSON)" if tool == "lg" and protocol == "http" else ""
                )
                ax.plot(x, y, linestyle=style, marker=marker, color=colors.get(name), label=label)
                for lv, xi, yi in zip(levels, x, y):
                    ax.annotate(
                        f"c{lv.concurrency}",
                        (xi, yi),
                        textcoords="offset points",
                        xytext=(4, 3),
                        fontsize=7,
                        color=colors.get(name),
                    )
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("throughput (inferences/s)")
        ax.set_yscale("log")  # MLServer's latencies are an order of magnitude above the others
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_ylabel("p50 latency (ms, log scale)")
        ax.set_title(f"add_sub over {shown}: latency vs throughput, concurrency sweep")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = plots / f"add_sub_{protocol}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append((shown, path))
    return files


# ---------------------------------------------------------------- the whole report


def machine_lines(info: dict[str, str], served_all: dict[str, dict[str, Served]]) -> list[str]:
    versions = {}
    for served in served_all.values():
        for name, record in served.items():
            if record.version:
                versions[name] = record.version
    lines = ["| | |", "|---|---|"]
    for key, value in info.items():
        if key in versions and key != "dlserve":
            value = f"{versions[key]} ({value})" if value != versions[key] else value
        lines.append(f"| {key} | {value} |")
    return lines


def render(
    plan: Plan,
    chosen: list[str],
    served_all: dict[str, dict[str, Served]],
    info: dict[str, str],
    out: Path,
    took: dict[str, float],
    command: str,
    started: datetime.datetime,
) -> str:
    plots = out.parent / "plots"
    link = "plots"
    total = sum(took.values())
    lines = [
        "# dlserve side by side with Triton and MLServer",
        "",
        (
            f"Made by `{command}` on {started:%Y-%m-%d %H:%M} UTC in {total / 60:.1f} minutes"
            f"{' (--quick: fewer levels, sizes and cases, shorter windows)' if plan.quick else ''}."
        ),
        "",
        (
            "Every section serves the same models (the same unmodified Triton Python model files) from "
            "dlserve and from each peer, one server after the other, each started fresh for the section on "
            "free loopback ports, and measures them with the same client and the same flags in this one run."
        ),
        "",
        (
            "**Reading the tables.** Ratio = dlserve / peer. Rows ending in ↑ are better higher "
            "(throughput: a ratio above 1 means dlserve is faster); rows ending in ↓ are better lower "
            "(latency: a ratio below 1 means dlserve is faster). † = no measurement was stable within the "
            "stability percentage, measured again with the check off. Client and server share the machine's "
            "cores, so the numbers are client + server on this machine, not server capacity; the ratios "
            "are what carries over."
        ),
        "",
        "## Machine",
        "",
        *machine_lines(info, served_all),
        "",
    ]
    reporters: dict[str, Callable[[dict[str, Served]], list[str]]] = {
        "identity": lambda s: report_identity(s, plan),
        "bytes": lambda s: report_bytes(s, plan),
        "bls": lambda s: report_bls(s, plan),
        "batching": lambda s: report_batching(s, plan),
    }
    number = 0
    for key in chosen:
        served = served_all.get(key)
        if served is None:
            continue
        number += 1
        title = sections()[key].title
        lines += [f"## {number}. {title}", "", f"({took.get(key, 0) / 60:.1f} min)", ""]
        if key == "add_sub":
            lines += report_add_sub(served, plan, plots, link)
            number += 1
            lines += [
                "",
                f"## {number}. Is the load generator the bottleneck? dlserve perf vs perf_analyzer",
                "",
            ]
            lines += report_loadgen_check(served)
        else:
            lines += reporters[key](served)
        lines.append("")
    lines += [
        "## Commands",
        "",
        (
            f"`$REF` = {REFERENCE}, `$ANCHORS` = {ANCHORS} (what `$REF/setup.sh` installed), paths "
            f"without a leading / are relative to the repository root; `REPO` = a temporary model "
            "repository assembled for the section from the model folders named there; `$HTTP_PORT`, "
            "`$GRPC_PORT`, `$METRICS_PORT` = free loopback ports picked per server; `OUT.csv` = a "
            "temporary file the numbers are read from. All servers are started with the repository as "
            "the working directory (outside the checkout: its triton_python_backend_utils.py shim must "
            "not shadow Triton's)."
        ),
        "",
        "Servers:",
        "",
    ]
    servers: dict[str, str] = {}
    for served in served_all.values():
        for name, record in served.items():
            servers.setdefault(name, f"- {name}: `{shorten(record.command)}`")
    lines += list(servers.values())
    lines += [
        "",
        (
            "MLServer: `settings.json` written into REPO from `$REF/mlserver/settings.json` with "
            "the free ports; `runtimes.py` copied from `$REF/mlserver`."
        ),
        "",
    ]
    for key in chosen:
        served = served_all.get(key)
        if served is None:
            continue
        lines += [f"Clients, {key} (the same for every server):", "", *command_lines(served)]
        if key == "bls":
            lines.append(f"- streaming: benchmarks/clients.py `streaming(url, {plan.stream_s:g})`")
        if key == "batching":
            lines.append(
                "- statistics: `GET /v2/models/add_sub_batched/stats` before and after each run"
            )
        if key == "add_sub":
            lines.append(
                "- answers checked first with tritonclient (benchmarks/clients.py) in every section"
            )
        lines.append("")
    lines += [peers.SHM_LEDGER.summary() + ".", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smaller run (about 6 minutes on 2 cores)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only these sections ({', '.join(SECTIONS)})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "RESULTS.md",
        help="the report (default: benchmarks/RESULTS.md); plots go to plots/ next to it",
    )
    args = parser.parse_args()
    plan = Plan.make(args.quick)
    chosen = [s for s in SECTIONS if not args.only or s in args.only]
    started = datetime.datetime.now(datetime.timezone.utc)
    command = " ".join([".venv/bin/python benchmarks/run.py", *sys.argv[1:]])
    peers.ensure_peers(mlserver="add_sub" in chosen)
    info = peers.machine()
    served_all: dict[str, dict[str, Served]] = {}
    took: dict[str, float] = {}
    interrupted = False
    with peers.stop_on_sigterm():
        for key in chosen:
            log(f"== {key}")
            begin = time.monotonic()
            served_all[key] = {}
            try:
                run_section(sections()[key], plan, served_all[key])
            except KeyboardInterrupt:
                interrupted = True
                log("interrupted: every server started is stopped; writing what was measured")
            took[key] = time.monotonic() - begin
            log(f"== {key}: {took[key] / 60:.1f} min")
            if interrupted:
                break
    log(peers.SHM_LEDGER.summary())
    if interrupted:
        command += "  (interrupted: incomplete)"
    text = render(plan, chosen, served_all, info, args.out, took, command, started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    log(f"wrote {args.out} (plots in {args.out.parent / 'plots'})")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
