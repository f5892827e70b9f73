"""The ``dlserve perf`` subcommand: perf_analyzer's flags, checked into :class:`Settings`.

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
from typing import Any, NoReturn

from dlserve import __version__
from dlserve.perf.flags import (
    UsageError,
    int_at_least,
    non_negative_float,
    parse_composing_models,
    parse_concurrency_range,
    parse_header,
    parse_id_range,
    parse_percentile,
    parse_periodic_range,
    parse_protocol,
    parse_rate_range,
    parse_request_parameter,
    parse_shape,
    positive_float,
    read_intervals,
)

DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001"}

EPILOG = """\
examples:
  dlserve perf -m add_sub                                   # HTTP, concurrency 1
  dlserve perf -m add_sub -i grpc --concurrency-range 1:16:4 -f out.csv
  dlserve perf -m identity --shape INPUT0:1024 --shared-memory system
  dlserve perf -m add_sub --request-rate-range 500:2000:500 --request-distribution poisson
  dlserve perf -m add_sub -i inprocess --model-repository tests/models

exit status (perf_analyzer's): 0 done, 2 the first level never became stable,
99 anything else (bad flags, a request failed, no server).
"""
# Request parameters dlserve perf sets itself (sequences, decoupled streams).
RESERVED_PARAMETERS = {"sequence_id", "sequence_start", "sequence_end", "triton_enable_empty_final_response"}
UNSTABLE = 2  # perf_analyzer's exit status when no measurement became stable
FAILED = 99  # and for any error, bad flags included


class _PerfArgumentParser(argparse.ArgumentParser):
    """Ends a bad command line with perf_analyzer's exit status (99), not argparse's 2:
    scripts read 2 as "not stable, try again"."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(FAILED, f"{self.prog}: error: {message}\n")


class _PrintVersion(argparse.Action):
    """perf_analyzer's ``--version``: its version line (with dlserve's version) on stderr,
    exit status 0, whatever else the command line holds."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> NoReturn:
        parser.exit(0, f"Perf Analyzer Version {__version__} (commit unknown)\n")


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
    input_data: str = "random"
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
    progress: bool = True
    verbose: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the parser ------------------------------------------------------------------------------
def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Register ``perf`` on the ``dlserve`` subparsers."""
    perf = commands.add_parser(
        "perf",
        help="benchmark a model over HTTP, gRPC or in-process (perf_analyzer's flags and output)",
        description="Measure throughput and latency of a model the way perf_analyzer does: "
        "measurement windows until the last 3 agree, per concurrency or request rate.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    perf.__class__ = _PerfArgumentParser  # (add_parser makes every subcommand's parser of one class)
    perf.set_defaults(perf_parser=perf)
    perf.add_argument("--version", action=_PrintVersion,
                      help="print perf_analyzer's version line (with dlserve's version) and exit")
    target = perf.add_argument_group("target")
    target.add_argument("-m", "--model-name", dest="model", required=True, metavar="MODEL",
                        help="the model to benchmark")
    target.add_argument("-x", "--model-version", dest="version", default="", metavar="VERSION",
                        help="model version (default: the server's choice, normally the latest)")
    target.add_argument("-u", "--url", default=None, metavar="HOST:PORT",
                        help="server address (default: localhost:8000 for HTTP, localhost:8001 for gRPC)")
    target.add_argument("-i", "--protocol", type=parse_protocol, default="http", metavar="http|grpc|inprocess",
                        help="http, grpc, or inprocess (dlserve's in-process API, no network) (default: http)")
    target.add_argument("--model-repository", action="append", default=[], metavar="PATH",
                        help="model repository for -i inprocess (repeatable)")
    target.add_argument("--bls-composing-models", type=parse_composing_models, default=[],
                        metavar="NAME[:VERSION],...",
                        help="models the benchmarked one calls (BLS): their server statistics are "
                        "reported below its own, and written to a CSV each beside -f's")

    load = perf.add_argument_group("load")
    load.add_argument("--concurrency-range", type=parse_concurrency_range, default=None, metavar="START:END:STEP",
                      help="requests kept in flight, swept from START to END (default: 1); "
                      "END 0 grows until --latency-threshold")
    load.add_argument("--periodic-concurrency-range", type=parse_periodic_range, default=None,
                      metavar="START:END:STEP",
                      help="decoupled models, with --streaming and --profile-export-file: START requests, "
                      "then STEP more each time every one of the latest has had --request-period "
                      "responses, until END requests in all; each request is sent once, and the run "
                      "writes only the profile export (no windows, no report)")
    load.add_argument("--request-period", type=int_at_least(1), default=10, metavar="N",
                      help="--periodic-concurrency-range: responses each request must have before "
                      "the next STEP requests go out (default: 10)")
    load.add_argument("--request-rate-range", type=parse_rate_range, default=None, metavar="START:END:STEP",
                      help="requests per second, swept from START to END (open loop)")
    load.add_argument("--request-intervals", default=None, metavar="FILE",
                      help="open loop: the time between requests, from FILE (microseconds, one per line, "
                      "used in turn and again from the top)")
    load.add_argument("--request-distribution", choices=["constant", "poisson"], default="constant",
                      help="time between requests in request-rate mode (default: constant)")
    load.add_argument("-b", "--batch-size", type=int_at_least(1), default=1, metavar="N",
                      help="batch size of each request (default: 1)")
    load.add_argument("--max-threads", type=int_at_least(1), default=16, metavar="N",
                      help="most requests in flight in request-rate mode (default: 16)")
    load.add_argument("--processes", type=int_at_least(1), default=1, metavar="N",
                      help="spread the load over N worker processes, results merged (default: 1)")
    load.add_argument("--streaming", action="store_true",
                      help="gRPC only: send requests on ModelStreamInfer streams (one per slot)")
    load.add_argument("--grpc-transport", choices=["h2", "grpcio"], default="h2",
                      help="gRPC unary calls on dlserve perf's own lean HTTP/2 connection (h2) or "
                      "through grpcio (grpcio; --streaming always uses grpcio) (default: h2)")
    load.add_argument("--ssl-grpc-use-ssl", dest="ssl_grpc", action="store_true",
                      help="gRPC over TLS (with the files below, PEM)")
    load.add_argument("--ssl-grpc-root-certifications-file", dest="ssl_grpc_root_certs", default="", metavar="FILE",
                      help="the server's root certificates (default: the system's)")
    load.add_argument("--ssl-grpc-private-key-file", dest="ssl_grpc_private_key", default="", metavar="FILE",
                      help="the client's private key (mutual TLS)")
    load.add_argument("--ssl-grpc-certificate-chain-file", dest="ssl_grpc_cert_chain", default="", metavar="FILE",
                      help="the client's certificate chain (mutual TLS)")
    load.add_argument("--grpc-compression-algorithm", dest="grpc_compression", choices=["none", "gzip", "deflate"],
                      default="none", help="compress gRPC requests (default: none)")
    load.add_argument("-a", "--async", dest="async_mode", action="store_true",
                      help="requests are always asynchronous (asyncio); as in perf_analyzer, a level "
                      "is then stable when its throughput is (as with --streaming)")
    load.add_argument("--sync", action="store_true",
                      help="a level is stable when its latency is too, also for sequence models "
                      "(perf_analyzer's synchronous mode; requests still go out through asyncio)")

    sequences = perf.add_argument_group(
        "sequence models", "used when the model has sequence_batching: each request is a step of a sequence"
    )
    sequences.add_argument("--sequence-length", type=int_at_least(1), default=None, metavar="N",
                           help="requests per sequence (default: 20; with a JSON data file, each "
                           "stream of the file whole)")
    sequences.add_argument("--sequence-length-variation", type=non_negative_float, default=20.0, metavar="PCT",
                           help="sequence lengths vary at random by up to this percentage (default: 20)")
    sequences.add_argument("--sequence-id-range", type=parse_id_range, default=(1, 0), metavar="START[:END]",
                           help="sequence IDs from START, wrapping before END (default: 1, no end)")
    sequences.add_argument("--num-of-sequences", type=int_at_least(1), default=4, metavar="N",
                           help="request-rate mode: live sequences the requests are spread over (default: 4)")
    sequences.add_argument("--serial-sequences", action="store_true",
                           help="request-rate mode: at most one request of a sequence in flight "
                           "(without it a sequence's requests may overtake each other on the way)")

    data = perf.add_argument_group("input data")
    data.add_argument("--shape", type=parse_shape, action="append", default=[], metavar="NAME:D1,D2,...",
                      help="shape of an input with variable dimensions, without the batch dimension (repeatable)")
    data.add_argument("--input-data", default="random", metavar="zero|random|FILE.json",
                      help="zeros, random values, or a perf_analyzer JSON data file (default: random)")
    data.add_argument("--string-length", type=int_at_least(0), default=128, metavar="N",
                      help="length of generated BYTES elements (default: 128)")
    data.add_argument("--string-data", default=None, metavar="TEXT",
                      help="use TEXT for every generated BYTES element")
    data.add_argument("--input-tensor-format", choices=["binary", "json"], default="binary",
                      help="HTTP: send inputs as binary data or as JSON (servers without Triton's "
                      "binary extension, e.g. MLServer, need json; default: binary)")
    data.add_argument("--output-tensor-format", choices=["binary", "json"], default="binary",
                      help="HTTP: ask for outputs as binary data or as JSON (default: binary)")
    data.add_argument("--shared-memory", choices=["none", "system", "cuda"], default="none",
                      help="pass inputs and outputs through registered shared memory (default: none)")
    data.add_argument("--output-shared-memory-size", type=int_at_least(1), default=102400, metavar="BYTES",
                      help="shared memory for each output (default: 102400)")
    data.add_argument("--request-parameter", type=parse_request_parameter, action="append", default=[],
                      metavar="NAME:VALUE:TYPE",
                      help="a request parameter for the model, TYPE bool, int or string (repeatable; "
                      "HTTP, gRPC and in-process)")
    data.add_argument("-H", dest="headers", type=parse_header, action="append", default=[], metavar="NAME:VALUE",
                      help="an HTTP header added to every inference request (repeatable; ignored for gRPC)")

    measure = perf.add_argument_group("measurement")
    measure.add_argument("-p", "--measurement-interval", type=int_at_least(1), default=5000, metavar="MS",
                         help="measurement window in milliseconds (default: 5000)")
    measure.add_argument("--measurement-mode", choices=["time_windows", "count_windows"], default="time_windows",
                         help="windows of --measurement-interval, or of --measurement-request-count "
                         "requests (default: time_windows)")
    measure.add_argument("--measurement-request-count", type=int_at_least(1), default=50, metavar="N",
                         help="requests per window in count_windows mode (default: 50)")
    measure.add_argument("-s", "--stability-percentage", type=positive_float, default=10.0, metavar="PCT",
                         help="the last 3 windows must agree within this percentage (default: 10)")
    measure.add_argument("--request-count", type=int_at_least(0), default=0, metavar="N",
                         help="count_windows mode with windows of N requests (perf_analyzer's; 0: off)")
    measure.add_argument("--binary-search", action="store_true",
                         help="search START:END for the highest level within --latency-threshold by "
                         "halving the range (STEP: the precision) instead of trying every level")
    measure.add_argument("-r", "--max-trials", type=int_at_least(3), default=10, metavar="N",
                         help="most windows per level before giving up on stability (>= 3; default: 10)")
    measure.add_argument("--percentile", type=parse_percentile, default=-1, metavar="P",
                         help="stabilise on and report this latency percentile (default: -1, the average)")
    measure.add_argument("--warmup-request-count", type=int_at_least(0), default=0, metavar="N",
                         help="requests sent and discarded before measuring (default: 0)")
    measure.add_argument("-l", "--latency-threshold", type=int_at_least(0), default=0, metavar="MS",
                         help="stop the sweep once latency passes this (default: 0, no limit)")

    output = perf.add_argument_group("output")
    output.add_argument("-f", "--latency-report-file", dest="csv_file", default=None, metavar="FILE.csv",
                        help="write perf_analyzer's CSV")
    output.add_argument("--verbose-csv", action="store_true",
                        help="add perf_analyzer's Avg latency, request/response and response wait columns")
    output.add_argument("--json", dest="json_file", default=None, metavar="FILE.json",
                        help="write every result as JSON")
    output.add_argument("--plot", dest="plot_file", default=None, metavar="FILE.png",
                        help="plot latency against throughput over the sweep (needs matplotlib: "
                        "pip install 'dlserve[plot]')")
    output.add_argument("--profile-export-file", default=None, metavar="FILE.json",
                        help="write every measured request (times, inputs, outputs) in perf_analyzer's "
                        "profile export format; FILE must not exist yet")
    output.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no live progress line on stderr (it is off anyway when stderr is not a terminal)")
    output.add_argument("-v", "--verbose", action="store_true", help="print every measurement window")
    return perf


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
    if unbounded and not args.latency_threshold:
        raise UsageError("--concurrency-range with end 0 needs --latency-threshold (where to stop)")
    if args.binary_search and (intervals is not None or unbounded or end <= start):
        raise UsageError("--binary-search needs a range with an end above its start to search")
    protocol = args.protocol
    if args.grpc_compression != "none" and protocol != "grpc":
        raise UsageError("--grpc-compression-algorithm is for -i grpc")
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
        from dlserve.perf.shm import cuda_problem

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
    input_data = args.input_data
    if input_data not in ("zero", "random"):
        if os.path.isdir(input_data):
            raise UsageError(f"--input-data: '{input_data}' is a directory; give a JSON file, zero or random")
        if not os.path.isfile(input_data):
            raise UsageError(f"--input-data: expected zero, random or a JSON file; '{input_data}' does not exist")
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
