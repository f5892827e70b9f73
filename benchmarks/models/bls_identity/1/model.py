"""bls_identity: hands INPUT0 to identity_fp32 with a blocking BLS call and returns its OUTPUT0.

Used by the BLS section of benchmarks/run.py to price a BLS call whose tensor is large: the input
tensor is passed on as it arrived and the callee's output returned as it came back.
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            answer = pb_utils.InferenceRequest(
                model_name="identity_fp32",
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0")],
                requested_output_names=["OUTPUT0"],
            ).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            output = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0")
            responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
        return responses
