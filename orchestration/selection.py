"""Which round a baseline keeps: the one rule every model follows (`protocol.selection`).

Every baseline (horizontal `orchestration.experiment.train_baseline`, vertical
`orchestration.vertical.local.train_baseline`) and the federated model itself (the horizontal
coordinator's `server.history`, the vertical coordinator's `server.vertical.app`) is scored after
each round on validation rows cut from its own training rows (never test rows) by the task's
metric, accuracy or r2, and keeps the best round, ties going to the later round. This module
re-exports that rule for the orchestration layer; it is defined once, in `protocol.selection`.
"""

from __future__ import annotations

from fedsplit.protocol.selection import KEEP, BestRound, check_keep, selection_metric

__all__ = ["KEEP", "BestRound", "check_keep", "selection_metric"]
