"""A task kind's own steps in the commands, looked up by name (`protocol.tasks`), so the general
ones (`orchestration.experiment`, ``fedsplit up``) run them without knowing the kind:

- `draw_task_plots`: its figures after a ``simulate`` run's rounds (``plots``; survival: the
  pooled Kaplan-Meier curve), returning the run-summary fields they fill;
- `task_report`: its lines at the end of a local ``fedsplit up`` (``report``; survival: each
  hospital's C-index and the summary's files).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsplit.protocol.tasks import declared, resolve

if TYPE_CHECKING:
    from fedsplit.protocol.record.horizontal import RunRecord


def draw_task_plots(task: str, fed_dir: Path) -> dict[str, Any]:
    """Draw the run's task kind's figures from the federation's folder; the run-summary fields
    they fill (survival: ``survival``, its files), empty for a kind that draws none."""
    kind = declared(task)
    fields: dict[str, Any] = {}
    for entry in kind.plots if kind is not None else ():
        fields.update(resolve(entry)(Path(fed_dir)))
    return fields


def task_report(task: str, out_dir: Path, history: RunRecord) -> list[str]:
    """The run's task kind's closing lines for ``fedsplit up`` (none for a kind without)."""
    kind = declared(task)
    if kind is None or not kind.report:
        return []
    return list(resolve(kind.report)(Path(out_dir), history))
