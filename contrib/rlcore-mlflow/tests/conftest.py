"""Make the plugin importable when the package is not installed (``pytest contrib/rlcore-mlflow/tests``)."""

import importlib.util
import os
import sys

if importlib.util.find_spec("rlcore_mlflow") is None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
