"""The Prometheus endpoint: ``GET /metrics`` on its own port, serving the engine's
metrics (:mod:`dlserve.engine.prometheus`)."""

from __future__ import annotations

import time

from dlserve.engine.core import Engine
from dlserve.engine.prometheus import CONTENT_TYPE, CpuSampler, render
from dlserve.frontends.http_server import HttpRequest, HttpResponse, HttpServer

MAX_CONNECTIONS = 64  # scrapers keep one each: the descriptors are the inference listeners'


class MetricsEndpoint:
    """``GET /metrics`` on its own port (``/metrics/`` too: Triton's exposer answers
    both, and scrape configs written for it use either)."""

    def __init__(self, engine: Engine, cpu: bool = True, gpu: bool = True) -> None:
        self.engine = engine
        self._cpu = CpuSampler() if cpu else None
        self._gpu = gpu
        self._http = HttpServer(self._handle, max_body=1 << 12, max_connections=MAX_CONNECTIONS)
        self.started = time.monotonic()

    async def _handle(self, request: HttpRequest) -> HttpResponse:
        if request.path not in ("/metrics", "/metrics/"):
            return HttpResponse(404, [b'{"error":"Not Found"}'])
        if request.method != "GET":
            return HttpResponse(405, [b'{"error":"Method Not Allowed"}'])
        return HttpResponse(200, [render(self.engine, self._cpu, self._gpu).encode()], CONTENT_TYPE)

    async def start(self, host: str, port: int) -> int:
        return await self._http.start(host, port)

    async def stop(self, grace: float = 0.0) -> None:
        await self._http.stop(grace)

