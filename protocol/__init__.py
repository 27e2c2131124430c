"""fedsplit's wire and file formats: weight files, updates, run configuration, errors.

Imports nothing else of fedsplit; every other package builds on it.
"""

from protocol.arrays import ALLOWED_DTYPES, ArraySpec, check_array, check_num_examples
from protocol.config import RunConfig
from protocol.errors import ConfigError, FedsplitError, UpdateError, WeightFileError
from protocol.update import Update, UpdateHeader, UpdateSource
from protocol.weights import (
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
