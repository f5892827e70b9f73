"""Clients: a control plane (blocking; metadata, config, statistics, shared-memory
registration) and a data plane (asyncio; "slots" that each carry one request at a time).

A slot is the unit of concurrency: one keep-alive HTTP connection, one gRPC call site on
the process's channel (or one ModelStreamInfer stream), one in-process caller.
``await slot.infer(payload)`` sends an already-encoded request and returns
``(send_ns, recv_ns)``; it raises :class:`RequestError` when the request fails.
"""

from __future__ import annotations

from typing import Any

from dlserve.perf.clients.base import ControlClient, DataPlane, RequestError, ServerError, Slot


def control_client(settings: Any, server: Any = None) -> ControlClient:
    """The control plane for ``settings.protocol`` (``server``: the in-process one)."""
    if settings.protocol == "http":
        from dlserve.perf.clients.http import HttpControl

        return HttpControl(settings.url)
    if settings.protocol == "grpc":
        from dlserve.perf.clients.grpc import GrpcControl

        return GrpcControl(settings)
    from dlserve.perf.clients.inprocess import InprocessControl

    return InprocessControl(server)


def data_plane(settings: Any, info: Any, requests: list, control: ControlClient) -> DataPlane:
    if settings.protocol == "http":
        from dlserve.perf.clients.http import HttpDataPlane

        return HttpDataPlane(settings, info, requests, control)
    if settings.protocol == "grpc":
        from dlserve.perf.clients.grpc import GrpcDataPlane

        return GrpcDataPlane(settings, info, requests, control)
    from dlserve.perf.clients.inprocess import InprocessDataPlane

    return InprocessDataPlane(settings, info, requests, control)


__all__ = [
    "ControlClient", "DataPlane", "RequestError", "ServerError", "Slot", "control_client", "data_plane",
]
