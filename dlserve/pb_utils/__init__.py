"""The model-facing API of Triton's Python backend (``triton_python_backend_utils``).

Models import it under Triton's name (``import triton_python_backend_utils as
pb_utils``); the top-level shim module re-exports everything here.
"""

from __future__ import annotations

from dlserve.pb_utils.batching import JoinedInputs, join_inputs
from dlserve.pb_utils.errors import TritonError, TritonModelException
from dlserve.pb_utils.helpers import (
    TRITON_STRING_TO_NUMPY,
    deserialize_bytes_tensor,
    get_input_config_by_name,
    get_input_tensor_by_name,
    get_model_dir,
    get_output_config_by_name,
    get_output_tensor_by_name,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
    using_decoupled_model_transaction_policy,
)
from dlserve.pb_utils.inference import (
    MEMORY_CPU,
    MEMORY_GPU,
    RELEASE_ALL,
    RELEASE_RESCHEDULE,
    InferenceRequest,
    InferenceResponse,
    InferenceTrace,
    PreferredMemory,
)
from dlserve.pb_utils.logger import Logger
from dlserve.pb_utils.metrics import MetricFamily
from dlserve.pb_utils.model_config import ModelConfig
from dlserve.pb_utils.model_control import is_model_ready, load_model, unload_model
from dlserve.pb_utils.sender import RESPONSE_COMPLETE_FINAL, InferenceResponseSender
from dlserve.pb_utils.tensor import Tensor

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = RESPONSE_COMPLETE_FINAL
TRITONSERVER_REQUEST_RELEASE_ALL = RELEASE_ALL
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = RELEASE_RESCHEDULE
TRITONSERVER_MEMORY_CPU = MEMORY_CPU
TRITONSERVER_MEMORY_GPU = MEMORY_GPU

__all__ = [
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "InferenceTrace",
    "JoinedInputs",
    "Logger",
    "MetricFamily",
    "ModelConfig",
    "PreferredMemory",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "is_model_ready",
    "join_inputs",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]
