"""``dlserve``: the command line. ``dlserve serve`` takes tritonserver's main flags.

Boolean flags accept tritonserver's forms: ``--allow-http=false``, ``--allow-http false``
and a bare ``--allow-http`` (true). With no ``--model-repository`` it serves the
example models bundled in the checkout. SIGTERM or SIGINT stops accepting requests,
lets in-flight ones finish (up to ``--exit-timeout-secs``), then ends every worker.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlserve import perf
from dlserve.engine.backends import DEFAULT_BACKEND_DIRECTORY

if TYPE_CHECKING:
    from dlserve.engine.tracing import TraceSettings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "models"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _bool_flag(group: Any, name: str, default: bool, help_text: str) -> None:
    group.add_argument(
        name, type=boolean, nargs="?", const=True, default=default, metavar="BOOL",
        help=f"{help_text} (default: {str(default).lower()})",
    )


def _port(text: str) -> int:
    value = int(text) if text.strip().lstrip("+-").isdigit() else None
    if value is None or not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be an integer in [0, 65535], got {text!r}")
    return value


# Vertex AI runs a custom container with AIP_MODE=PREDICTION (tritonserver then serves
# Vertex AI's routes instead of HTTP and gRPC by default).
VERTEX_MODE = os.environ.get("AIP_MODE") == "PREDICTION"


_EVERY_INTERFACE = "(default: 0.0.0.0, every interface)"


def _hosted_flags(
    serve: argparse.ArgumentParser, title: str, name: str, allow: bool, help_text: str, port_variable: str
) -> Any:
    """A managed-hosting protocol's --allow-NAME, --NAME-address and --NAME-port."""
    group = serve.add_argument_group(title)
    _bool_flag(group, f"--allow-{name}", allow, help_text)
    group.add_argument(f"--{name}-address", default="0.0.0.0", help=_EVERY_INTERFACE)
    group.add_argument(f"--{name}-port", type=_port, default=None, help=f"(default: {port_variable}, else 8080)")
    return group


def _hosted_service(service_class: Any, server: Any, args: argparse.Namespace, name: str, **options: Any) -> Any:
    """The service for --allow-NAME, its port from --NAME-port if given (else its Options' default)."""
    settings = service_class.Options(
        address=getattr(args, f"{name}_address"), max_input_size=args.http_max_input_size,
        allow_client_shm=args.allow_client_shm, **options,
    )
    port = getattr(args, f"{name}_port")
    if port is not None:
        settings.port = port
    return service_class(server, settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlserve",
        description="dlserve: a zero-copy inference server for Triton Python-backend models.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve model repositories over KServe v2 HTTP/gRPC with Prometheus metrics",
        description="Serve Triton Python-backend model repositories (flags follow tritonserver).",
    )
    models = serve.add_argument_group("models")
    models.add_argument(
        "--model-repository", "--model-store", action="append", default=[], metavar="PATH",
        help="model repository folder or s3:// URL; repeat for several (default: the bundled examples)",
    )
    models.add_argument(
        "--model-control-mode", type=str.lower, choices=["none", "poll", "explicit"], default="none",
        help="none: load everything at start; poll: also follow repository changes; "
        "explicit: load only --load-model, then use the load/unload API (default: none)",
    )
    models.add_argument(
        "--load-model", action="append", default=[], metavar="NAME",
        help="model to load at start in explicit mode; '*' loads all (repeatable)",
    )
    models.add_argument("--repository-poll-secs", type=float, default=15.0, metavar="SECONDS",
                        help="repository scan period in poll mode (default: 15; 0: no scans after "
                        "the first, as in tritonserver)")
    models.add_argument("--model-config-name", default=None, metavar="NAME",
                        help="load <model>/configs/NAME.pbtxt instead of config.pbtxt where a "
                        "model has it")
    models.add_argument("--model-load-retry-count", type=int, default=0, metavar="N",
                        help="start a model that failed to start up to N more times (default: 0)")
    models.add_argument("--model-load-timeout-secs", type=float, default=0.0, metavar="SECONDS",
                        help="end an instance whose worker takes longer to start (model.py's "
                        "import, initialize, warmup) or to run auto_complete_config, and fail its "
                        "load with where the model's code was (default: 0, no limit)")
    models.add_argument("--model-load-thread-count", type=int, default=4, metavar="N",
                        help="load up to N models at once at startup and on repository scans "
                        "(default: 4)")
    models.add_argument("--disable-auto-complete-config", action="store_true",
                        help="do not run the models' auto_complete_config")
    _bool_flag(models, "--strict-model-config", False, "deprecated spelling of --disable-auto-complete-config")
    _bool_flag(models, "--strict-readiness", True, "server is ready only when every model is ready")
    _bool_flag(models, "--model-namespacing", False, "each repository is a namespace: a model name may "
               "appear in several (an ensemble's steps are taken from its own)")
    models.add_argument(
        "--exit-on-error", type=boolean, nargs="?", const=True, default=None, metavar="BOOL",
        help="exit when a model fails to load at start-up (default: true; false when serving "
        "the bundled examples, whose frameworks may not be installed)",
    )
    models.add_argument("--exit-timeout-secs", type=int, default=30, metavar="SECONDS",
                        help="how long shutdown waits for in-flight requests (default: 30)")
    models.add_argument(
        "--backend-directory", default=DEFAULT_BACKEND_DIRECTORY, metavar="DIR",
        help="where Python-based backends are: a model with backend: \"NAME\" (not "
        f"\"python\") runs DIR/NAME/model.py (default: {DEFAULT_BACKEND_DIRECTORY})",
    )
    models.add_argument(
        "--backend-config", action="append", default=[], metavar="python,KEY=VALUE",
        help="python backend settings: shm-default-byte-size, shm-growth-byte-size (settings "
        "for other backends, or for all of them without a name, are accepted and ignored)",
    )
    models.add_argument(
        "--cache-config", action="append", default=[], metavar="local,size=BYTES",
        help="a response cache of BYTES for the models whose config enables response_cache",
    )
    models.add_argument("--response-cache-byte-size", type=int, default=None, metavar="BYTES",
                        help="deprecated spelling of --cache-config local,size=BYTES")
    models.add_argument(
        "--rate-limit", type=str.lower, choices=["off", "execution_count"], default="off",
        help="execution_count: instances execute only when the resources of their instance "
        "group's rate_limiter are free (default: off)",
    )
    models.add_argument(
        "--rate-limit-resource", action="append", default=[], metavar="NAME:COUNT[:DEVICE]",
        help="how many copies of a rate limiter resource exist (default: the most any instance asks for)",
    )
    models.add_argument("--id", default="dlserve", help="server id reported by metadata")
    models.add_argument("--busy-poll-us", type=int, default=1000, metavar="MICROSECONDS",
                        help="the most the server and the models' workers poll for an expected "
                        "message before sleeping; each learns how long pays "
                        "(default: 1000; 0 = never)")

    http = serve.add_argument_group("HTTP")
    _bool_flag(http, "--allow-http", not VERTEX_MODE, "serve KServe v2 HTTP/REST")
    http.add_argument("--http-address", default="0.0.0.0", help=_EVERY_INTERFACE)
    http.add_argument("--http-port", type=_port, default=8000, help="(default: 8000)")
    _bool_flag(http, "--reuse-http-port", False, "SO_REUSEPORT on the HTTP socket")
    http.add_argument("--http-thread-count", type=int, default=8, help="accepted for compatibility")
    http.add_argument("--http-max-input-size", type=int, default=1 << 26, metavar="BYTES",
                      help="largest request body accepted (default: 64 MiB)")
    http.add_argument("--http-header-forward-pattern", default="", metavar="REGEX",
                      help="HTTP headers matching this become request parameters")
    http.add_argument("--http-restricted-api", action="append", default=[], metavar="CATEGORIES:HEADER=VALUE",
                      help="require a header for API categories (repeatable)")
    http.add_argument("--http-max-connections", type=int, default=0, metavar="N",
                      help="most connections held; past it the longest idle one is closed, or the "
                      "new one refused with 503 (default 0: a quarter of the descriptor limit, "
                      "at most 16384)")
    http.add_argument("--http-request-timeout", type=int, default=60, metavar="SECONDS",
                      help="a request's headers must arrive within this of its first byte, and "
                      "its body may not stall this long, or it gets 408 (default 60; 0: no limit)")

    grpc = serve.add_argument_group("gRPC")
    _bool_flag(grpc, "--allow-grpc", not VERTEX_MODE, "serve KServe v2 gRPC")
    grpc.add_argument("--grpc-address", default="0.0.0.0", help=_EVERY_INTERFACE)
    grpc.add_argument("--grpc-port", type=_port, default=8001, help="(default: 8001)")
    _bool_flag(grpc, "--reuse-grpc-port", False, "SO_REUSEPORT on the gRPC socket")
    grpc.add_argument("--grpc-infer-thread-count", type=int, default=2, help="accepted for compatibility")
    grpc.add_argument("--grpc-header-forward-pattern", default="", metavar="REGEX")
    grpc.add_argument("--grpc-restricted-protocol", action="append", default=[], metavar="PROTOCOLS:HEADER=VALUE")
    _bool_flag(grpc, "--grpc-use-ssl", False, "TLS on gRPC")
    _bool_flag(grpc, "--grpc-use-ssl-mutual", False, "mutual TLS on gRPC")
    grpc.add_argument("--grpc-server-cert", default="")
    grpc.add_argument("--grpc-server-key", default="")
    grpc.add_argument("--grpc-root-cert", default="")
    grpc.add_argument("--grpc-max-message-size", type=int, default=2**31 - 1, metavar="BYTES",
                      help="largest gRPC request message (default: 2 GiB - 1, tritonserver's)")
    grpc.add_argument("--grpc-max-connections", type=int, default=0, metavar="N",
                      help="most connections held; past it the longest idle one is closed, or the "
                      "new one refused (default 0: a quarter of the descriptor limit, at most 16384)")
    grpc.add_argument("--grpc-message-timeout", type=int, default=60, metavar="SECONDS",
                      help="a request message begun may not go this long without a byte, or its "
                      "call ends DEADLINE_EXCEEDED (default 60; 0: no limit)")
    for flag, option, default in _GRPC_TUNING:
        grpc.add_argument(flag, type=int, default=default, dest=f"grpc_{option}", metavar="N")
    _bool_flag(grpc, "--grpc-keepalive-permit-without-calls", False, "allow keepalive pings without calls")
    grpc.add_argument("--grpc-infer-response-compression-level", type=str.lower, default="none",
                      choices=list(_COMPRESSION_LEVELS))

    _hosted_flags(serve, "SageMaker", "sagemaker", False,
                  "serve Amazon SageMaker's /ping and /invocations (model: SAGEMAKER_TRITON_DEFAULT_MODEL_NAME, "
                  "else the only one)", "SAGEMAKER_BIND_TO_PORT")
    vertex = _hosted_flags(serve, "Vertex AI", "vertex-ai", VERTEX_MODE,
                           "serve Google Vertex AI's AIP_HEALTH_ROUTE and AIP_PREDICT_ROUTE (on by default, and "
                           "HTTP and gRPC off, when AIP_MODE=PREDICTION)", "AIP_HTTP_PORT")
    vertex.add_argument("--vertex-ai-default-model", default=None, metavar="NAME",
                        help="the predict route's model (default: the one loaded model)")

    metrics = serve.add_argument_group("metrics")
    _bool_flag(metrics, "--allow-metrics", True, "serve Prometheus metrics")
    _bool_flag(metrics, "--allow-cpu-metrics", True, "include CPU utilisation and memory")
    _bool_flag(metrics, "--allow-gpu-metrics", True, "include GPU metrics (nvidia-ml-py, where a GPU exists)")
    metrics.add_argument("--metrics-address", default=None, help="(default: --http-address)")
    metrics.add_argument("--metrics-port", type=_port, default=8002, help="(default: 8002)")
    metrics.add_argument("--metrics-interval-ms", type=float, default=2000.0, metavar="MS",
                         help="how often nv_cpu_* are refreshed (default: 2000)")
    metrics.add_argument("--metrics-config", action="append", default=[], metavar="KEY=VALUE",
                         help="as tritonserver's (repeatable): counter_latencies=true|false, "
                         "summary_latencies=true|false, summary_quantiles=QUANTILE:ERROR[,...], "
                         "histogram_latencies=true|false (accepted, no effect: Triton 2.51 shows no "
                         "latency histograms for Python models); an unknown key is an error")

    shared = serve.add_argument_group("shared memory and logging")
    _bool_flag(shared, "--allow-client-shm", False, "let clients register and use shared memory")
    shared.add_argument("--log-verbose", type=int, default=0, metavar="LEVEL")
    _bool_flag(shared, "--log-info", True, "log info messages")
    _bool_flag(shared, "--log-warning", True, "log warnings")
    _bool_flag(shared, "--log-error", True, "log errors")
    shared.add_argument("--log-format", type=str.lower, choices=["default", "iso8601"], default="default")
    shared.add_argument("--log-file", default="", metavar="PATH")
    shared.add_argument("--trace-config", action="append", default=[], metavar="[MODE,]SETTING=VALUE",
                        help="request tracing, as tritonserver: mode=triton|opentelemetry, "
                        "level=TIMESTAMPS|TENSORS, rate=N, count=N; triton: file=PATH, "
                        "log-frequency=N; opentelemetry,url=HOST:PORT/v1/traces, "
                        "opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_*=N (repeatable)")
    for setting in _OLD_TRACE_FLAGS:  # tritonserver's older spellings, still accepted there
        shared.add_argument(f"--trace-{setting}", action="append", default=[], metavar="VALUE",
                            dest=_old_trace_dest(setting),
                            help=f"deprecated spelling of --trace-config {setting}=VALUE")
    ignored = serve.add_argument_group(
        "accepted for tritonserver's command lines, without effect here (settings of its C++ core)"
    )
    for flag in _IGNORED_FLAGS:
        ignored.add_argument(flag, action="append", default=[], metavar="VALUE",
                             dest=_ignored_dest(flag))
    perf.add_parser(commands)
    return parser


# tritonserver's gRPC tuning flags: (flag, KServeGrpc.Options field, default)
_GRPC_TUNING = (
    ("--grpc-keepalive-time", "keepalive_time_ms", 7_200_000),
    ("--grpc-keepalive-timeout", "keepalive_timeout_ms", 20_000),
    ("--grpc-http2-max-pings-without-data", "http2_max_pings_without_data", 2),
    ("--grpc-http2-min-recv-ping-interval-without-data", "http2_min_recv_ping_interval_without_data_ms", 300_000),
    ("--grpc-http2-max-ping-strikes", "http2_max_ping_strikes", 2),
    ("--grpc-max-connection-age", "max_connection_age_ms", 0),
    ("--grpc-max-connection-age-grace", "max_connection_age_grace_ms", 0),
    ("--grpc-infer-allocation-pool-size", "infer_allocation_pool_size", 8),
    ("--grpc-max-response-pool-size", "max_response_pool_size", 2_147_483_647),
)
_IGNORED_FLAGS = (
    "--cache-directory", "--repoagent-directory", "--pinned-memory-pool-byte-size",
    "--cuda-memory-pool-byte-size", "--cuda-virtual-address-size", "--min-supported-compute-capability",
    "--buffer-manager-thread-count", "--host-policy", "--model-load-gpu-limit",
    "--enable-peer-access", "--sagemaker-safe-port-range",
    "--sagemaker-thread-count", "--vertex-ai-thread-count",
)


def _ignored_dest(flag: str) -> str:
    return "ignored_" + flag.strip("-").replace("-", "_")


def _warn_ignored(args: argparse.Namespace, backend_wide_config: list[str]) -> None:
    log = logging.getLogger("dlserve")
    for flag in _IGNORED_FLAGS:
        if getattr(args, _ignored_dest(flag)):
            log.warning("%s has no effect in dlserve (a setting of Triton's C++ core)", flag)
    for entry in backend_wide_config:
        log.warning("--backend-config %s (for every backend) has no effect in dlserve", entry)
    if args.response_cache_byte_size is not None:
        log.warning("--response-cache-byte-size is deprecated: use --cache-config local,size=BYTES")
    if "mode=opentelemetry" not in _trace_entries(args):
        for entry in args.trace_config:
            if entry.startswith("opentelemetry,"):
                log.warning("--trace-config %s has no effect: the trace mode is triton", entry)


def _grouped_settings(
    flag: str, entries: list[str], form: str, example: str, named: bool = True
) -> dict[str, dict[str, str]]:
    """``NAME,KEY=VALUE`` entries (--backend-config, --cache-config) as {NAME: {KEY: VALUE}};
    with ``named`` False (--metrics-config) NAME may be left out, for "" (a NAME given is
    kept, for the server to refuse) and VALUE may be empty (the server says what is wrong).
    A malformed entry is refused in tritonserver's words (``form``), then an ``example``."""
    config: dict[str, dict[str, str]] = {}
    for entry in entries:
        setting, equals, value = entry.partition("=")
        name, comma, key = setting.partition(",")
        if not comma:
            name, key = "", name
        if not equals or not key or (named and (not name or not value)):
            raise SystemExit(
                f"dlserve: {flag} option format is '{form}'. Got {entry} (for example {example})"
            )
        config.setdefault(name, {})[key] = value
    return config


_TRACE_KEYS = {"file": "file", "level": "level", "rate": "rate", "count": "count",
               "log-frequency": "log_frequency", "mode": "mode"}
# tritonserver's other words for the trace levels
_TRACE_LEVEL_WORDS = {"false": "OFF", "true": "TIMESTAMPS", "on": "TIMESTAMPS", "min": "TIMESTAMPS", "max": "TIMESTAMPS"}
_OLD_TRACE_FLAGS = ("file", "level", "rate", "count", "log-frequency")  # --trace-<setting>


def _old_trace_dest(setting: str) -> str:
    return "trace_" + setting.replace("-", "_")


def _trace_entries(args: argparse.Namespace) -> list[str]:
    """Every trace setting given, the old ``--trace-<setting>`` flags first (as
    ``setting=value``), so that ``--trace-config`` wins where both name one."""
    old = [
        f"{setting}={value}"
        for setting in _OLD_TRACE_FLAGS
        for value in getattr(args, _old_trace_dest(setting))
    ]
    return old + args.trace_config


def _trace_settings(entries: list[str]) -> TraceSettings:
    """``--trace-config`` entries (``[triton,]setting=value``) as TraceSettings."""
    from dlserve.engine.otel import OtelSettings  # the engine loads only to serve
    from dlserve.engine.tracing import TraceSettings

    settings = TraceSettings()
    levels: list[str] = []
    opentelemetry: list[tuple[str, str]] = []  # (used only in that mode, as by tritonserver)
    for entry in entries:
        if entry.startswith("opentelemetry,"):
            key, sep, value = entry.removeprefix("opentelemetry,").partition("=")
            if not sep or not key:  # (tritonserver's words)
                raise SystemExit(
                    "dlserve: --trace-config option format is '<trace mode>,<setting>=<value>'. "
                    f"Got {entry}"
                )
            opentelemetry.append((key, value))
            continue
        mode, _, setting = entry.rpartition(",")
        key, sep, value = setting.partition("=")
        field = _TRACE_KEYS.get(key)
        if mode not in ("", "triton") or not sep or field is None:
            raise SystemExit(
                f"dlserve: --trace-config '{entry}' must look like [MODE,]SETTING=VALUE with MODE "
                f"triton or opentelemetry, and a triton SETTING one of {', '.join(_TRACE_KEYS)}"
            )
        if field == "level":
            levels.append(_TRACE_LEVEL_WORDS.get(value.lower(), value.upper()))
        elif field == "mode" and value not in ("triton", "opentelemetry"):  # (tritonserver's words)
            raise SystemExit(
                f"dlserve: invalid value for trace mode option: {value}. "
                'Available options are "triton" and "opentelemetry"'
            )
        elif field in ("file", "mode"):
            setattr(settings, field, value)
        else:
            try:
                setattr(settings, field, int(value))
            except ValueError:
                raise SystemExit(f"dlserve: --trace-config {key} must be an integer, got '{value}'") from None
    if levels:  # each adds to the others, as in tritonserver (OFF adds nothing)
        settings.level = tuple(dict.fromkeys(level for level in levels if level != "OFF")) or ("OFF",)
    try:
        settings.opentelemetry = OtelSettings(tuple(opentelemetry))
    except ValueError as exc:
        raise SystemExit(f"dlserve: {exc}") from None
    return settings


def raise_descriptor_limit() -> None:
    """Raise the soft limit of open files to the hard one, as most servers do: at the
    usual soft 1024 the connections each listener holds would be bounded at 256
    (dlserve.frontends.connection_cap), and the workers inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # (a hard limit past the kernel's nr_open)
            pass


def serve(args: argparse.Namespace) -> int:
    import dlserve
    from dlserve.engine import logs
    from dlserve.engine.rate_limiter import parse_resource
    from dlserve.frontends import KServeGrpc, KServeHttp, Metrics, SageMaker, VertexAi
    from dlserve.frontends.restrictions import Restriction

    raise_descriptor_limit()
    repositories = args.model_repository
    if not repositories and VERTEX_MODE and os.environ.get("AIP_STORAGE_URI"):
        repositories = [os.environ["AIP_STORAGE_URI"]]  # where Vertex AI put the model
    exit_on_error = True if args.exit_on_error is None else args.exit_on_error
    if not repositories:
        if not EXAMPLES.is_dir():
            raise SystemExit("dlserve: no --model-repository given and no bundled examples found")
        repositories = [str(EXAMPLES)]
        if args.exit_on_error is None:
            exit_on_error = False  # examples whose framework is missing must not stop the rest
    if args.model_config_name == "":  # given, but empty (tritonserver's words)
        raise SystemExit("dlserve: Error: empty argument for --model-config-name")
    if args.load_model and args.model_control_mode != "explicit":  # (Triton's words and status)
        print("Error: Use of '--load-model' requires setting '--model-control-mode=explicit' as well.",
              file=sys.stderr)
        return 1
    for entry in args.rate_limit_resource:  # checked whether or not rate limiting is on
        try:
            parse_resource(entry)
        except dlserve.TritonError as exc:
            print(f"dlserve: --rate-limit-resource: {exc}", file=sys.stderr)
            return 1
    # (KEY=VALUE without a backend: a setting for every backend, which has no effect here)
    backend_config = [e for e in args.backend_config if "," in e or not e.partition("=")[2]]
    cache_config = _grouped_settings(
        "--cache-config", args.cache_config, "<cache name>,<setting>=<value>", "local,size=BYTES"
    )
    if args.response_cache_byte_size is not None:
        if cache_config:  # (Triton's words and exit status)
            print("Error: Incompatible flags --response-cache-byte-size and --cache-config both "
                  "provided. Please provide one or the other.", file=sys.stderr)
            return 1
        cache_config = {"local": {"size": str(args.response_cache_byte_size)}}
    options = dlserve.Options(
        model_repository=repositories,
        server_id=args.id,
        model_control_mode=dlserve.ModelControlMode[args.model_control_mode.upper()],
        startup_models=args.load_model,
        strict_model_config=args.disable_auto_complete_config or args.strict_model_config,
        strict_readiness=args.strict_readiness,
        exit_on_error=exit_on_error,
        exit_timeout=args.exit_timeout_secs,
        log_file=args.log_file or None,
        log_info=args.log_info,
        log_warn=args.log_warning,
        log_error=args.log_error,
        log_verbose=args.log_verbose,
        log_format=dlserve.LogFormat.ISO8601 if args.log_format == "iso8601" else dlserve.LogFormat.DEFAULT,
        backend_configuration=_grouped_settings(
            "--backend-config",
            backend_config,
            "<backend name>,<setting>=<value>",
            "python,KEY=VALUE",
        ),
        cache_config=cache_config,
        rate_limiter_mode=(
            dlserve.RateLimitMode.EXEC_COUNT if args.rate_limit == "execution_count" else dlserve.RateLimitMode.OFF
        ),
        rate_limiter_resources=args.rate_limit_resource,
        repository_poll_secs=args.repository_poll_secs,
        model_config_name=args.model_config_name or "",
        backend_directory=args.backend_directory,
        metrics=args.allow_metrics,
        cpu_metrics=args.allow_cpu_metrics,
        gpu_metrics=args.allow_gpu_metrics,
        metrics_interval=int(args.metrics_interval_ms),
        metrics_configuration=_grouped_settings(
            "--metrics-config", args.metrics_config, "<setting>=<value>", "KEY=VALUE", named=False
        ),
        model_load_retry_count=args.model_load_retry_count,
        model_load_timeout=args.model_load_timeout_secs,
        model_load_thread_count=args.model_load_thread_count,
        model_namespacing=args.model_namespacing,
        busy_poll_us=args.busy_poll_us,
        trace=_trace_settings(_trace_entries(args)),
    )
    logs.log_to_stderr(options.log_settings())  # (a --log-file takes over once the server starts)
    try:  # (checked before any model loads, as Triton checks them)
        Restriction.parse_all(args.http_restricted_api, "api")
        Restriction.parse_all(args.grpc_restricted_protocol, "protocol")
    except dlserve.TritonError as exc:
        print(f"dlserve: {exc}", file=sys.stderr)
        return 1
    _warn_ignored(args, sorted(set(args.backend_config) - set(backend_config)))
    stop = threading.Event()
    server = dlserve.Server(options)

    def on_signal(signum: int, _frame: Any) -> None:
        # tritonserver's line, on its standard output (os.write: print could be the code
        # this handler interrupted)
        with contextlib.suppress(OSError):
            os.write(1, f"Signal ({signum}) received.\n".encode())
        stop.set()
        if server.loading:  # out of a start still loading models: it shuts down what it began
            raise _StopWhileStarting

    def on_stacks_signal(_signum: int, _frame: Any) -> None:
        try:  # (no lock taken here: this handler may interrupt code holding one)
            server.loop.call_soon_threadsafe(server.engine.dump_worker_stacks)
        except (dlserve.TritonError, RuntimeError):  # not started, or stopped: no workers
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # `kill -USR1 <pid>` writes every thread's Python stack to stderr, the server's at once
    # (from faulthandler's C handler, whatever its threads hold), then each worker's: what
    # a server or a model that seems stuck is doing, without stopping anything.
    signal.signal(signal.SIGUSR1, on_stacks_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    try:
        server.start()
    except _StopWhileStarting:
        print("dlserve: stopped while starting", file=sys.stderr)
        return 0
    except dlserve.TritonError as exc:
        print(f"dlserve: {exc}", file=sys.stderr)
        return 1
    log = logging.getLogger("dlserve")
    services: list[Any] = []
    try:
        if args.allow_http:
            services.append(KServeHttp(server, KServeHttp.Options(
                address=args.http_address, port=args.http_port, reuse_port=args.reuse_http_port,
                thread_count=max(args.http_thread_count, 1), header_forward_pattern=args.http_header_forward_pattern,
                max_input_size=args.http_max_input_size, allow_client_shm=args.allow_client_shm,
                restricted_apis=args.http_restricted_api, max_connections=args.http_max_connections,
                request_timeout=args.http_request_timeout,
            )))
        if args.allow_grpc:
            services.append(KServeGrpc(server, KServeGrpc.Options(
                address=args.grpc_address, port=args.grpc_port, reuse_port=args.reuse_grpc_port,
                use_ssl=args.grpc_use_ssl or args.grpc_use_ssl_mutual, use_mutual_auth=args.grpc_use_ssl_mutual,
                server_cert=args.grpc_server_cert, server_key=args.grpc_server_key, root_cert=args.grpc_root_cert,
                infer_thread_count=args.grpc_infer_thread_count, forward_header_pattern=args.grpc_header_forward_pattern,
                max_message_size=args.grpc_max_message_size, allow_client_shm=args.allow_client_shm,
                restricted_protocols=args.grpc_restricted_protocol, max_connections=args.grpc_max_connections,
                message_timeout=args.grpc_message_timeout,
                keepalive_permit_without_calls=args.grpc_keepalive_permit_without_calls,
                infer_compression_level=_COMPRESSION_LEVELS[args.grpc_infer_response_compression_level],
                **{option: getattr(args, f"grpc_{option}") for _, option, _ in _GRPC_TUNING},
            )))
        if args.allow_metrics:
            address = args.metrics_address if args.metrics_address is not None else args.http_address
            services.append(Metrics(server, Metrics.Options(address=address, port=args.metrics_port)))
        if args.allow_vertex_ai:
            services.append(_hosted_service(VertexAi, server, args, "vertex_ai",
                                            default_model=args.vertex_ai_default_model))
        if args.allow_sagemaker:
            services.append(_hosted_service(SageMaker, server, args, "sagemaker"))
        table = _model_table(server.engine.manager.index() if server.engine.manager else [])
        log.info("\n%s\n", "\n".join(table), extra=logs.VERBATIM)  # (as Triton prints its tables)
        for service in services:
            service.start()
            print(f"dlserve: {type(service).__name__} listening on port {service.port}", flush=True)
            # The line scripts wait for, in Triton's words (its gRPC, HTTP and metrics services).
            options = service.options
            log.info("Started %s at %s:%d", service.started_as, options.address, service.port)
    except (dlserve.TritonError, OSError) as exc:
        print(f"dlserve: {exc}", file=sys.stderr)
        server.stop()
        return 1
    print("dlserve: ready" if server.ready() else "dlserve: started (some models are not ready)", flush=True)
    # Woken every 0.1 s: the kernel may hand the signal to another thread (it does after a
    # SIGSTOP), and its handler then runs on this one only once this one runs Python again.
    while not stop.wait(0.1):
        pass
    try:
        server.stop(wait_for_sequences=True)  # open sequences may end; then the services drain
    except dlserve.InternalError as exc:
        log.error("failed to stop server: Internal - %s", exc.message)
        return 1  # (as tritonserver: requests in flight were dropped)
    return 0


# tritonserver's words, any case ("med" too: dlserve took it before it took "medium")
_COMPRESSION_LEVELS = {"none": 0, "low": 1, "medium": 2, "med": 2, "high": 3}


def _model_table(rows: list[dict[str, Any]]) -> list[str]:
    """The repository index as tritonserver's start-up table (Model | Version | Status):
    the models it loaded or tried to (in explicit mode, not the others in the repository)."""
    table = [("Model", "Version", "Status")] + [
        (
            row["name"],
            row.get("version", "-"),
            row["state"]
            + (f": {row['reason']}".splitlines()[0] if row.get("reason") and row["state"] != "READY" else ""),
        )
        for row in rows
        if "state" in row
    ]
    widths = [max(len(cells[i]) for cells in table) for i in range(3)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(cells, widths)) for cells in table]
    return [rule, f"| {lines[0]} |", rule, *(f"| {line} |" for line in lines[1:]), rule]


class _StopWhileStarting(Exception):
    """SIGTERM or SIGINT while the server loads its models."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "perf":
        return perf.run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
