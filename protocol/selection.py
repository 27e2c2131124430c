"""Which round a model keeps: one rule for the federated model and every baseline.

After each round the model is scored on validation rows (cut from training rows, never test
rows) by the task kind's selection metric (`protocol.tasks`: accuracy for classification, r2
for regression). With
``keep="best-val"`` (the default) the round that scores best is kept, ties going to the later
round (more training at the same score; scores within `TIE_TOLERANCE` tie) and a NaN score
never winning over a number; with
``keep="last"`` the last round is kept whatever it scores (protocols that fix the round count,
e.g. FLamby's). The metric, not the loss, decides: on a few validation rows the loss of a barely
trained model can be the lowest while its accuracy is not.

Used by the horizontal coordinator (`server.history`), the vertical coordinator
(`server.vertical`) and the baselines (`orchestration.selection`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from fedsplit.protocol.tasks import task_kind

Keep = Literal["best-val", "last"]
#: Scores this close count as a tie (a federated score is a weighted mean of the hospitals':
#: the same accuracy reached another way can differ in the last bits).
TIE_TOLERANCE = 1e-9
KEEP: tuple[str, ...] = ("best-val", "last")


def selection_metric(task: str) -> str:
    """The metric a round is chosen by: the task kind's (`protocol.tasks`; ``accuracy`` for
    classification, ``r2`` for regression, ``c_index`` for survival)."""
    return task_kind(task).selection


def check_keep(keep: str) -> str:
    """``keep`` if it names a rule, else `ValueError` naming the choices."""
    if keep not in KEEP:
        raise ValueError(f"keep must be one of {', '.join(KEEP)} (best-val: the round that scores "
                         f"best on validation rows; last: the last round). Received: {keep!r}")
    return keep


class BestRound:
    """Offer each round's validation score in order; ``round`` is the one kept (1-based).

    ``offer(value)`` numbers rounds 1, 2, ...; ``offer(value, round=r)`` names the round (a
    federation can have rounds without a new model, which are not offered). ``scores`` lists
    the offered scores in order, ``rounds`` their round numbers, ``score`` the kept round's.
    """

    def __init__(self, keep: str = "best-val") -> None:
        self.keep = check_keep(keep)
        self.scores: list[float] = []
        self.rounds: list[int] = []
        self.round = 0
        self._best = -math.inf

    @property
    def score(self) -> float | None:
        """The kept round's validation score (None before any round)."""
        if not self.round:
            return None
        return self.scores[self.rounds.index(self.round)]

    def offer(self, value: float | None, round: int | None = None) -> bool:
        """Record the next round's score (None or NaN: not scored); True if it is now kept."""
        value = math.nan if value is None else float(value)
        number = (self.rounds[-1] + 1 if self.rounds else 1) if round is None else int(round)
        if self.rounds and number <= self.rounds[-1]:
            raise ValueError(f"Rounds are offered in order; round {number} came after round "
                             f"{self.rounds[-1]}. Received: {number}")
        self.scores.append(value)
        self.rounds.append(number)
        if self.keep == "last" or self.round == 0 or (not math.isnan(value) and (
                value >= self._best or math.isclose(value, self._best, rel_tol=TIE_TOLERANCE,
                                                    abs_tol=TIE_TOLERANCE))):
            self.round, self._best = number, -math.inf if math.isnan(value) else value
            return True
        return False

    @classmethod
    def replay(cls, scored: Iterable[tuple[int, float | None]], keep: str = "best-val") -> BestRound:
        """The rule after offering ``(round, score)`` pairs in order (e.g. from a saved history)."""
        picker = cls(keep)
        for number, value in scored:
            picker.offer(value, round=number)
        return picker
