"""Misbehaves on request: the request parameter "mode" picks how.

ok | raise | not_list | wrong_length | none | not_response | error:<CODE> |
exit | kill | segv | sleep:<seconds>
"""
import ctypes
import json
import os
import signal
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        mode = json.loads(requests[0].parameters()).get("mode", "ok")
        if mode == "raise":
            raise ValueError("boom")
        if mode == "not_list":
            return {"not": "a list"}
        if mode == "wrong_length":
            return []
        if mode == "none":
            return None
        if mode == "not_response":
            return ["not a response" for _ in requests]
        if mode == "exit":
            os._exit(3)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "segv":
            ctypes.string_at(0)
        if mode.startswith("sleep:"):
            time.sleep(float(mode.split(":", 1)[1]))
        responses = []
        for request in requests:
            if mode.startswith("error:"):
                code = getattr(pb_utils.TritonError, mode.split(":", 1)[1])
                error = pb_utils.TritonError("custom error", code)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            pid = np.array([os.getpid()], dtype=np.int64)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT0", data), pb_utils.Tensor("PID", pid)]
                )
            )
        return responses
