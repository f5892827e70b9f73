class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot initialize: weights file is missing")

    def execute(self, requests):
        return []
