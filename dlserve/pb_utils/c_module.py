"""What Triton's stub puts in its C module ``c_python_backend_utils``, which models import
beside ``triton_python_backend_utils``: for type hints (``List[c_utils.InferenceRequest]``),
for its classes under that name (``c_utils.InferenceResponse``), and for
``c_utils.shared_memory.free_memory()``. The classes are pb_utils' own, as in Triton.
"""

from __future__ import annotations

from dlserve.ipc.runtime import ResponseIterator
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonError, TritonModelException
from dlserve.pb_utils.inference import (
    MEMORY_CPU,
    MEMORY_GPU,
    InferenceRequest,
    InferenceResponse,
    InferenceTrace,
    MemoryType,
    PreferredMemory,
)
from dlserve.pb_utils.logger import Logger
from dlserve.pb_utils.metrics import Metric, MetricFamily, MetricKind
from dlserve.pb_utils.model_control import is_model_ready, load_model, unload_model
from dlserve.pb_utils.sender import InferenceResponseSender
from dlserve.pb_utils.tensor import Tensor

COUNTER = MetricKind.COUNTER
GAUGE = MetricKind.GAUGE
HISTOGRAM = MetricKind.HISTOGRAM
TRITONSERVER_MEMORY_CPU = MEMORY_CPU
TRITONSERVER_MEMORY_GPU = MEMORY_GPU


class SharedMemory:
    """``c_utils.shared_memory``: the shared memory of the model's worker process."""

    def free_memory(self) -> int:
        """Bytes free in the worker's shared-memory arena now (it grows when it must, as
        Triton's does by shm-growth-byte-size); 0 outside a worker."""
        runtime = _runtime.current()
        if runtime is None:
            return 0
        arena = runtime.arena
        return arena.bytes_reserved - arena.bytes_in_use


shared_memory = SharedMemory()

__all__ = [
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "InferenceTrace",
    "Logger",
    "MemoryType",
    "Metric",
    "MetricFamily",
    "MetricKind",
    "PreferredMemory",
    "ResponseIterator",
    "SharedMemory",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "is_model_ready",
    "load_model",
    "shared_memory",
    "unload_model",
]
