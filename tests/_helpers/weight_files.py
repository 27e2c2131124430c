"""Weight files opened for the length of a ``with`` block."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from fedsplit.protocol import WeightFile, open_weights


@contextmanager
def opened(paths: Iterable[Path]) -> Iterator[list[WeightFile]]:
    """`open_weights` of each path, in order; every file is closed on leaving the block."""
    with ExitStack() as stack:
        yield [stack.enter_context(open_weights(p)) for p in paths]
