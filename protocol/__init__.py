"""fedsplit's wire and file formats: weight files, updates, run configuration, errors.

Imports nothing else of fedsplit; every other package builds on it. `RunConfig` (pydantic
models of every run-config key) loads on first use, so commands that never read a run
configuration (`fedsplit aggregate`) do not pay for it at start-up.
"""

from typing import TYPE_CHECKING, Any

from fedsplit.protocol.arrays import ALLOWED_DTYPES, ArraySpec, check_array, check_num_examples
from fedsplit.protocol.errors import ConfigError, FedsplitError, UpdateError, WeightFileError
from fedsplit.protocol.update import Update, UpdateHeader, UpdateSource
from fedsplit.protocol.weights import (
    FORMAT,
    FORMAT_VERSION,
    WeightFile,
    open_weights,
    read_weights,
    write_weights,
)

__all__ = [
    "ALLOWED_DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "ArraySpec",
    "ConfigError",
    "FedsplitError",
    "RunConfig",
    "Update",
    "UpdateError",
    "UpdateHeader",
    "UpdateSource",
    "WeightFile",
    "WeightFileError",
    "check_array",
    "check_num_examples",
    "open_weights",
    "read_weights",
    "write_weights",
]

if TYPE_CHECKING:
    from fedsplit.protocol.config import RunConfig


def __getattr__(name: str) -> Any:
    if name == "RunConfig":
        from fedsplit.protocol.config import RunConfig

        return RunConfig
    raise AttributeError(f"module 'protocol' has no attribute {name!r}")

# `import protocol` (its bare folder name) would load every module twice: refused
try:
    from fedsplit import only_as_fedsplit
except ImportError:  # Python found a clone's folder named fedsplit first: see fedsplit/__init__.py
    import runpy
    from pathlib import Path

    _repair = Path(__file__).resolve().parents[1] / "fedsplit" / "_clone_root.py"
    runpy.run_path(str(_repair))["adopt"](__file__)
    from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
