import triton_python_backend_utils as pb_utils


def _codes():
    # INPUT0[0] selects the error code.  (pb_utils.TritonError is NOT available at module
    # import time during Triton's auto-complete stage, so look it up lazily.)
    E = pb_utils.TritonError
    return {1: E.NOT_FOUND, 2: E.INVALID_ARG, 3: E.INTERNAL, 4: E.UNAVAILABLE,
            5: E.UNSUPPORTED, 6: E.ALREADY_EXISTS, 7: E.UNKNOWN, 8: E.CANCELLED}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            sel = int(x[0])
            if sel == 0:
                err = pb_utils.TritonError("custom")
            elif sel == 9:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT0", x)],
                    error=pb_utils.TritonError("custom with outputs", pb_utils.TritonError.NOT_FOUND)))
                continue
            else:
                err = pb_utils.TritonError("custom", _codes()[sel])
            responses.append(pb_utils.InferenceResponse(output_tensors=[], error=err))
        return responses
