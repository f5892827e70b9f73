"""Decoupled: keeps every request open until one with the parameter "flush" comes,
then answers them all (each with its own IN), as a streaming speech model answers a
whole utterance at its last chunk."""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kept = []

    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().copy()
            self.kept.append((request.get_response_sender(), value))
            if json.loads(request.parameters()).get("flush"):
                for sender, kept in self.kept:
                    sender.send(
                        pb_utils.InferenceResponse([pb_utils.Tensor("OUT", kept)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                    )
                self.kept = []
        return None
