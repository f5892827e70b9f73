"""BLS, blocking: each request is handed on to the add_sub model and its answer returned.

The input tensors go to add_sub as they are — references into the shared memory
they arrived in, not copies — and add_sub's outputs come back the same way, so
passing them on in our own response copies nothing either. An error from add_sub
comes back inside its response, not raised.
"""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # The model to call: add_sub, unless the config's CALLEE parameter names another
        # (benchmarks/models/bls_sync_inline calls an add_sub its worker runs inline).
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.callee = parameters.get("CALLEE", {}).get("string_value", "add_sub")

    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name=self.callee,
                inputs=request.inputs(),
                requested_output_names=["OUTPUT0", "OUTPUT1"],
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            responses.append(pb_utils.InferenceResponse(answer.output_tensors()))
        return responses
