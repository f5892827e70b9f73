"""Network frontends: KServe v2 HTTP and gRPC, Prometheus metrics, SageMaker.

``from dlserve.frontends import KServeHttp, KServeGrpc, Metrics`` (modelled on
Triton's ``tritonfrontend``).
"""

from dlserve.frontends.services import KServeGrpc, KServeHttp, Metrics, SageMaker

__all__ = ["KServeGrpc", "KServeHttp", "Metrics", "SageMaker"]
