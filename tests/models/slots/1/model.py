"""Shows each request the whole batch it ran in, place by place: correlation ID,
request ID, the START/END/READY/CORRID controls and INPUT's shape and sum, so tests
see which place each sequence got and what filled the empty ones. OUTPUT = INPUT.
A request not READY (a filler for an empty slot) is answered with an error in even
places and None in odd ones (Triton takes either for a filler); neither may reach
anybody. A ``sleep`` parameter holds the batch that long."""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(max(float(json.loads(r.parameters()).get("sleep", 0)) for r in requests))
        view = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            view.append({
                "corrid": request.correlation_id(),
                "id": request.request_id(),
                "controls": [_scalar(request, n) for n in ("START", "END", "READY", "CORRID")],
                "shape": list(data.shape),
                "sum": float(data.sum()),
            })
        text = np.array([[json.dumps(view).encode()]], dtype=np.object_)
        responses = []
        for place, request in enumerate(requests):
            if not _scalar(request, "READY"):
                error = pb_utils.TritonError("a filler's answer")
                responses.append(None if place % 2 else pb_utils.InferenceResponse(error=error))
                continue
            data = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", data), pb_utils.Tensor("BATCH_VIEW", text),
            ]))
        return responses
