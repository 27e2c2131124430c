"""A task kind's own server phases, run by the general coordinator without knowing the kind.

A kind declares its phases by name (`protocol.tasks.TaskKind.server_phases`); `run_phase` looks
one up and calls it with what every phase gets: the grid, the parsed run config, the agreed
model (`server.setup.ModelSetup`) and the run's history.

- ``fit``: instead of the rounds; returns False where it does not apply (the rounds run);
- ``after``: after the rounds (or the fit), before the run is marked finished.

So the coordinator (`server.app`) imports no kind's code: survival's exact Cox fit and its
summary sit in `server.survival`, named by the survival kind (an import-linter contract in
pyproject.toml keeps it so).
"""

from __future__ import annotations

from collections.abc import Callable

from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.tasks import declared, resolve
from fedsplit.server.history import RunHistory
from fedsplit.server.setup import ModelSetup
from flwr.serverapp import Grid

Phase = Callable[[Grid, RunConfig, ModelSetup, RunHistory], bool | None]


def run_phase(phase: str, grid: Grid, cfg: RunConfig, setup: ModelSetup,
              history: RunHistory) -> bool:
    """Run the run's task kind's ``phase`` (when it declares one); True if it ran and did its
    work (a ``fit`` that returns False, or no such phase: False)."""
    kind = declared(cfg.task)
    entry = kind.server_phases.get(phase) if kind is not None else None
    if entry is None:
        return False
    step: Phase = resolve(entry)
    return step(grid, cfg, setup, history) is not False
