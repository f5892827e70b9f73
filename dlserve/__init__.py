"""dlserve: a zero-copy inference server for Triton Python-backend models.

The in-process API mirrors Triton's ``tritonserver`` package::

    import dlserve
    server = dlserve.Server(dlserve.Options(model_repository="models")).start(wait_until_ready=True)
    for response in server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": b}):
        print(np.from_dlpack(response.outputs["OUTPUT0"]))
    server.stop()

Public names are imported lazily, so a worker process that imports
``dlserve.ipc.stub`` does not pay for the engine, protobuf or the frontends.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelControlMode": "dlserve.engine.manager",
    "InferenceRequest": "dlserve.engine.server_requests",
    "InferenceResponse": "dlserve.engine.server_requests",
    "InstanceGroupKind": "dlserve.engine.server",
    "LogFormat": "dlserve.engine.server_options",
    "Metric": "dlserve.engine.app_metrics",
    "MetricFamily": "dlserve.engine.app_metrics",
    "MetricKind": "dlserve.engine.app_metrics",
    "MetricFormat": "dlserve.engine.server",
    "Model": "dlserve.engine.server",
    "ModelBatchFlag": "dlserve.engine.server",
    "ModelTxnPropertyFlag": "dlserve.engine.server",
    "Options": "dlserve.engine.server_options",
    "RateLimitMode": "dlserve.engine.server_options",
    "RateLimiterResource": "dlserve.engine.rate_limiter",
    "Server": "dlserve.engine.server",
    "TraceSettings": "dlserve.engine.tracing",
    "OtelSettings": "dlserve.engine.otel",
    "AlreadyExistsError": "dlserve.errors",
    "CancelledError": "dlserve.errors",
    "InternalError": "dlserve.errors",
    "InvalidArgumentError": "dlserve.errors",
    "NotFoundError": "dlserve.errors",
    "TritonError": "dlserve.errors",
    "UnavailableError": "dlserve.errors",
    "UnknownError": "dlserve.errors",
    "UnsupportedError": "dlserve.errors",
    "DLDeviceType": "dlserve.memory.dlpack",
    "DataType": "dlserve.memory.dtypes",
    "MemoryAllocator": "dlserve.memory.tensor",
    "MemoryBuffer": "dlserve.memory.tensor",
    "MemoryType": "dlserve.memory.tensor",
    "Tensor": "dlserve.memory.tensor",
    "default_memory_allocators": "dlserve.memory.tensor",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dlserve' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
