"""In-process: dlserve's API (``dlserve.Server`` in this process), no network.

Inputs are turned into ``dlserve.Tensor`` once. With ``--shared-memory system`` they are
allocated in the server's shared memory (``Server.allocate_tensor``) and filled once, so
each request reaches the model with no copy at all; without it each request's inputs are
copied into the server's arena, as any caller's are (BYTES inputs always are).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dlserve.engine.request import SEQUENCE_END, SEQUENCE_START
from dlserve.perf.clients.base import ControlClient, DataPlane, RequestError, ServerError, Slot
from dlserve.perf.inputs import ModelInfo


def start_server(repositories: list[str], models: list[str]) -> Any:
    """A server with only ``models`` loaded (explicit model control)."""
    import dlserve

    options = dlserve.Options(
        model_repository=repositories,
        model_control_mode=dlserve.ModelControlMode.EXPLICIT,
        startup_models=models,
        exit_on_error=True,
    )
    try:
        return dlserve.Server(options).start(wait_until_ready=True, timeout=300)
    except dlserve.TritonError as exc:
        raise ServerError(f"cannot start the in-process server: {exc}") from None


def _version(version: str) -> int:
    return int(version) if version else -1


class InprocessControl(ControlClient):
    def __init__(self, server: Any) -> None:
        self.server = server

    def model_info(self, model: str, version: str) -> ModelInfo:
        import dlserve

        try:
            handle = self.server.model(model, _version(version))
            return ModelInfo.from_json(handle.metadata(), handle.config())
        except dlserve.TritonError as exc:
            raise ServerError(str(exc)) from None

    def statistics(self, model: str, version: str) -> dict[str, Any]:
        import dlserve

        try:
            return self.server.model(model, _version(version)).statistics()
        except dlserve.TritonError as exc:
            raise ServerError(str(exc)) from None

    def register(self, region: Any) -> None:
        raise ServerError("in-process shared memory needs no registration")

    def unregister(self, region: Any) -> None:
        pass


class InprocessSlot(Slot):
    def __init__(self, model: Any) -> None:
        self.model = model

    async def infer(self, payload: dict[str, Any]) -> tuple[int, int]:
        """``payload``: the keyword arguments of ``async_infer``."""
        import dlserve

        self.responses = 0
        answers = None if self.captured is None else []
        self.captured = answers
        try:
            async for response in self.model.async_infer(**payload):
                self.responses += bool(response.outputs)
                if answers is not None:  # (copied: the outputs live in the server's arena)
                    answers.append((time.perf_counter_ns(), {
                        name: (tensor.data_type.wire_name, tensor.storage().tobytes())
                        for name, tensor in response.outputs.items()
                    }))
        except dlserve.TritonError as exc:
            raise RequestError(str(exc)) from None
        return 0, 0


class InprocessDataPlane(DataPlane):
    async def setup(self) -> None:
        import dlserve

        control = self.control
        assert isinstance(control, InprocessControl)
        server = control.server
        zero_copy = self.settings.shared_memory == "system"
        types = {t.name: t.datatype for t in self.info.inputs}
        self.tensors = []
        for request in self.requests:
            tensors = {}
            for name, array in request.items():
                if zero_copy and types[name] != "BYTES":
                    tensor = server.allocate_tensor(list(array.shape), array.dtype)
                    np.from_dlpack(tensor)[...] = array
                else:
                    tensor = dlserve.Tensor.from_object(array)
                tensors[name] = tensor
            self.tensors.append(tensors)
        self.payloads = self.encode_all()
        self.model = server.model(self.info.name, _version(self.settings.version))

    def encode(self, index: int, extra: dict[str, object] | None = None) -> dict[str, Any]:
        """The in-process API takes a sequence's ID and flags as arguments of their own."""
        parameters = dict(self.parameters(extra))
        request: dict[str, Any] = {"inputs": self.tensors[index]}
        if "sequence_id" in parameters:
            request["correlation_id"] = parameters.pop("sequence_id")
            request["flags"] = SEQUENCE_START * bool(parameters.pop("sequence_start", False)) | SEQUENCE_END * bool(
                parameters.pop("sequence_end", False)
            )
        if parameters:
            request["parameters"] = parameters
        return request

    async def open_slot(self) -> Slot:
        return InprocessSlot(self.model)
