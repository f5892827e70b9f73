"""benchmarks/RESULTS.md: one part per section (tables, notes, plots) and the whole document
around them (machine, how to read the tables, the commands)."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from pathlib import Path

import peers
from clients import BIG, STREAM_LEN, TINY, size
from measure import Measurement
from peers import ANCHORS, REFERENCE
from plots import plot_add_sub
from sections import (
    CACHE_BYTES,
    Plan,
    Served,
    batching_cases,
    bytes_cases,
    cache_cases,
    identity_cases,
    sections,
)
from tables import (
    Row,
    combine,
    command_lines,
    metric,
    minus,
    notes,
    over,
    shorten,
    streamed,
    table,
)

# ---------------------------------------------------------------- sections


def report_add_sub(served: dict[str, Served], plan: Plan, plots: Path, link: str) -> list[str]:
    protocols = (("http", "HTTP"), ("grpc", "gRPC"))
    rows: dict[str, list[Row]] = {"pa": [], "dp": [], "lg": []}
    for protocol, shown in protocols:
        for c in (1, 4, 16):  # the targets name concurrency 1 and 4
            for tool in ("pa", "dp"):
                rows[tool] += [
                    (f"{shown} c{c}: infer/s ↑", metric(f"{tool} {protocol}", c), 1),
                    (f"{shown} c{c}: p50 µs ↓", metric(f"{tool} {protocol}", c, "p50_us"), 0),
                ]
        for c in (1, 16):
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


def throughput_and_p50(labels: list[str]) -> list[Row]:
    """Two rows per case: its throughput and its median latency."""
    rows: list[Row] = []
    for label in labels:
        rows += [
            (f"{label}: infer/s ↑", metric(label), 1),
            (f"{label}: p50 µs ↓", metric(label, key="p50_us"), 0),
        ]
    return rows


def report_identity(served: dict[str, Served], plan: Plan) -> list[str]:
    rows = throughput_and_p50([label for label, _, _ in identity_cases(plan)])
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
    rows = throughput_and_p50([label for label, _ in bytes_cases(plan)])
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
        inline = f"bls_sync_inline {protocol}"
        ensemble = f"ensemble_add_sub {protocol}"
        rows += [
            (f"add_sub {protocol} p50 µs ↓", metric(direct, key="p50_us"), 0),
            (f"bls_sync {protocol} p50 µs ↓", metric(bls, key="p50_us"), 0),
            (
                f"**BLS overhead {protocol}: p50(bls_sync) − p50(add_sub) µs ↓**",
                combine(minus, metric(bls, key="p50_us"), metric(direct, key="p50_us")),
                0,
            ),
            (
                f"BLS overhead {protocol}, server compute infer µs ↓",
                combine(
                    minus,
                    metric(bls, key="compute_infer_us"),
                    metric(direct, key="compute_infer_us"),
                ),
                0,
            ),
            (f"add_sub {protocol} infer/s ↑", metric(direct), 1),
            (f"bls_sync {protocol} infer/s ↑", metric(bls), 1),
            (f"bls_sync_inline {protocol} p50 µs ↓", metric(inline, key="p50_us"), 0),
            (
                f"**Inline BLS overhead {protocol}: p50(bls_sync_inline) − p50(add_sub) µs ↓** "
                "(Triton: an ordinary BLS call)",
                combine(minus, metric(inline, key="p50_us"), metric(direct, key="p50_us")),
                0,
            ),
            (
                f"Ensemble overhead {protocol}: p50(ensemble_add_sub) − p50(add_sub) µs ↓",
                combine(minus, metric(ensemble, key="p50_us"), metric(direct, key="p50_us")),
                0,
            ),
            (f"ensemble_add_sub {protocol} infer/s ↑", metric(ensemble), 1),
        ]
    lines = [
        (
            "Models (examples/models, reference-servers/models, benchmarks/models): add_sub; bls_sync "
            "(one blocking BLS call to add_sub per request); identity_fp32; bls_identity (hands its "
            "FP32[-1] INPUT0 to identity_fp32 with a blocking BLS call); ensemble_add_sub (add_sub as a "
            "one-step ensemble: the same call as bls_sync, made by the server); bls_sync_inline "
            "(bls_sync calling add_sub_inline, an add_sub with INLINE_BLS, which dlserve runs in the "
            "caller's worker and Triton, ignoring the parameter, as an ordinary BLS call); repeat (decoupled). "
            "perf_analyzer at concurrency 1; MiB cases with the stability check off. MLServer has no "
            "BLS, ensembles, decoupled models or Triton-style dynamic batching: these sections are "
            "dlserve vs Triton."
        ),
        "",
        "### BLS and ensemble overhead per call (concurrency 1)",
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
                minus,
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
                    over,
                    metric(bls, key="p50_us"),
                    metric(f"bls_identity {tiny} grpc+sysshm", key="p50_us"),
                ),
                2,
            ),
            (
                f"BLS overhead {big} {transport}: p50(bls_identity) − p50(identity_fp32) µs ↓",
                combine(minus, metric(bls, key="p50_us"), metric(direct, key="p50_us")),
                0,
            ),
            (
                f"BLS overhead {big} {transport}, server compute infer µs ↓",
                combine(
                    minus,
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
            *throughput_and_p50([label]),
            (f"{label}: average batch (server) ↑", metric(label, key="batch"), 2),
            (f"{label}: execute() calls/s", metric(label, key="executions_per_s"), 0),
        ]
    lines = [
        (
            "Models: benchmarks/models/add_sub_batched (add_sub over FP32[-1, 16], `max_batch_size: 16`, "
            "`dynamic_batching { }`, one instance; each execute() joins its requests' inputs, waits a "
            "fixed 2 ms -- a stand-in for a per-call cost such as a kernel launch -- and splits the answer) "
            "and add_sub_unbatched, the same model without `dynamic_batching` (one request per execute(), "
            "so at most 500 infer/s). perf_analyzer at concurrency 16, batch size 1 per request. Average "
            "batch = Δ inference_count / Δ execution_count from the server's statistics extension around "
            "the perf_analyzer run."
        ),
        "",
        *table(rows, served, ["dlserve", "Triton"]),
        "",
    ]
    return lines + notes(served)


def report_cache(served: dict[str, Served], plan: Plan) -> list[str]:
    rows: list[Row] = []
    for label, _ in cache_cases(plan):
        for concurrency in (1, 4):
            rows += [
                (f"{label} c{concurrency}: infer/s ↑", metric(label, concurrency), 1),
                (f"{label} c{concurrency}: p50 µs ↓", metric(label, concurrency, "p50_us"), 0),
            ]
        if label.startswith("add_sub_cached"):
            rows.append((f"{label}: answered from the cache (server) ↑", metric(label, key="hit_share"), 4))
    lines = [
        (
            f"Models: add_sub (reference-servers, FP32[16]) and benchmarks/models/add_sub_cached, the same "
            f"model with `response_cache {{ enable: true }}`; both servers run with `--cache-config "
            f"local,size={CACHE_BYTES}`. perf_analyzer sends the same inputs in every request, so every "
            "request to add_sub_cached but the first is a cache hit (the share is read from the "
            "statistics extension's cache_hit and inference counts around the run), while add_sub runs "
            "its model every time. Concurrency 1 and 4."
        ),
        "",
        *table(rows, served, ["dlserve", "Triton"]),
        "",
    ]
    return lines + notes(served)


# ---------------------------------------------------------------- the whole document


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
        "cache": lambda s: report_cache(s, plan),
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
        if key in ("batching", "cache"):
            lines.append(
                "- statistics: `GET /v2/models/$MODEL/stats` before and after each run"
            )
        if key == "add_sub":
            lines.append(
                "- answers checked first with tritonclient (benchmarks/clients.py) in every section"
            )
        lines.append("")
    lines += [peers.SHM_LEDGER.summary() + ".", ""]
    return "\n".join(lines)
