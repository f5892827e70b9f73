"""Loading and unloading models from inside a model (server in explicit control mode)."""

from __future__ import annotations

from dlserve.ipc.protocol import Kind
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonModelException

_FAILED = {  # (Triton's words for each call the server refuses)
    "load": "Failed to load model",
    "unload": "Failed to unload model",
    "ready": "Failed to check model readiness",
}


def _call(operation: str, *arguments: object) -> object:
    runtime = _runtime.current()
    if runtime is None:
        raise TritonModelException(f"{operation} is only available inside a dlserve worker")
    try:
        return runtime.request(Kind.MODEL_CONTROL, (operation, arguments))
    except TritonModelException as exc:
        raise _runtime.failure(_FAILED[operation], str(exc)) from None


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) ``model_name``; ``config`` is a JSON model config overriding
    config.pbtxt and ``files`` maps ``"file:<version>/<name>"`` to the file's bytes."""
    if not isinstance(model_name, str):
        raise TritonModelException("load_model needs a model name")
    if not isinstance(config, str):
        raise TritonModelException("load_model config must be a JSON string")
    checked: dict[str, bytes] = {}
    for key, content in (files or {}).items():
        if not isinstance(key, str) or not isinstance(content, (bytes, bytearray)):
            raise TritonModelException("load_model files must map 'file:<path>' strings to bytes")
        checked[key] = bytes(content)
    _call("load", model_name, config, checked)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    if not isinstance(model_name, str):
        raise TritonModelException("unload_model needs a model name")
    _call("unload", model_name, bool(unload_dependents))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    if not isinstance(model_name, str):
        raise TritonModelException("is_model_ready needs a model name")
    if not model_name:
        return False  # (no model has no name: Triton answers False too)
    return bool(_call("ready", model_name, str(model_version)))
