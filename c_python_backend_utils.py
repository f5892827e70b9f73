"""Triton's name for its stub's C module, which some models import beside
``triton_python_backend_utils`` (``import c_python_backend_utils as c_utils``).
"""

from dlserve.pb_utils.c_module import *  # noqa: F403
from dlserve.pb_utils.c_module import __all__  # noqa: F401
