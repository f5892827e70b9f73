"""The arithmetic backend's operations, imported by its model.py as a top-level module."""

import operator

BY_NAME = {"add": operator.add, "sub": operator.sub}
