"""Generate-extension probe (like the `gen` model the Triton reference was captured
with): fixed outputs of several types, plus what the model saw of the request —
``params`` is ``request.parameters()`` as it came, ``inputs_seen`` maps each input to
its numpy dtype, shape and values, and an output named ``model_name`` that the answer's
own member must win over. The request parameter "fail" makes it answer with an error
response instead."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


def _values(array):
    if array.dtype == np.object_:
        return [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
    return array.reshape(-1).tolist()


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = request.parameters()
            if json.loads(params).get("fail"):
                error = pb_utils.TritonError("probe gen error")
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            seen = {}
            for tensor in request.inputs():
                array = tensor.as_numpy()
                seen[tensor.name()] = {
                    "dtype": str(array.dtype),
                    "shape": list(array.shape),
                    "values": _values(array),
                }
            seen_json = json.dumps(seen, sort_keys=True)
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().flat[0]
            int_in = pb_utils.get_input_tensor_by_name(request, "int_in")
            int_out = int(int_in.as_numpy().reshape(-1)[0]) if int_in is not None else 42
            nan = text == b"nan"  # non-finite floats out
            outputs = [
                pb_utils.Tensor("text_output", np.array([b"echo:" + text], dtype=np.object_)),
                pb_utils.Tensor("int_out", np.array([int_out], dtype=np.int32)),
                pb_utils.Tensor("int3", np.array([1, 2, 3], dtype=np.int32)),
                pb_utils.Tensor("fp1", np.array([np.nan if nan else 0.5], dtype=np.float32)),
                pb_utils.Tensor("fp3", np.array([0.1, np.inf, -np.inf] if nan else [0.1, 0.25, 3.0],
                                                dtype=np.float32)),
                pb_utils.Tensor("bool_out", np.array([True])),
                pb_utils.Tensor("grid", np.array([[b"x", b"y"], [b"z", b"w"]], dtype=np.object_)),
                pb_utils.Tensor("empty", np.zeros(0, dtype=np.int32)),
                pb_utils.Tensor("params", np.array([params.encode()], dtype=np.object_)),
                pb_utils.Tensor("inputs_seen", np.array([seen_json.encode()], dtype=np.object_)),
                pb_utils.Tensor("model_name", np.array([b"not the model's name"], dtype=np.object_)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
