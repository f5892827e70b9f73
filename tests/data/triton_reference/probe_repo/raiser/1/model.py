import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise ValueError("boom")
