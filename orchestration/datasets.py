"""Which bundled datasets ``fedsplit simulate`` takes, and the table keys its options make.

Light on purpose (no torch, no Flower): the CLI reads it to build its help and run config.
"""

from __future__ import annotations

from typing import Any

from fedsplit.client.data import DATASETS
from fedsplit.client.survival import tcga
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.tasks import AUTO, SURVIVAL, LabelEncoding, label_encoding

#: every bundled dataset `fedsplit simulate` takes (FLamby's Fed-TCGA-BRCA: a survival task)
SIMULATE_DATASETS = (*DATASETS, tcga.DATASET)
#: tcga-brca's default ridge penalty of the Cox model (lifelines' convention; `table_keys`)
TCGA_PENALIZER = 0.01


def table_keys(dataset: str | None, *, target: str = "target", time: str = "", event: str = "",
               id_column: str = "", task: str = "auto", hidden: str | None = None,
               penalizer: float | None = None) -> dict[str, Any]:
    """The run config's table keys (target, event, id-column, task, hidden, penalizer) from
    ``simulate``'s options.

    ``--time COL --event COL`` make a survival task (the time column is the target);
    ``--dataset tcga-brca`` brings its own columns (time ``T``, event ``E``, ID ``pid``) and task.
    A conflicting option is refused with the fix. ``hidden`` unset: the linear Cox model
    (``none``) for survival, else the MLP's ``64-32``. ``penalizer`` unset: 0, but
    `TCGA_PENALIZER` for tcga-brca, whose one-hot columns are collinear (``tumor_stage_*`` and
    ``ajcc_pathologic_stage_*`` carry the same stages; lifelines, and ``fedsplit cox``, need a
    small ridge there too).
    """
    if time and target not in ("target", time):
        raise ConfigError(f"--time is the target of a survival task; give --time or --target, "
                          f"not both. Received: --time {time!r}, --target {target!r}")
    keys = {"target": time or target, "event": event, "id_column": id_column, "task": task}
    if dataset != tcga.DATASET:
        if time and not event:
            raise ConfigError(f"--time needs --event (the 1/0 event column) for a survival task. "
                              f"Received: --time {time!r}")
        survival = (label_encoding(task) is LabelEncoding.TIME_EVENT
                    or (bool(event) and task == AUTO))
        return {**keys, "hidden": hidden or ("none" if survival else "64-32"),
                "penalizer": penalizer or 0.0}
    own = {"target": (tcga.TIME, "target", "--time"), "event": (tcga.EVENT, "", "--event"),
           "id_column": (tcga.ID, "", "--id-column"), "task": (SURVIVAL.name, AUTO, "--task")}
    for key, (value, default, flag) in own.items():
        if keys[key] not in (default, value):
            raise ConfigError(f"--dataset {tcga.DATASET} has time column {tcga.TIME!r}, event "
                              f"column {tcga.EVENT!r} and ID column {tcga.ID!r} (task survival); "
                              f"leave {flag} unset. Received: {keys[key]!r}")
        keys[key] = value
    return {**keys, "hidden": hidden or "none",
            "penalizer": TCGA_PENALIZER if penalizer is None else penalizer}
