import logging

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        pb_utils.Logger.log_info("logger model initialized")

    def execute(self, requests):
        logger = pb_utils.Logger
        logger.log_info("info message")
        logger.log_warn("warning message")
        logger.log_error("error message")
        logger.log_verbose("verbose message")
        logger.log("explicit level message", logger.ERROR)
        # Plain Python logging reaches the server's log too.
        python_logger = logging.getLogger("logger_model")
        python_logger.warning("python warning message")
        try:
            1 / 0
        except ZeroDivisionError:
            python_logger.exception("python error message")
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
