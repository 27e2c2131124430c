"""A toy task kind, added in this one file: counts (visits, events: whole numbers >= 0) read as
values, scored by how often the prediction rounds to within one of the truth.

Importing the module registers the kind (`protocol.tasks.register`); a federation's processes
import it through the ``fedsplit.tasks`` entry point naming this module (test_toy_task.py writes
one). The built-in models train it (its labels are values: standardised targets, squared error),
the run keeps its round by ``within_one``, and every evaluation reports ``within_one`` and
``mae`` beside the loss: nothing else in fedsplit names it.
"""

from __future__ import annotations

import numpy as np
from fedsplit.protocol.tasks import LabelEncoding, TaskKind, register


def within_one(truth: np.ndarray, predicted: np.ndarray) -> float:
    """The share of rows whose predicted count (rounded, at least 0) is within one of the truth."""
    guess = np.maximum(np.rint(np.asarray(predicted, np.float64)), 0.0)
    return float((np.abs(guess - np.asarray(truth, np.float64)) <= 1).mean())


def mae(truth: np.ndarray, predicted: np.ndarray) -> float:
    """The mean absolute error, in counts."""
    return float(np.abs(np.asarray(predicted, np.float64) - np.asarray(truth, np.float64)).mean())


COUNT = register(TaskKind(
    name="count",
    labels=LabelEncoding.VALUES,
    metrics=("within_one", "mae"),
    selection="within_one",
    scores={"within_one": within_one, "mae": mae},
))
