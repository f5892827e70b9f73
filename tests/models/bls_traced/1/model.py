"""BLS that hands its request's trace on (``trace=request.trace()``), as Triton's trace
guide shows: the call to add_sub is traced as a child of the request when the request is
traced. Also reports what ``get_context()`` gave, in the TRACE_CONTEXT output."""

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            trace = request.trace()
            call = pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=request.inputs(),
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                request_id="child-of-" + request.request_id(),
                trace=trace,
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            context = np.array([str(trace.get_context()).encode()], dtype=np.object_)
            outputs = answer.output_tensors() + [pb_utils.Tensor("TRACE_CONTEXT", context)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
