"""Which Python file a model's workers import: the model's own ``model.py``, or the
``model.py`` of a Python-based backend.

A Python-based backend (Triton's name; vLLM's backend is one) is a folder
``<backend directory>/<backend>/`` holding a ``model.py`` that every model whose config
says ``backend: "<backend>"`` runs. Such a model's version folders hold its data (a
``model.json``, weights), which the backend's code finds through
``pb_utils.get_model_dir()``. Their config's ``runtime`` is ``model.py``, as Triton
shows it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlserve.errors import InvalidArgumentError, UnsupportedError

if TYPE_CHECKING:  # (the command line imports this module before the engine)
    from dlserve.engine.model import ModelVersion
    from dlserve.engine.proto import model_config_pb2 as mc

PYTHON_BACKEND = "python"
DEFAULT_BACKEND_DIRECTORY = "/opt/tritonserver/backends"  # tritonserver's default
BACKEND_RUNTIME = "model.py"  # a Python-based backend's file, its models' ``runtime``


def backend_model_file(config: mc.ModelConfig, model_name: str, backend_directory: str) -> Path | None:
    """The Python-based backend's file that the (non-ensemble) model runs, or None
    when it runs each version's own file (backend "python"). Raises for a model
    dlserve cannot serve, naming the model and what it asks for."""
    backend = config.backend
    if backend == PYTHON_BACKEND:
        return None
    if not backend:  # (a platform of another framework, e.g. tensorflow_savedmodel)
        raise UnsupportedError(
            f"model '{model_name}': dlserve serves Python models only (backend \"python\", "
            f"or a Python-based backend) and ensembles of them, this config asks for "
            f"'{config.platform}'"
        )
    if config.runtime not in ("", BACKEND_RUNTIME):
        # (Triton's stub would run the backend's model.py whatever this names)
        raise UnsupportedError(
            f"model '{model_name}': runtime '{config.runtime}' is not served: a Python-based "
            f"backend runs its {BACKEND_RUNTIME}; set runtime to '{BACKEND_RUNTIME}' or leave it out"
        )
    if backend in (".", "..") or "/" in backend or "\0" in backend:  # (a name, never a path out)
        raise InvalidArgumentError(f"model '{model_name}': backend '{backend}' is not a backend's name")
    path = Path(backend_directory) / backend / BACKEND_RUNTIME
    if path.is_file():
        return path
    # (Triton's words, then where dlserve looked)
    raise InvalidArgumentError(
        f"unable to find backend library for backend '{backend}', try specifying runtime on "
        f"the model configuration. (dlserve serves Python models only, backend \"python\" or a "
        f"Python-based backend, and {path} is not a file; the backend directory is set with "
        "--backend-directory)"
    )


def code_paths(code_file: Path, model_path: Path) -> dict[str, str]:
    """How a worker's INIT and AUTO_COMPLETE messages name the code to import
    (``model_file``) and the model's own file, ``<model>/<version>/model.py``, whose
    folder ``pb_utils.get_model_dir()`` answers (``model_path``, which a model of a
    Python-based backend need not have)."""
    return {"model_file": str(code_file), "model_path": str(model_path)}


def init_message(model: ModelVersion, kind: str, instance_name: str, device_id: int) -> dict[str, Any]:
    """A worker's INIT message for an instance of ``model``: the code to import and
    exactly the ``args`` keys Triton passes to ``initialize``."""
    return {
        **code_paths(model.code_file, model.model_file),
        "args": {
            "model_config": json.dumps(model.config_json, separators=(",", ":")),
            "model_instance_kind": kind,
            "model_instance_name": instance_name,
            "model_instance_device_id": str(device_id),
            "model_repository": str(model.model_dir),
            "model_version": str(model.version),
            "model_name": model.name,
        },
    }


__all__ = [
    "BACKEND_RUNTIME",
    "DEFAULT_BACKEND_DIRECTORY",
    "PYTHON_BACKEND",
    "backend_model_file",
    "code_paths",
    "init_message",
]
