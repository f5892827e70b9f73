"""Network frontends: KServe v2 HTTP and gRPC, Prometheus metrics, SageMaker and Vertex AI.

``from dlserve.frontends import KServeHttp, KServeGrpc, Metrics`` (modelled on
Triton's ``tritonfrontend``).
"""

from dlserve.frontends.services import KServeGrpc, KServeHttp, Metrics, SageMaker, VertexAi

__all__ = ["KServeGrpc", "KServeHttp", "Metrics", "SageMaker", "VertexAi"]
