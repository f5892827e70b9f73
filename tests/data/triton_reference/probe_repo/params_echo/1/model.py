import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        E = pb_utils.TritonError
        info = {
            "pb_utils_attrs": [a for a in dir(pb_utils) if not a.startswith("__")],
            "TritonError_attrs": [a for a in dir(E) if not a.startswith("_")],
            "TritonError_codes": {a: int(getattr(E, a)) for a in dir(E) if a.isupper()},
            "TritonError_default_code": int(E("x").code()),
            "TritonError_repr_str": [repr(E("msg")), str(E("msg")), E("msg").message()],
            "Tensor_attrs": [a for a in dir(pb_utils.Tensor) if not a.startswith("_")],
            "InferenceResponse_attrs": [a for a in dir(pb_utils.InferenceResponse) if not a.startswith("_")],
            "InferenceResponse_doc": pb_utils.InferenceResponse.__init__.__doc__,
        }
        with open("/tmp/triton_probe_pb_utils_dir.json", "w") as f:
            json.dump(info, f, indent=1)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            p = request.parameters()
            info = {
                "parameters_type": type(p).__name__,
                "parameters": p,
                "request_id": request.request_id(),
                "correlation_id": request.correlation_id(),
                "flags": request.flags(),
                "timeout": request.timeout(),
                "requested_output_names": list(request.requested_output_names()),
                "requested_output_names_type": type(request.requested_output_names()).__name__,
                "model_name": request.model_name() if hasattr(request, "model_name") else None,
                "model_version": request.model_version() if hasattr(request, "model_version") else None,
                "input_names": [t.name() for t in request.inputs()],
                "request_attrs": [a for a in dir(request) if not a.startswith("_")],
            }
            try:
                pb_utils.InferenceResponse(output_tensors=[], parameters={"a": 1, "b": "x", "c": True})
                info["response_parameters_supported"] = True
            except TypeError as e:
                info["response_parameters_supported"] = False
                info["response_parameters_error"] = str(e)
            out = np.array([json.dumps(info).encode()], dtype=np.object_)
            tensors = [pb_utils.Tensor("OUTPUT0", out), pb_utils.Tensor("OUTPUT1", x)]
            if info["response_parameters_supported"]:
                resp = pb_utils.InferenceResponse(output_tensors=tensors, parameters={"a": 1, "b": "x", "c": True})
            else:
                resp = pb_utils.InferenceResponse(output_tensors=tensors)
            responses.append(resp)
        return responses
