"""Aggregate weight files into a weight file and a report: the one flow behind both
`fedsplit aggregate` and the admin API's ``POST /rounds/{id}/aggregate``.

`aggregate_files` opens every input as a streaming `protocol.weights.WeightFile` (nothing is
loaded whole), runs `aggregation.aggregate_updates` (input checks, then the strategy within
the memory budget), and writes the aggregate with `protocol.weights.write_weights` and the
report with `protocol.atomic.write_json_atomic`: both atomically, so a reader never sees a
half-written model or report.

The aggregate's model id (root attribute ``model``) is chosen by one rule: the id named by the
inputs that were used (not excluded), when they all agree on it; inputs that name no id do not
vote; when the used inputs name two or more different ids, or none, the aggregate names none.
An excluded input never decides what the aggregate is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.base import AggregateResult, AggregationStrategy
from fedsplit.aggregation.errors import AggregationError
from fedsplit.aggregation.run import aggregate_updates
from fedsplit.aggregation.settings import BackendSettings
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.atomic import write_json_atomic
from fedsplit.protocol.weights import WeightFile, open_weights, write_weights

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class FilesAggregate:
    """What `aggregate_files` produced: the result, the model id chosen and where it wrote."""

    result: AggregateResult
    model: str | None
    weights_path: Path
    report_path: Path


def report_path_for(output: PathLike) -> Path:
    """The default report path: ``<output stem>.report.json`` beside the output model."""
    out = Path(output)
    return out.with_name(f"{out.stem}.report.json")


def model_id(files: Sequence[WeightFile], used: Sequence[bool]) -> str | None:
    """The model id the used inputs agree on (inputs naming none do not vote), else None."""
    ids = {f.header.model for f, keep in zip(files, used, strict=True) if keep} - {None}
    return ids.pop() if len(ids) == 1 else None


def aggregate_files(
    strategy: AggregationStrategy,
    inputs: Sequence[PathLike],
    output: PathLike,
    *,
    report_path: PathLike | None = None,
    labels: Sequence[str] | None = None,
    counts: Sequence[int] | None = None,
    expected: Sequence[ArraySpec] | None = None,
    reference: PathLike | None = None,
    cohort_caps: Mapping[str, int] | None = None,
    cap_policy: str = "clip",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    round_id: int | None = None,
    settings: BackendSettings | None = None,
) -> FilesAggregate:
    """Aggregate the weight files ``inputs`` with ``strategy``; write the model and its report.

    Parameters
    ----------
    strategy : AggregationStrategy
        From `aggregation.get_strategy`.
    inputs : paths
        Weight files (.h5). A file without ``num_examples`` opens and is excluded by the input
        checks with its reason, like any other failing input; a file that cannot be opened at
        all raises `WeightFileError`.
    output : path
        Where to write the aggregate weight file (site ``aggregate``, its ``num_examples`` the
        sum of the used inputs' counts).
    report_path : path, optional
        Where to write the report JSON. Default: `report_path_for` ``output``.
    labels : one str per input, optional
        Site label of each input in the report when its file names no site. Default: the file
        name's stem. Inputs that end up with the same label get their file name added.
    counts : one int per input, optional
        Sample count of each input, instead of the file's own ``num_examples`` (the admin API
        stores an upload as sent and records its count apart).
    expected, reference : the round's model, optional (at most one)
        Its layout as specs, or a weight file holding it. Default: the layout shared by more
        than half the inputs (a minority layout is excluded and reported).
    cohort_caps, cap_policy, memory_budget, settings
        As in `aggregation.aggregate_updates`.
    round_id : int, optional
        Round number written into the aggregate's file (attribute ``round``).
    """
    paths = [Path(p) for p in inputs]
    if labels is not None and len(labels) != len(paths):
        raise AggregationError(
            f"aggregate_files takes one label per input file. Received: {len(labels)} labels "
            f"for {len(paths)} files"
        )
    if counts is not None and len(counts) != len(paths):
        raise AggregationError(
            f"aggregate_files takes one count per input file. Received: {len(counts)} counts "
            f"for {len(paths)} files"
        )
    if expected is not None and reference is not None:
        raise AggregationError(
            "Give the round's model either as specs (expected) or as a weight file (reference), "
            f"not both. Received: expected and reference={reference}"
        )
    target = Path(output)
    report_target = Path(report_path) if report_path is not None else report_path_for(target)
    with contextlib.ExitStack() as stack:
        if reference is not None:
            ref = stack.enter_context(open_weights(reference, require_num_examples=False))
            expected = ref.header.specs
        files = [
            stack.enter_context(
                open_weights(
                    path,
                    require_num_examples=False,
                    default_site=labels[k] if labels is not None else path.stem,
                )
            )
            for k, path in enumerate(paths)
        ]
        for f, count in zip(files, counts or (), strict=False):
            f.recount(count)
        # Files that carry the same site name (e.g. several rounds' global.h5) get their file
        # name added, so the report's rows can be told apart.
        seen = [f.header.label for f in files]
        for f, path in zip(files, paths, strict=True):
            if seen.count(f.header.label) > 1:
                f.relabel(f"{f.header.label} ({path.name})")
        result = aggregate_updates(
            strategy,
            files,
            expected=expected,
            cohort_caps=cohort_caps,
            cap_policy=cap_policy,
            memory_budget=memory_budget,
            settings=settings,
        )
        model = model_id(files, [not s.excluded for s in result.report.sites])
    write_weights(result.to_update(site="aggregate", round=round_id, model=model), target)
    write_json_atomic(report_target, result.report.to_json())
    return FilesAggregate(result=result, model=model, weights_path=target, report_path=report_target)
