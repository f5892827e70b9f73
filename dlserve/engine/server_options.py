"""The options of the in-process :class:`~dlserve.engine.server.Server`, modelled on
``tritonserver.Options``, and what they become: the engine's settings."""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

from dlserve.engine.backends import DEFAULT_BACKEND_DIRECTORY
from dlserve.engine.core import EngineSettings
from dlserve.engine.logs import LogSettings
from dlserve.engine.manager import ModelControlMode
from dlserve.engine.metrics_settings import MetricsSettings
from dlserve.engine.rate_limiter import RateLimiterResource, parse_resource
from dlserve.engine.response_cache import cache_size
from dlserve.engine.tracing import TraceSettings
from dlserve.errors import InvalidArgumentError, UnsupportedError

_MIB = 1 << 20

# tritonserver.Options fields dlserve does not act on: refused when set where they would
# change what the server does, a warning where they only tune Triton's C++ core.
_REFUSED = ("host_policies", "model_load_device_limits", "repo_agent_directory")
_IGNORED = (
    "pinned_memory_pool_size", "cuda_memory_pool_sizes", "min_supported_compute_capability",
    "buffer_manager_thread_count", "enable_peer_access",
    "cache_directory",
)


# The backend_configuration["python"] keys dlserve acts on; Triton's others (stub-timeout-seconds,
# shm-message-queue-size, shm-region-prefix-name: dlserve names its segments per server) are
# accepted with a warning.
_PYTHON_BACKEND_KEYS = {"shm-default-byte-size", "shm-growth-byte-size"}

# The Options fields of these types, and what each takes (see Options._check_types).
_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool, int),
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "str | None": (str, type(None)),
}


class RateLimitMode(enum.IntEnum):
    OFF = 0
    EXEC_COUNT = 1


class LogFormat(enum.IntEnum):
    DEFAULT = 0
    ISO8601 = 1


@dataclasses.dataclass
class Options:
    """Server options; names and defaults follow ``tritonserver.Options``.

    dlserve reads these Triton fields: model_repository, server_id,
    model_control_mode, startup_models, strict_model_config, exit_on_error,
    strict_readiness, exit_timeout, model_load_retry_count, model_load_thread_count
    (models loaded at once at startup and by polling), model_namespacing
    (:mod:`dlserve.engine.manager`), rate_limiter_mode and
    rate_limiter_resources (``RateLimiterResource(name, count, device=None)`` or
    ``"NAME:COUNT[:DEVICE]"``), cache_config
    (``{"local": {"size": <bytes>}}``: the response cache), log_file,
    log_info/warn/error, log_verbose, metrics, cpu_metrics, gpu_metrics,
    metrics_interval (ms between refreshes of nv_cpu_*), metrics_configuration
    (``{"": {KEY: VALUE}}``, ``--metrics-config`` keys: :mod:`dlserve.engine.metrics_settings`), and
    ``backend_configuration["python"]`` keys ``shm-default-byte-size`` and
    ``shm-growth-byte-size`` (each worker's shared-memory arena), backend_directory
    (where Python-based backends are: :mod:`dlserve.engine.backends`). Of the rest,
    those that would change what the server does (``host_policies``,
    ``model_load_device_limits``, ``repo_agent_directory``) are
    refused when set, and the tuning knobs of Triton's C++ core are accepted with a
    warning that they do nothing here. ``model_config_name`` is tritonserver's
    ``--model-config-name`` (``<model>/configs/<name>.pbtxt`` where a model has
    one, else its config.pbtxt). dlserve's own: ``shm_arena_size`` sizes the
    server's arena for request inputs; ``repository_poll_secs`` sets the POLL period;
    ``busy_poll_us`` is the most the server and the models' workers poll for an
    expected message before they sleep (:mod:`dlserve.ipc.polling`; 0 = never);
    ``model_load_timeout`` is how many seconds an instance may take to start (its
    worker's start, the import of model.py, ``initialize``, warmup) or a model's
    ``auto_complete_config`` to run, after which its worker is ended and the load fails
    with where the model's code was (0 = no limit, as in Triton);
    ``trace`` holds tritonserver's ``--trace-config`` settings (:mod:`dlserve.engine.tracing`).
    """

    model_repository: str | list[str] = dataclasses.field(default_factory=list)
    server_id: str = "dlserve"
    model_control_mode: ModelControlMode = ModelControlMode.NONE
    startup_models: list[str] = dataclasses.field(default_factory=list)
    strict_model_config: bool = False
    rate_limiter_mode: RateLimitMode = RateLimitMode.OFF
    rate_limiter_resources: list[Any] = dataclasses.field(default_factory=list)
    pinned_memory_pool_size: int = 1 << 28
    cuda_memory_pool_sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    cache_config: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    cache_directory: str = ""
    min_supported_compute_capability: float = 6.0
    exit_on_error: bool = True
    strict_readiness: bool = True
    exit_timeout: int = 30
    buffer_manager_thread_count: int = 0
    model_load_thread_count: int = 4
    model_load_retry_count: int = 0
    model_namespacing: bool = False
    model_config_name: str = ""
    enable_peer_access: bool = True
    log_file: str | None = None
    log_info: bool = False
    log_warn: bool = False
    log_error: bool = True  # (tritonserver's is False: in-process errors are logged unless asked not to)
    log_format: LogFormat = LogFormat.DEFAULT
    log_verbose: int = 0
    metrics: bool = True
    gpu_metrics: bool = True
    cpu_metrics: bool = True
    metrics_interval: int = 2000
    backend_directory: str = DEFAULT_BACKEND_DIRECTORY
    repo_agent_directory: str = ""
    model_load_device_limits: list[Any] = dataclasses.field(default_factory=list)
    backend_configuration: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    host_policies: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    metrics_configuration: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    shm_arena_size: int = 64 * _MIB
    repository_poll_secs: float = 15.0
    busy_poll_us: int = 1000
    model_load_timeout: float = 0.0
    trace: TraceSettings = dataclasses.field(default_factory=TraceSettings)

    def _without_effect(self) -> list[str]:
        """The fields set that dlserve ignores; raises for those it refuses."""
        defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                    for f in dataclasses.fields(self)}
        for name in _REFUSED:
            if getattr(self, name) != defaults[name]:
                raise UnsupportedError(f"Options.{name} is not supported by dlserve")
        python_keys = sorted(set(self.backend_configuration.get("python", {})) - _PYTHON_BACKEND_KEYS)
        return [f"Options.{name}" for name in _IGNORED if getattr(self, name) != defaults[name]] + [
            f"python backend setting '{key}'" for key in python_keys
        ]

    def _check_types(self) -> None:
        """Wrong types are TypeErrors, as tritonserver's Options raise them (its C++
        bindings take a bool, int, float or str field as pybind11 converts it: an int
        for a bool, an int for a float, never a str or a float for an int)."""
        for field in dataclasses.fields(self):
            accepted = _SCALAR_TYPES.get(str(field.type))
            value = getattr(self, field.name)
            if accepted is not None and not isinstance(value, accepted):
                raise TypeError(f"{field.name} must be a {field.type}, got {type(value).__name__}")

    def _worker_arena(self) -> tuple[int, int]:
        """A worker's first shared-memory segment and each one it adds, in bytes: the
        Python backend's shm-default-byte-size (16 MiB unless set) and shm-growth-byte-size
        (unless set, the first one's size). Values tritonserver would fail every load over
        are refused here."""
        python = self.backend_configuration.get("python", {})

        def size(key: str, default: int) -> int:
            try:
                return int(python.get(key, default))
            except ValueError:
                raise InvalidArgumentError(f"{key} must be an integer") from None

        worker_bytes = size("shm-default-byte-size", 16 * _MIB)
        growth_bytes = size("shm-growth-byte-size", worker_bytes)
        if worker_bytes < _MIB:
            raise InvalidArgumentError("shm-default-byte-size must be at least 1 MiB")
        if growth_bytes <= 0:  # (Triton's words)
            raise InvalidArgumentError(
                "shm-growth-byte-size can't be smaller than or equal to zero."
            )
        return worker_bytes, growth_bytes

    def engine_settings(self) -> EngineSettings:
        without_effect = self._without_effect()
        repos = self.model_repository
        self._check_types()  # (before any value check)
        if repos is not None and not isinstance(repos, (str, os.PathLike, list, tuple)):
            raise TypeError(f"model_repository must be a path or a list of paths, got {type(repos).__name__}")
        if repos is None:
            raise InvalidArgumentError("Model repository must be specified.")
        repositories = [repos] if isinstance(repos, str) else [str(r) for r in repos]
        repositories = list(dict.fromkeys(repositories))  # the same path twice is one, as in Triton
        worker_bytes, growth_bytes = self._worker_arena()
        if self.exit_timeout < 0:
            raise InvalidArgumentError("exit_timeout must be >= 0")
        if self.model_load_retry_count < 0:
            raise InvalidArgumentError("model_load_retry_count must be >= 0")
        if self.model_load_thread_count < 1:
            raise InvalidArgumentError("model_load_thread_count must be >= 1")
        if not 0 <= self.busy_poll_us <= 10_000:
            raise InvalidArgumentError("busy_poll_us must be between 0 and 10000")
        if not self.model_load_timeout >= 0:  # (NaN too)
            raise InvalidArgumentError("model_load_timeout must be >= 0")
        self.trace.values()  # raises on a bad setting
        return EngineSettings(
            model_repositories=repositories,
            server_id=self.server_id,
            control_mode=ModelControlMode(self.model_control_mode),
            startup_models=list(self.startup_models),
            auto_complete=not self.strict_model_config,
            strict_readiness=self.strict_readiness,
            exit_on_error=self.exit_on_error,
            exit_timeout=float(self.exit_timeout),
            poll_interval=float(self.repository_poll_secs),
            arena_bytes=int(self.shm_arena_size),
            worker_arena_bytes=worker_bytes,
            worker_arena_growth_bytes=growth_bytes,
            busy_poll_us=int(self.busy_poll_us),
            model_config_name=self.model_config_name,
            backend_directory=str(self.backend_directory),
            model_load_retry_count=int(self.model_load_retry_count),
            model_load_timeout=float(self.model_load_timeout),
            model_load_thread_count=int(self.model_load_thread_count),
            model_namespacing=bool(self.model_namespacing),
            response_cache_bytes=cache_size(self.cache_config),
            rate_limit_resources=self._rate_limit_resources(),
            without_effect=without_effect,
            log=self.log_settings(),
            trace=self.trace,
            metrics=MetricsSettings.from_options(self.metrics_interval, self.metrics_configuration),
        )

    def _rate_limit_resources(self) -> list[RateLimiterResource] | None:
        """The rate limiter's explicit pool sizes; None when rate limiting is off."""
        if RateLimitMode(self.rate_limiter_mode) is RateLimitMode.OFF:
            return None
        pools = []
        for entry in self.rate_limiter_resources:
            if isinstance(entry, str):
                entry = parse_resource(entry)
            elif not isinstance(entry, RateLimiterResource):  # tritonserver's, or alike
                entry = RateLimiterResource(entry.name, int(entry.count), getattr(entry, "device", None))
            pools.append(entry)
        return pools

    def log_settings(self) -> LogSettings:
        """Each severity switched on or off by its own flag, as in Triton (``log_info``
        off and ``log_verbose`` 1: verbose lines, no info lines)."""
        return LogSettings(
            log_file=self.log_file or "",
            log_info=self.log_info,
            log_warning=self.log_warn,
            log_error=self.log_error,
            log_verbose_level=max(0, int(self.log_verbose)),  # (Triton shows a negative one as 0)
            log_format="ISO8601" if self.log_format == LogFormat.ISO8601 else "default",
        )
