"""A model's code in a worker: imported as Triton imports it, checked and described as
Triton words its failures.

Shared by the worker's own instance (:mod:`dlserve.ipc.stub`) and the private
instances it runs for inline BLS calls (:mod:`dlserve.ipc.inline`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from types import ModuleType
from typing import Any

from dlserve.errors import ErrorCode
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.inference import InferenceRequest, InferenceResponse


class ModelFailure(Exception):
    """Fails every request of one execute call (Triton's batch-level error)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


# What a request gets when its model let it go unanswered, or answered it twice.
ABANDONED = (
    "the model let go of the request without sending its final response: execute "
    "returned None (or the response sender was dropped) before a send with "
    "flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL"
)
ANSWERED_TWICE = (
    "a request was answered both through its response sender and in the list execute returned"
)

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` and where in the model it happened, innermost frame first
    (Triton's layout), without dlserve's own frames or the import machinery's."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith((_PACKAGE_DIR, "<frozen "))
    ]
    where = "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
    head = f"{type(exc).__name__}: {str(exc) or '<EMPTY MESSAGE>'}"  # Triton's words for ''
    return f"{head}\n\nAt:\n{where}" if where else head


def load_module(model_file: str, model_path: str, alias: str | None = None) -> ModuleType:
    """Import the model's code as Triton does. Its own ``model.py`` (``model_file`` is
    ``model_path``) is imported with its version folder and model folder on
    ``sys.path``, as module ``model`` of a package that is its version folder
    (``1.model``), so that its relative imports (``from . import helper``) find the files
    beside it. A Python-based backend's file is imported as top-level module ``model``
    with the backend's folder on ``sys.path``. ``pb_utils.get_model_dir()`` answers
    ``model_path``'s folder either way.

    ``alias`` imports a second model into a worker that has its own (inline BLS): its
    package (or module) gets that name instead, and neither ``sys.modules["model"]``
    nor ``get_model_dir()``'s answer changes."""
    model_file, model_path = os.path.abspath(model_file), os.path.abspath(model_path)
    if alias is None:
        _runtime.model_dir = os.path.dirname(model_path)
    stem = os.path.splitext(os.path.basename(model_file))[0]
    code_dir = os.path.dirname(model_file)
    if model_file == model_path:
        search = (os.path.dirname(code_dir), code_dir)
        package = ModuleType(alias or os.path.basename(code_dir))
        package.__path__ = [code_dir]
        sys.modules[package.__name__] = package
        module_name = f"{package.__name__}.{stem}"
    else:
        search, module_name = (code_dir,), alias or stem
    for path in search:
        if path not in sys.path:
            sys.path.insert(0, path)
    spec = importlib.util.spec_from_file_location(module_name, model_file)
    if spec is None or spec.loader is None:
        raise ModelFailure(f"cannot import {model_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    if alias is None:
        sys.modules["model"] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "TritonPythonModel"):
        raise ModelFailure(f"{model_file} does not define class TritonPythonModel")
    return module


def response_list_problem(responses: Any, requests: list[InferenceRequest]) -> str | None:
    """What is wrong with the list ``execute`` returned for ``requests`` (Triton 2.51's
    words), or None. A None element is the sender's business (see the stub's replies)."""
    expected = len(requests)
    if not isinstance(responses, list):
        return f"Expected a list in the execute return, found type '{type(responses)}'."
    if len(responses) != expected:
        return (
            "Number of InferenceResponse objects do not match the number of "
            f"InferenceRequest objects. InferenceRequest(s) size is:{expected}, "
            f"and InferenceResponse(s) size is:{len(responses)}\n"
        )
    for response, request in zip(responses, requests):
        if response is None:
            continue  # (answered by the sender, rescheduled, or alone)
        if request.rescheduled():  # (Triton's words, its typo included)
            return (
                "Expected a None object in the execute function return list for reschduled "
                f"request, found type '{type(response)}'."
            )
        if not isinstance(response, InferenceResponse):
            return not_a_response(response)
    return None


def not_a_response(element: Any) -> str:
    """What an element of execute's list that is no response gets (Triton 2.51's words)."""
    return (
        "Expected an 'InferenceResponse' object in the execute function return list, "
        f"found type '{type(element)}'."
    )
