"""Updates folded one at a time: the coordinator's merge without every reply held at once.

`Fold` takes a round's updates as they arrive (`Fold.add`: one `protocol.Update`, released by
the caller once added) and gives the aggregate at the end (`Fold.result`). The updates it holds
stay under the memory budget: once the held updates' bytes would pass ``memory_budget``, every
held update is written to a temporary weight file (`protocol.weights.write_weights`) and
reopened as a streaming `protocol.WeightFile`, and every later update goes to its own file as
it arrives. A fold told how many updates the round expects (``expected_updates``: the
coordinator's round loop passes the instructions it sent) holds none when that many of the
first one's size would not all fit: each goes to its file as it arrives, instead of the first
being held only to be written out when the second comes. The result is then
`aggregate_updates` over those sources, the one entry point `fedsplit aggregate` and the admin
API use, so every registered rule (FedAvg's count-weighted sums, median, trimmed mean, Krum,
geometric median) reads them block by block within the same budget, the input checks and the
per-hospital report are the all-at-once run's, and a server optimizer steps on that aggregate
afterwards as before (fold first, step after).

The sources are aggregated in the order of the keys given to `Fold.add` (default: arrival), so
a run's float sums do not depend on which hospital answered first. The temporary files go
when the fold is closed (`Fold.close`, or leaving its ``with`` block).

Memory: the held updates (at most ``memory_budget`` bytes), then the aggregate's output and the
rule's working memory (``memory_budget``); disk: one model per spilled update.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET, check_budget
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy
from fedsplit.aggregation.errors import AggregationError
from fedsplit.aggregation.guard import Expected
from fedsplit.aggregation.run import aggregate_updates
from fedsplit.aggregation.settings import BackendSettings
from fedsplit.protocol.update import Update, UpdateSource
from fedsplit.protocol.weights import open_weights, write_weights


class Fold:
    """A round's updates folded as they arrive (module docstring).

    Parameters
    ----------
    strategy, expected, cohort_caps, cap_policy, memory_budget, settings
        As in `aggregation.aggregate_updates`; ``memory_budget`` also bounds the bytes of the
        updates held in memory before they are spilled to disk.
    spill_dir : path, optional
        Where the temporary folder of spilled updates is made. Default: the system's
        temporary directory (`tempfile.gettempdir`).
    expected_updates : int, optional
        How many updates the round expects; when that many of an update's size would pass
        ``memory_budget``, updates are spilled as they arrive rather than held first.
    """

    def __init__(self, strategy: AggregationStrategy, *, expected: Expected | None = None,
                 cohort_caps: Mapping[str, int] | None = None, cap_policy: str = "clip",
                 memory_budget: int = DEFAULT_MEMORY_BUDGET,
                 settings: BackendSettings | None = None,
                 spill_dir: str | Path | None = None,
                 expected_updates: int | None = None) -> None:
        check_budget(memory_budget)
        if expected_updates is not None and expected_updates < 1:
            raise AggregationError(f"expected_updates is at least 1 (or None: unknown). "
                                   f"Received: {expected_updates}")
        self.expected_updates = expected_updates
        self.strategy, self.expected = strategy, expected
        self.cohort_caps, self.cap_policy = cohort_caps, cap_policy
        self.memory_budget, self.settings, self.spill_dir = memory_budget, settings, spill_dir
        self._sources: list[tuple[Any, UpdateSource]] = []
        self._held_bytes = 0
        self._folder: Path | None = None
        self._written = 0
        self._files = contextlib.ExitStack()
        self._closed = False

    @property
    def spilled(self) -> int:
        """How many updates are on disk now."""
        return sum(1 for _, s in self._sources if not isinstance(s, Update))

    def __len__(self) -> int:
        return len(self._sources)

    def add(self, update: Update, key: Any = None) -> None:
        """Fold ``update`` in (held, or spilled to disk once the held bytes would pass the
        budget); ``key`` orders it among the others for the merge (default: arrival)."""
        if self._closed:
            raise AggregationError("This fold is closed; start a new Fold for the next round. "
                                   "Received: an update after close()")
        order = key if key is not None else len(self._sources)
        size = int(update.header.nbytes)
        if self._folder is None and self._held_bytes + size * self._still_to_come() <= self.memory_budget:
            self._sources.append((order, update))
            self._held_bytes += size
            return
        self._spill_held()
        self._sources.append((order, self._spill(update)))

    def result(self) -> AggregateResult:
        """The aggregate of every update added (`aggregate_updates`, in key order)."""
        ordered = [s for _, s in sorted(self._sources, key=lambda pair: pair[0])]
        return aggregate_updates(self.strategy, ordered, expected=self.expected,
                                 cohort_caps=self.cohort_caps, cap_policy=self.cap_policy,
                                 memory_budget=self.memory_budget, settings=self.settings)

    def close(self) -> None:
        """Close the spilled files and remove their folder (the fold takes no more updates)."""
        self._closed = True
        self._sources.clear()
        self._files.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> Fold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _still_to_come(self) -> int:
        """This update and the ones the round still expects after it (1 when unknown)."""
        if self.expected_updates is None:
            return 1
        return max(1, self.expected_updates - len(self._sources))

    def _spill_held(self) -> None:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="fedsplit-fold-", dir=self.spill_dir))
        for k, (order, source) in enumerate(self._sources):
            if isinstance(source, Update):
                self._sources[k] = (order, self._spill(source))
        self._held_bytes = 0

    def _spill(self, update: Update) -> UpdateSource:
        assert self._folder is not None
        path = write_weights(update, self._folder / f"update-{self._written}.h5")
        self._written += 1
        return self._files.enter_context(
            open_weights(path, default_site=update.site or path.stem))
