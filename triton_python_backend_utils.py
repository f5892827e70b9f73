"""Triton's module name for the Python-backend API, so unmodified ``model.py`` files run.

``import triton_python_backend_utils as pb_utils`` gives dlserve's implementation.
"""

from dlserve.pb_utils import *  # noqa: F403
from dlserve.pb_utils import __all__  # noqa: F401
