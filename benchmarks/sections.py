"""What each section of the benchmark run measures, and running one section against dlserve
and each peer in turn.

A section names the model folders it serves and a ``measure`` function that fills a results
dict (label -> :class:`measure.Measurement`, plus the answer checks under ``"problems"``);
:func:`run_section` serves the models from dlserve, then Triton (then MLServer where it takes
part), each started fresh, and records what each did in a :class:`Served`.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import clients
import measure
import peers
from clients import BIG, STREAM_LEN, TINY, size
from measure import Measurement, Window
from peers import BENCH_MODELS, EXAMPLES, REFERENCE, Server, log

SECTIONS = ("add_sub", "identity", "bytes", "bls", "batching", "cache")
PEERS = ("Triton", "MLServer")


@dataclass
class Plan:
    """How much to measure: the full run or --quick."""

    quick: bool
    sweep: str = "1:16:3"  # --concurrency-range of the add_sub sweeps (1, 4, 7, ... 16)
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
            out[f"pa {protocol}"] = pa_or_perf(measure.perf_analyzer, server, args, plan.small)
            out[f"dp {protocol}"] = pa_or_perf(measure.dlserve_perf, server, args, plan.small)
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
            measure.dlserve_perf, server, add_sub_args("grpc", plan), plan.small
        )
    for protocol in ("http", "grpc"):
        for c in (1, 16):
            m = measure.loadgen(
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
        out[label] = pa_or_perf(
            measure.perf_analyzer, server, args, plan.big if big else plan.small
        )


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
        out[label] = pa_or_perf(measure.perf_analyzer, server, args, plan.small)


def bls_cases(plan: Plan) -> list[tuple[str, list[str], bool]]:
    """(label, perf_analyzer arguments, big); the label names the protocol."""
    out = []
    for protocol in ("grpc",) if plan.quick else ("grpc", "http"):
        for model in ("add_sub", "bls_sync", "bls_sync_inline", "ensemble_add_sub"):
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
    problems = clients.check_add_sub(
        url, ("add_sub", "bls_sync", "bls_sync_inline", "ensemble_add_sub"), n=4
    )
    problems += clients.check_identity(url, ("bls_identity",), (TINY, BIG))
    out["problems"] = problems
    for label, args, big in bls_cases(plan):
        out[label] = pa_or_perf(
            measure.perf_analyzer, server, args, plan.big if big else plan.small
        )
    out["stream"] = clients.streaming(url, plan.stream_s)
    stream = out["stream"]
    shown = (
        f"{stream['responses_per_s']:,.0f} responses/s"
        if isinstance(stream, dict)
        else f"FAILED {stream}"
    )
    log(f"    {server.name:8s} stream        repeat, {STREAM_LEN} responses per request: {shown}")


BATCHING_MODELS = ("add_sub_batched", "add_sub_unbatched")  # the same model with and without


def perf_cases(plan: Plan, models: tuple[str, ...], concurrency: str, suffix: str = "") -> list[tuple[str, list[str]]]:
    """(label, perf_analyzer arguments) for each model over HTTP and gRPC (gRPC only with --quick)."""
    return [
        (f"{model} {protocol}{suffix}", ["-m", model, "-i", protocol, "--concurrency-range", concurrency])
        for model in models
        for protocol in (("grpc",) if plan.quick else ("http", "grpc"))
    ]


def batching_cases(plan: Plan) -> list[tuple[str, list[str]]]:
    return perf_cases(plan, BATCHING_MODELS, "16", " c16")


def measured_with_stats(server: Server, args: list[str], plan: Plan) -> tuple[Measurement, dict[str, int]]:
    """A perf_analyzer run and how the model's statistics moved during it."""
    model = args[1]
    before = server.stats(model)
    m = pa_or_perf(measure.perf_analyzer, server, args, plan.small)
    after = server.stats(model)
    return m, {key: after.get(key, 0) - before.get(key, 0) for key in after}


def measure_batching(server: Server, plan: Plan, out: Results) -> None:
    out["problems"] = clients.check_add_sub(server.url("grpc"), BATCHING_MODELS, batched=True)
    for label, args in batching_cases(plan):
        m, moved = measured_with_stats(server, args, plan)
        out[label] = m
        executions = moved.get("execution_count", 0)
        if executions > 0:
            m.extra["batch"] = moved["inference_count"] / executions
            m.extra["executions_per_s"] = executions / m.wall_s
            log(f"    {server.name:8s}               average batch {m.extra['batch']:.2f}")


CACHE_MODELS = ("add_sub", "add_sub_cached")  # the same model without and with the cache
CACHE_BYTES = 1 << 20


def cache_cases(plan: Plan) -> list[tuple[str, list[str]]]:
    return perf_cases(plan, CACHE_MODELS, "1:4:3")


def measure_cache(server: Server, plan: Plan, out: Results) -> None:
    out["problems"] = clients.check_add_sub(server.url("grpc"), CACHE_MODELS)
    for label, args in cache_cases(plan):
        m, moved = measured_with_stats(server, args, plan)
        out[label] = m
        requests = moved.get("cache_hits", 0) + moved.get("inference_count", 0)
        if requests > 0:  # perf_analyzer sends the same inputs every time: all hits but the first
            m.extra["hit_share"] = moved["cache_hits"] / requests
            log(f"    {server.name:8s}               cache hits {m.extra['hit_share']:.1%}")


@dataclass
class Section:
    key: str
    title: str
    sources: list[Path]  # model folders served by dlserve and Triton
    measure: Callable[[Server, Plan, Results], None]  # fills the results as it goes
    mlserver: list[Path] = field(
        default_factory=list
    )  # MLServer model folders (MLServer takes part)
    flags: list[str] = field(default_factory=list)  # for dlserve's and Triton's command lines


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
                "BLS, ensembles and decoupled streaming",
                [
                    EXAMPLES / "add_sub",
                    EXAMPLES / "bls_sync",
                    BENCH_MODELS / "add_sub_inline",
                    BENCH_MODELS / "bls_sync_inline",
                    EXAMPLES / "repeat",
                    ref / "identity_fp32",
                    BENCH_MODELS / "bls_identity",
                    BENCH_MODELS / "ensemble_add_sub",
                ],
                measure_bls,
            ),
            Section(
                "batching",
                "Dynamic batching",
                [BENCH_MODELS / model for model in BATCHING_MODELS],
                measure_batching,
            ),
            Section(
                "cache",
                "Response cache",
                [ref / "add_sub", BENCH_MODELS / "add_sub_cached"],
                measure_cache,
                flags=["--cache-config", f"local,size={CACHE_BYTES}"],
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
        (functools.partial(peers.dlserve, flags=section.flags), section.sources, []),
        (functools.partial(peers.triton, flags=section.flags), section.sources, []),
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
