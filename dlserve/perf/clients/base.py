"""What every client provides; shared-memory set-up common to the network clients."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve.perf.inputs import ModelInfo
from dlserve.perf.payloads import ShmPlan, plan_shm
from dlserve.perf.shm import CudaRegion, ShmRef, SystemRegion, make_region


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Small requests leave at once (no Nagle wait for the previous one's ACK)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class ServerError(Exception):
    """The server answered a control request with an error (or could not be reached)."""


class MissingEndpoint(ServerError):
    """The server does not offer this (Triton extension) endpoint at all: a plain
    KServe v2 server such as MLServer has no model configuration."""


class RequestError(Exception):
    """An inference request failed."""


class ControlClient:
    """Blocking calls made outside the hot loop."""

    def model_info(self, model: str, version: str) -> ModelInfo:
        raise NotImplementedError

    def statistics(self, model: str, version: str) -> dict[str, Any]:
        """The statistics extension's JSON (``{"model_stats": [...]}``)."""
        raise NotImplementedError

    def register(self, region: SystemRegion | CudaRegion) -> None:
        raise NotImplementedError

    def unregister(self, region: SystemRegion | CudaRegion) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Slot:
    # How many responses with outputs the last request got (a decoupled model's stream:
    # as many as it sent), for perf_analyzer's "Response Throughput".
    responses = 1
    # --profile-export-file: None (nothing kept, the default), or set to a list by the
    # load, after which each request leaves its answers here: (perf_counter ns, the raw
    # answer as this client received it), decoded after the run by dlserve.perf.answers.
    captured: list[tuple[int, Any]] | None = None
    # --periodic-concurrency-range's: None, or called as each answer to the request on the
    # way arrives (a stream's flag-only final too).
    on_answer: Callable[[], None] | None = None

    async def infer(self, payload: Any) -> tuple[int, int]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class DataPlane:
    """Encodes the requests once (:meth:`setup`), then opens slots that send them.

    :meth:`encode` makes one request: the distinct request ``index`` with request
    parameters (``--request-parameter``'s, and a sequence step's); ``payloads`` holds
    each distinct request encoded with ``--request-parameter``'s alone.
    """

    def __init__(self, settings: Any, info: ModelInfo, requests: list[dict[str, np.ndarray]],
                 control: ControlClient) -> None:
        self.settings = settings
        self.info = info
        self.requests = requests
        self.control = control
        self.payloads: list[Any] = []
        self.region: SystemRegion | CudaRegion | None = None
        self._registered = False
        self.shm_inputs: list[dict[str, ShmRef]] | None = None
        self.shm_outputs: list[dict[str, ShmRef]] | None = None  # one set, or one per request
        self.separate_outputs = False  # (validation_data's: each request's outputs can be read)

    def shared_memory(self) -> None:
        """With --shared-memory: make and register this process's region; keep the refs."""
        if self.settings.shared_memory == "none":
            return
        plan: ShmPlan = plan_shm(self.requests, self.info, self.settings.output_shm_size,
                                 self.separate_outputs)
        self.region = make_region(self.settings.shared_memory, plan.layout)
        self.control.register(self.region)
        self._registered = True
        self.shm_inputs, self.shm_outputs = plan.refs(self.region.name)

    def output_refs(self, index: int) -> dict[str, ShmRef] | None:
        """Where request ``index``'s outputs go in shared memory (None: in the answer)."""
        if self.shm_outputs is None:
            return None
        return self.shm_outputs[index if self.separate_outputs else 0]

    def output_area(self, index: int, name: str) -> bytes | None:
        """What request ``index``'s last answer left in output ``name``'s area (system
        shared memory; None when it is not there)."""
        refs = self.output_refs(index)
        if refs is None or not isinstance(self.region, SystemRegion):
            return None
        ref = refs[name]
        return self.region.read(ref.offset, ref.byte_size)

    def parameters(self, extra: dict[str, object] | None) -> dict[str, object]:
        """A request's parameters: ``--request-parameter``'s, then ``extra``."""
        return {**self.settings.request_parameters, **extra} if extra else self.settings.request_parameters

    def encode_all(self) -> list[Any]:
        return [self.encode(index) for index in range(len(self.requests))]

    async def setup(self) -> None:
        raise NotImplementedError

    def encode(self, index: int, extra: dict[str, object] | None = None) -> Any:
        raise NotImplementedError

    async def open_slot(self) -> Slot:
        raise NotImplementedError

    async def close(self) -> None:
        region, self.region = self.region, None
        if region is None:
            return
        try:
            if self._registered:
                self.control.unregister(region)
        except ServerError:
            pass
        finally:
            region.close()
