"""``dlserve perf``'s command line: perf_analyzer's flags on an argparse parser.

:mod:`dlserve.perf.cli` checks what this parses into :class:`~dlserve.perf.cli.Settings`.
A bad command line ends with perf_analyzer's exit status for errors (99), not argparse's 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from dlserve import __version__
from dlserve.perf.flags import (
    FAILED,
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
)

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
    data.add_argument("--input-data", action="append", default=None,
                      metavar="zero|random|FILE.json|DIR",
                      help="zeros, random values, a perf_analyzer JSON data file (repeat it for "
                      "several files, whose data is used in turn), or a directory with a file "
                      "per input (raw bytes; BYTES: one element a line) (default: random)")
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
                         help="send exactly N requests and measure them as one window, with no "
                         "stability check: one level only (default: 0, windows until stable)")
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
    output.add_argument("--collect-metrics", action="store_true",
                        help="read the server's GPU gauges (utilization, power, memory) while measuring "
                        "and report them per level (the CSV's with --verbose-csv)")
    output.add_argument("--metrics-url", default=None, metavar="HOST:PORT/PATH",
                        help="where --collect-metrics reads them (default: localhost:8002/metrics; "
                        "in-process: the server's own)")
    output.add_argument("--metrics-interval", type=int_at_least(1), default=None, metavar="MS",
                        help="how often --collect-metrics reads them (default: 1000)")
    output.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no live progress line on stderr (it is off anyway when stderr is not a terminal)")
    output.add_argument("-v", "--verbose", action="store_true", help="print every measurement window")
    return perf
