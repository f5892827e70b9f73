"""The ``dlserve perf`` subcommand: perf_analyzer's flags (parsed by
:mod:`dlserve.perf.parser`), checked into :class:`Settings`.

Every bad value ends the command with perf_analyzer's exit status for errors (99) and a
one-line reason, the way argparse reports its own errors (``dlserve perf: error: ...``).
Importing this module is cheap: the benchmark's machinery is imported when the command
runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from dlserve.perf.flags import UsageError, read_intervals

DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001"}
DEFAULT_METRICS_URL = "localhost:8002/metrics"  # (perf_analyzer's defaults)
DEFAULT_METRICS_INTERVAL_MS = 1000

# Request parameters dlserve perf sets itself (sequences, decoupled streams).
RESERVED_PARAMETERS = {"sequence_id", "sequence_start", "sequence_end", "triton_enable_empty_final_response"}



@dataclasses.dataclass
class Settings:
    """Everything the benchmark needs, checked."""

    model: str
    version: str = ""
    protocol: str = "http"
    url: str = "localhost:8000"
    model_repository: list[str] = dataclasses.field(default_factory=list)
    batch_size: int = 1
    mode: str = "concurrency"  # or "request_rate"
    levels: list[float] = dataclasses.field(default_factory=lambda: [1])
    # --periodic-concurrency-range (start, end, step): one run instead of levels (dlserve.perf.periodic)
    periodic_range: tuple[int, int, int] | None = None
    request_period: int = 10  # --request-period: the answers each request has before the next step
    sweep_unbounded: bool = False  # --concurrency-range start:0 -> grow until the latency limit
    sweep_step: float = 1
    binary_search: bool = False  # --binary-search: the levels between START and END, halving
    distribution: str = "constant"
    request_intervals_us: list[float] | None = None  # --request-intervals: the gaps, in turn
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    input_data: str | list[str] = "random"  # zero, random, or JSON files (their data in turn)
    string_length: int = 128
    string_data: str | None = None
    json_inputs: bool = False  # --input-tensor-format json (HTTP)
    json_outputs: bool = False  # --output-tensor-format json (HTTP)
    shared_memory: str = "none"
    output_shm_size: int = 102400
    request_parameters: dict[str, bool | int | str] = dataclasses.field(default_factory=dict)
    bls_composing_models: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, version)
    http_headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    streaming: bool = False
    # --async or --streaming (or a sequence model without --sync): stable means the
    # throughput is (perf_analyzer's rule there)
    throughput_only: bool = False
    sync: bool = False
    # Sequence models (dlserve.perf.sequences); sequence_length None: 20, or a JSON file's streams
    sequence_length: int | None = None
    sequence_length_variation: float = 20.0
    sequence_id_start: int = 1
    sequence_id_end: int = 0  # excluded; 0: no end
    num_sequences: int = 4
    serial_sequences: bool = False
    grpc_transport: str = "h2"
    grpc_compression: str = "none"
    ssl_grpc: bool = False  # --ssl-grpc-use-ssl, with the files below (PEM)
    ssl_grpc_root_certs: str = ""
    ssl_grpc_private_key: str = ""
    ssl_grpc_cert_chain: str = ""
    measurement_interval_ms: int = 5000
    count_windows: int = 0  # count_windows mode: a window ends once this many requests ended
    request_count: int = 0  # --request-count: one window of exactly this many requests, all sent
    stability_percentage: float = 10.0
    max_trials: int = 10
    percentile: int = -1
    warmup_request_count: int = 0
    latency_threshold_ms: int = 0
    max_threads: int = 16
    processes: int = 1
    csv_file: str | None = None
    verbose_csv: bool = False
    json_file: str | None = None
    plot_file: str | None = None
    profile_export_file: str | None = None
    collect_metrics: bool = False  # --collect-metrics (dlserve.perf.gpu_metrics)
    metrics_url: str = DEFAULT_METRICS_URL
    metrics_interval_ms: int = DEFAULT_METRICS_INTERVAL_MS
    progress: bool = True
    verbose: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _sweep(start: Any, end: Any, step: Any) -> list[Any]:
    if end == 0:
        return [start]
    values = []
    index = 0
    while True:
        value = start + index * step
        if value > end + (1e-9 * max(1.0, abs(end)) if isinstance(value, float) else 0):
            break
        values.append(round(value, 9) if isinstance(value, float) else value)
        index += 1
    return values


def _url(protocol: str, url: str | None) -> str:
    if protocol == "inprocess":
        return ""
    text = (url or DEFAULT_URLS[protocol]).strip()
    for scheme in ("http://", "grpc://"):
        if text.lower().startswith(scheme):
            text = text[len(scheme):]
    if text.lower().startswith("https://"):
        raise UsageError("-u: https is not supported")
    text = text.rstrip("/")
    if "/" in text:
        raise UsageError(f"-u: expected HOST:PORT, got '{url}' (a path prefix is not supported)")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"-u: expected HOST:PORT, got '{url}'")
    return text


def _check_periodic(args: argparse.Namespace) -> None:
    """--periodic-concurrency-range's needs (perf_analyzer's, in its words), and the flags
    of a sweep it has no use for (perf_analyzer takes those and writes nothing)."""
    if not args.streaming:
        raise UsageError("the --periodic-concurrency-range option requires bi-directional gRPC streaming")
    if args.profile_export_file is None:
        raise UsageError("must provide --profile-export-file when using the --periodic-concurrency-range option")
    unused = {"-f": args.csv_file, "--json": args.json_file, "--plot": args.plot_file,
              "--binary-search": args.binary_search, "--processes above 1": args.processes != 1}
    for flag, given in unused.items():
        if given:
            raise UsageError(f"{flag} cannot be used with --periodic-concurrency-range "
                             "(one run, written to --profile-export-file only)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Check the flags together; raise :class:`UsageError` for combinations that cannot work."""
    load_modes = (args.concurrency_range, args.periodic_concurrency_range, args.request_rate_range,
                  args.request_intervals)
    if sum(mode is not None for mode in load_modes) > 1:  # (perf_analyzer's words)
        raise UsageError("cannot specify more than one inference load mode. Please choose only one of the "
                         "following modes: --concurrency-range, --periodic-concurrency-range, "
                         "--request-rate-range, or --request-intervals")
    if args.async_mode and args.sync:
        raise UsageError("-a/--async and --sync cannot be used together")
    intervals = None
    if args.periodic_concurrency_range is not None:
        _check_periodic(args)
    if args.request_intervals is not None:
        intervals = read_intervals(args.request_intervals)
        rate = 1e6 * len(intervals) / sum(intervals)
        mode, (start, end, step) = "request_rate", (rate, rate, 1)
    elif args.request_rate_range is not None:
        mode, (start, end, step) = "request_rate", args.request_rate_range
    else:
        mode, (start, end, step) = "concurrency", args.concurrency_range or (1, 1, 1)
    unbounded = mode == "concurrency" and end == 0
    if args.request_count and intervals is None:  # (perf_analyzer's rules, in its words)
        kind = "concurrency" if mode == "concurrency" else "request-rate"
        if args.request_count < start:
            raise UsageError(f"request-count can not be less than {kind}")
        if end != start or args.periodic_concurrency_range is not None:
            raise UsageError(f"request-count not supported with multiple {kind} values in one run")
    if unbounded and not args.latency_threshold:
        raise UsageError("--concurrency-range with end 0 needs --latency-threshold (where to stop)")
    if args.binary_search and (intervals is not None or unbounded or end <= start):
        raise UsageError("--binary-search needs a range with an end above its start to search")
    protocol = args.protocol
    if args.grpc_compression != "none" and protocol != "grpc":
        raise UsageError("--grpc-compression-algorithm is for -i grpc")
    for flag, value in (("--metrics-url", args.metrics_url), ("--metrics-interval", args.metrics_interval)):
        if value is not None and not args.collect_metrics:  # (perf_analyzer's words)
            raise UsageError(f"must specify --collect-metrics when using the {flag} option")
    if args.metrics_url is not None and protocol == "inprocess":
        raise UsageError("--metrics-url is for a server over the network (in-process: the server's own)")
    files = (args.ssl_grpc_root_certs, args.ssl_grpc_private_key, args.ssl_grpc_cert_chain)
    if (args.ssl_grpc or any(files)) and protocol != "grpc":
        raise UsageError("--ssl-grpc-* are for -i grpc")
    if any(files) and not args.ssl_grpc:
        raise UsageError("--ssl-grpc-* files need --ssl-grpc-use-ssl")
    if bool(args.ssl_grpc_private_key) != bool(args.ssl_grpc_cert_chain):
        raise UsageError("mutual TLS needs both --ssl-grpc-private-key-file and --ssl-grpc-certificate-chain-file")
    for path in files:
        if path and not os.path.isfile(path):
            raise UsageError(f"--ssl-grpc-*: '{path}' does not exist")
    if protocol == "inprocess":
        if not args.model_repository:
            raise UsageError("-i inprocess needs --model-repository PATH")
        if args.url:
            raise UsageError("-u has no meaning with -i inprocess")
        if args.processes != 1:
            raise UsageError("--processes must be 1 with -i inprocess (the server lives in this process)")
    elif args.model_repository:
        raise UsageError("--model-repository is for -i inprocess only")
    if args.streaming and protocol != "grpc":
        raise UsageError("--streaming needs -i grpc (it uses gRPC ModelStreamInfer)")
    if protocol != "http" and "json" in (args.input_tensor_format, args.output_tensor_format):
        raise UsageError("--input-tensor-format/--output-tensor-format json are for -i http")
    if args.shared_memory == "cuda":
        if protocol == "inprocess":
            raise UsageError("--shared-memory cuda is not supported with -i inprocess")
        from dlserve.memory.cuda import cuda_problem

        problem = cuda_problem()
        if problem:
            raise UsageError(f"--shared-memory cuda needs CUDA: {problem}")
    if args.version.strip() and not args.version.strip().isdigit():
        raise UsageError(f"-x: a model version is a non-negative integer, got '{args.version}'")
    shapes: dict[str, list[int]] = {}
    for name, shape in args.shape:
        if name in shapes and shapes[name] != shape:
            raise UsageError(f"--shape: two different shapes for input '{name}'")
        shapes[name] = shape
    parameters = dict(args.request_parameter)
    reserved = sorted(set(parameters) & RESERVED_PARAMETERS)
    if reserved:
        raise UsageError(f"--request-parameter: {', '.join(reserved)} is set by dlserve perf itself")
    given = args.input_data or ["random"]
    # JSON files, every one in turn, win over zero and random (perf_analyzer's rule)
    files = [path for path in given if path not in ("zero", "random")]
    input_data = files or given[-1]
    for path in files:
        if not os.path.isfile(path) and not os.path.isdir(path):
            raise UsageError(f"--input-data: expected zero, random, a JSON file or a directory; "
                             f"'{path}' does not exist")
        if os.path.isdir(path) and len(given) > 1:  # (perf_analyzer refuses it with zero or random)
            raise UsageError(f"--input-data: '{path}' is a directory, which must be the only "
                             "--input-data")
    if args.plot_file:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed: pip install 'dlserve[plot]'"
            ) from None
    export = args.profile_export_file
    if export == "":
        raise UsageError("--profile-export-file: expected a file path")
    if export is not None and os.path.lexists(export):
        raise UsageError(f"--profile-export-file: '{export}' already exists (perf_analyzer's rule: a new path)")
    outputs = (("-f", args.csv_file), ("--json", args.json_file), ("--plot", args.plot_file),
               ("--profile-export-file", export))
    for flag, path in outputs:
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise UsageError(f"{flag}: folder '{folder}' does not exist")
    return Settings(
        model=args.model,
        version=args.version.strip(),
        protocol=protocol,
        url=_url(protocol, args.url),
        model_repository=list(args.model_repository),
        batch_size=args.batch_size,
        mode=mode,
        levels=[start, end] if args.binary_search else _sweep(start, end, step),
        periodic_range=args.periodic_concurrency_range,
        request_period=args.request_period,
        sweep_unbounded=unbounded,
        sweep_step=step,
        binary_search=args.binary_search,
        distribution=args.request_distribution,
        request_intervals_us=intervals,
        shapes=shapes,
        input_data=input_data,
        string_length=args.string_length,
        string_data=args.string_data,
        json_inputs=args.input_tensor_format == "json",
        json_outputs=args.output_tensor_format == "json",
        shared_memory=args.shared_memory,
        output_shm_size=args.output_shared_memory_size,
        request_parameters=parameters,
        bls_composing_models=list(args.bls_composing_models),
        http_headers=list(args.headers),
        streaming=args.streaming,
        throughput_only=args.async_mode or args.streaming,
        sync=args.sync,
        sequence_length=args.sequence_length,
        sequence_length_variation=args.sequence_length_variation,
        sequence_id_start=args.sequence_id_range[0],
        sequence_id_end=args.sequence_id_range[1],
        num_sequences=args.num_of_sequences,
        serial_sequences=args.serial_sequences,
        grpc_transport=args.grpc_transport,
        grpc_compression=args.grpc_compression,
        ssl_grpc=args.ssl_grpc,
        ssl_grpc_root_certs=args.ssl_grpc_root_certs,
        ssl_grpc_private_key=args.ssl_grpc_private_key,
        ssl_grpc_cert_chain=args.ssl_grpc_cert_chain,
        measurement_interval_ms=args.measurement_interval,
        count_windows=args.request_count or (
            args.measurement_request_count if args.measurement_mode == "count_windows" else 0
        ),
        request_count=args.request_count,
        stability_percentage=args.stability_percentage,
        max_trials=args.max_trials,
        percentile=args.percentile,
        warmup_request_count=args.warmup_request_count,
        latency_threshold_ms=args.latency_threshold,
        max_threads=args.max_threads,
        processes=args.processes,
        csv_file=args.csv_file,
        verbose_csv=args.verbose_csv,
        json_file=args.json_file,
        plot_file=args.plot_file,
        profile_export_file=export,
        collect_metrics=args.collect_metrics,
        metrics_url=args.metrics_url or DEFAULT_METRICS_URL,
        metrics_interval_ms=args.metrics_interval or DEFAULT_METRICS_INTERVAL_MS,
        progress=args.progress and sys.stderr.isatty(),
        verbose=args.verbose,
    )


def run(args: argparse.Namespace) -> int:
    """The handler of ``dlserve perf``: check the flags, run the benchmark, report."""
    parser: argparse.ArgumentParser = args.perf_parser
    try:
        settings = settings_from_args(args)
    except UsageError as exc:
        parser.error(str(exc))  # exits 99
    from dlserve.perf.profile import main

    return main(settings)
