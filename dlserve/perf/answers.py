"""The output tensors of the answers the clients kept for ``--profile-export-file`` (and for
``validation_data``'s check, :class:`Validator`), each as ``{name: (datatype, raw bytes)}``
-- the bytes as they travel (little-endian; BYTES length-prefixed), which is what
perf_analyzer's export renders from.

The clients keep their answers undecoded (HTTP: the Inference-Header-Content-Length and
the body; gRPC: the response message; in-process: already as above), so decoding costs
nothing while the load runs: it happens here, once, after the run. An output whose data
went to shared memory is not in its answer, and is left out. With ``validation_data`` each
answer is decoded as it arrives, to be checked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve.perf.clients.base import DataPlane, RequestError
from dlserve.perf.inputs import numpy_type, raw_bytes

Outputs = dict[str, tuple[str, bytes]]


def decoder(protocol: str, streaming: bool) -> Callable[[Any], Outputs]:
    """The decoder of the answers kept by ``protocol``'s slots."""
    if protocol == "http":
        return http_outputs
    if protocol == "grpc":
        return stream_outputs if streaming else grpc_outputs
    return dict  # in-process: kept decoded


def http_outputs(answer: tuple[int, bytes]) -> Outputs:
    """``(Inference-Header-Content-Length or -1, body)``: the JSON header, then the binary
    data of the outputs that have ``binary_data_size``, in their order."""
    header_length, body = answer
    offset = header_length if header_length >= 0 else len(body)
    outputs = {}
    for entry in json.loads(bytes(body[:offset])).get("outputs") or []:
        datatype = entry["datatype"]
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outputs[entry["name"]] = (datatype, bytes(body[offset : offset + size]))
            offset += size
        elif "data" in entry:
            outputs[entry["name"]] = (datatype, _values_bytes(datatype, entry["data"]))
    return outputs


def grpc_outputs(answer: bytes) -> Outputs:
    """A serialized ModelInferResponse."""
    from dlserve.frontends.proto import grpc_service_pb2 as pb

    return _infer_response(pb.ModelInferResponse.FromString(answer))


def stream_outputs(answer: bytes) -> Outputs:
    """A serialized ModelStreamInferResponse (a flag-only final has no outputs)."""
    from dlserve.frontends.proto import grpc_service_pb2 as pb

    return _infer_response(pb.ModelStreamInferResponse.FromString(answer).infer_response)


def _infer_response(response: Any) -> Outputs:
    from dlserve.frontends.grpc_codec import CONTENTS_FIELD

    outputs = {}
    raw = response.raw_output_contents
    for index, tensor in enumerate(response.outputs):
        if "shared_memory_region" in tensor.parameters:
            continue
        if index < len(raw):
            if raw[index] or not math.prod(tensor.shape):  # (else in shared memory: an empty stand-in)
                outputs[tensor.name] = (tensor.datatype, raw[index])
        elif tensor.datatype in CONTENTS_FIELD:
            values = list(getattr(tensor.contents, CONTENTS_FIELD[tensor.datatype]))
            outputs[tensor.name] = (tensor.datatype, _values_bytes(tensor.datatype, values))
    return outputs


def _values_bytes(datatype: str, values: Any) -> bytes:
    """The raw bytes of JSON or protobuf values (FP16 and BF16: none, as the export has no
    value for them anyway)."""
    if datatype in ("FP16", "BF16"):
        return b""
    return raw_bytes(np.asarray(values, dtype=numpy_type(datatype)).reshape(-1), datatype)


class Validator:
    """Checks each request's outputs against ``validation_data``, as perf_analyzer does:
    the bytes of every output the step names must be those expected, exactly (BYTES: as
    they travel, length-prefixed). Checked: the request's last answer with outputs; an
    output sent to shared memory is read from its area (it can be larger than the output:
    what it holds beyond the expected bytes is not looked at)."""

    def __init__(self, expected: list[dict[str, bytes]], decode: Callable[[Any], Outputs],
                 plane: DataPlane) -> None:
        self.expected = expected  # per distinct request, as the requests are
        self.decode = decode
        self.plane = plane

    def check(self, answers: list[tuple[int, Any]], index: int) -> None:
        """Raise :class:`RequestError` (perf_analyzer's words first) if request ``index``'s
        ``answers`` are not what its data expects."""
        expected = self.expected[index]
        if not expected:
            return
        outputs: Outputs = {}
        for _, answer in reversed(answers):
            outputs = self.decode(answer) if answer is not None else {}
            if outputs:
                break
        for name, want in expected.items():
            got = outputs[name][1] if name in outputs else None
            if got is None:
                got = self.plane.output_area(index, name)
                if got is not None and len(got) > len(want):
                    got = got[: len(want)]
            where = f"output '{name}', data index {index}"
            if got is None or len(got) != len(want):
                size = "no such output" if got is None else f"{len(got)} bytes"
                raise RequestError(f"Output size doesn't match expected size ({where}: "
                                   f"{size}, expected {len(want)} bytes)")
            if got != want:
                raise RequestError(f"Output doesn't match expected output ({where})")
