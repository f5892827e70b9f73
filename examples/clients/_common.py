"""What the example clients share: where the models are, telling a model whose
framework is not installed (the example is skipped) from one that failed to load,
a KServe frontend for the duration of a block, and tritonclient inputs from arrays."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.utils import np_to_triton_dtype

import dlserve

MODELS = Path(__file__).resolve().parent.parent / "models"


class Skipped(Exception):
    """The example cannot run here: its model needs a framework that is not installed."""


def ready_model(server: dlserve.Server, name: str) -> dlserve.Model:
    """The model ``name`` if it loaded.

    Raises :class:`Skipped` when it did not load because its framework is missing
    (the framework models say "<framework> is not installed; pip install ..."), and
    RuntimeError with the load error for any other reason.
    """
    model = server.model(name)
    if model.ready():
        return model
    reasons = [m.reason for (n, _), m in server.models().items() if n == name and m.reason]
    reason = reasons[0] if reasons else "it is not loaded"
    first_line = reason.splitlines()[0]
    if "is not installed" in first_line:
        # "failed to initialize model instance '...': TritonModelException: torch is not ..."
        raise Skipped(first_line.rsplit("TritonModelException: ", 1)[-1])
    raise RuntimeError(f"model '{name}' is not ready: {reason}")


@contextlib.contextmanager
def frontend(server: dlserve.Server, service_class: type) -> Iterator[str]:
    """A ``KServeHttp`` or ``KServeGrpc`` service in front of ``server`` on a free
    127.0.0.1 port (port=0) for the block; yields its ``host:port``."""
    service = service_class(server, service_class.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        yield f"127.0.0.1:{service.port}"
    finally:
        service.stop()


def client_inputs(client_module: Any, **arrays: np.ndarray) -> list[Any]:
    """``InferInput``s of ``client_module`` (tritonclient.http or tritonclient.grpc)
    holding ``arrays``, their datatypes taken from the arrays."""
    inputs = []
    for name, data in arrays.items():
        tensor = client_module.InferInput(name, list(data.shape), np_to_triton_dtype(data.dtype))
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def run_alone(run: Callable[[dlserve.Server], None], model: str, *dependencies: str) -> None:
    """Run one example on its own: a server with only ``model`` (and the models it
    calls) loaded, ``run(server)``, PASS (or ``skipped: ...`` when its framework is
    missing), and the server stopped whatever happens."""
    server = dlserve.Server(
        dlserve.Options(
            model_repository=str(MODELS),
            model_control_mode=dlserve.ModelControlMode.EXPLICIT,
            startup_models=[model, *dependencies],
            exit_on_error=False,  # a missing framework is reported as "skipped" below
        )
    ).start()
    try:
        run(server)
        print(f"PASS: {model}")
    except Skipped as exc:
        print(f"skipped: {exc}")
    finally:
        server.stop()
