"""Misbehaves on request: the request parameter "mode" picks how.

ok | raise | not_list | wrong_length | none | not_response | error:<CODE> |
exit | kill | segv | sleep:<seconds> | no_shm (the output needs more shared memory
than the worker may create: as with a full /dev/shm) | hold:<path> (writes <path>.held,
then answers once <path> exists, or after 60 s)

While a file named CRASH_ON_INITIALIZE sits in the model's folder, initialize()
ends the process (exit code 5), as a model that cannot come back up would. With
EXIT_AFTER_INITIALIZE there (taken away: once), initialize() writes INITIALIZING,
returns 0.3 s later, and the process exits (code 7) 50 ms after that, as if a thread
it started crashed.
"""
import ctypes
import json
import os
import resource
import signal
import threading
import time

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        folder = args["model_repository"]
        if os.path.exists(os.path.join(folder, "CRASH_ON_INITIALIZE")):
            os._exit(5)
        if os.path.exists(os.path.join(folder, "EXIT_AFTER_INITIALIZE")):
            os.unlink(os.path.join(folder, "EXIT_AFTER_INITIALIZE"))
            open(os.path.join(folder, "INITIALIZING"), "w").close()
            time.sleep(0.3)
            threading.Thread(target=lambda: (time.sleep(0.05), os._exit(7))).start()

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
        if mode == "no_shm":
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
            big = np.zeros(5 << 20, dtype=np.float32)  # more than the worker's arena holds
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", big)]) for _ in requests]
        if mode.startswith("sleep:"):
            time.sleep(float(mode.split(":", 1)[1]))
        if mode.startswith("hold:"):
            path = mode.split(":", 1)[1]
            open(path + ".held", "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)
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
