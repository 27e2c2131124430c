"""Weight files for tests: opened for the length of a ``with`` block, or written by hand."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from fedsplit.protocol import WeightFile, open_weights


@contextmanager
def opened(paths: Iterable[Path]) -> Iterator[list[WeightFile]]:
    """`open_weights` of each path, in order; every file is closed on leaving the block."""
    with ExitStack() as stack:
        yield [stack.enter_context(open_weights(p)) for p in paths]


def raw_weights(path: Path, build: Callable[[h5py.File, h5py.Group], None], **attrs: Any) -> Path:
    """A fedsplit-looking file whose /arrays content ``build`` writes (for malicious variants)."""
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "fedsplit.weights"
        f.attrs["format_version"] = np.int64(1)
        for key, value in {"num_examples": np.int64(10), **attrs}.items():
            if value is not None:
                f.attrs[key] = value
        group = f.create_group("arrays")
        build(f, group)
        group.attrs["order"] = np.array(list(group.keys()), dtype=h5py.string_dtype())
    return path
