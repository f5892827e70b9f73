"""Loads, unloads and checks other models from inside execute. Request parameters:
"op" (load, load_config, unload, ready), "target", "version"; INFO is the
outcome: {"ok": ..., "ready": ...} or {"error": message}."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [self.answer(json.loads(r.parameters())) for r in requests]

    def answer(self, params):
        op, target = params.get("op"), params.get("target", "")
        try:
            if op == "load":
                pb_utils.load_model(target)
                outcome = {"ok": True}
            elif op == "load_config":
                pb_utils.load_model(target, config=params["config"])
                outcome = {"ok": True}
            elif op == "unload":
                pb_utils.unload_model(target)
                outcome = {"ok": True}
            else:
                outcome = {"ready": pb_utils.is_model_ready(target, params.get("version", ""))}
        except pb_utils.TritonModelException as exc:
            outcome = {"error": str(exc)}
        info = pb_utils.Tensor("INFO", np.array([json.dumps(outcome).encode()], np.object_))
        return pb_utils.InferenceResponse([info])
