"""AddSub in NumPy: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1.

A plain Triton Python-backend model: it runs unchanged on Triton and on dlserve.
"""

import json

# triton_python_backend_utils is available to every Triton Python model. It
# creates inference responses and output tensors, and has helpers to read the
# model configuration and map Triton data types to numpy types.
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Every Python model must define a class named "TritonPythonModel"."""

    def initialize(self, args):
        """Called once when the model is loaded.

        ``args`` is a dict of strings: model_config (JSON), model_instance_kind,
        model_instance_name, model_instance_device_id, model_repository,
        model_version and model_name.
        """
        self.model_config = model_config = json.loads(args["model_config"])

        # Output data types come from config.pbtxt, converted to numpy types.
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        """Called for every batch of requests; returns one response per request."""
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")

            # as_numpy() is a view of the request's memory: nothing is copied.
            a = in_0.as_numpy()
            b = in_1.as_numpy()

            out_tensor_0 = pb_utils.Tensor("OUTPUT0", (a + b).astype(self.output0_dtype))
            out_tensor_1 = pb_utils.Tensor("OUTPUT1", (a - b).astype(self.output1_dtype))

            # A per-request error would be returned as
            # pb_utils.InferenceResponse(error=pb_utils.TritonError("...")).
            inference_response = pb_utils.InferenceResponse(
                output_tensors=[out_tensor_0, out_tensor_1]
            )
            responses.append(inference_response)

        # Exactly one response per request, in the same order.
        return responses

    def finalize(self):
        """Called once when the model is unloaded (optional)."""
        print("Cleaning up...")
