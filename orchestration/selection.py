"""Which round a baseline keeps: the one that scores best on validation rows by the task metric.

One rule for every baseline (horizontal `orchestration.experiment.train_baseline`, vertical
`orchestration.vertical.local.best_round`): after each round the model is scored on
validation rows (never test rows) by the task's own metric, accuracy for classification and
r2 for regression, and the best round is kept, ties going to the later round (more training
at the same score). The metric, not the loss, decides: on a few validation rows the loss of a
barely trained model can be the lowest while its accuracy is not, and a baseline stopped there
loses to the federation by under-training.
"""

from __future__ import annotations

import math


def selection_metric(task: str) -> str:
    """The metric a baseline's round is chosen by: ``accuracy`` or ``r2``."""
    return "accuracy" if task == "classification" else "r2"


class BestRound:
    """Offer each round's validation score in order; ``round`` is the one kept (1-based).

    Higher is better; a tie goes to the later round; a NaN score never wins over a number.
    """

    def __init__(self) -> None:
        self.scores: list[float] = []
        self.round = 0
        self._best = -math.inf

    def offer(self, value: float) -> bool:
        """Record the next round's score; True if that round is now the one kept."""
        self.scores.append(float(value))
        if self.round == 0 or (not math.isnan(value) and value >= self._best):
            self.round, self._best = len(self.scores), (
                -math.inf if math.isnan(value) else float(value))
            return True
        return False
