"""The GPipe tick table: which micro-batch each stage works on at each tick.

One tick is one micro-batch through one stage (forward or backward, drawn as equal; on real
hardware a backward takes about twice a forward). Forward: stage ``s`` runs micro-batch ``m``
at tick ``s + m``. Backward starts when the last stage has all M outputs, runs from the last
stage to the first, and stage ``s`` runs micro-batch ``m`` backward at tick
``F + (S - 1 - s) + m`` with ``F = S + M - 1`` forward ticks, the order in which
`torch.distributed.pipelining.ScheduleGPipe` does it. So the forward half takes ``S + M - 1``
ticks instead of ``S * M`` one stage at a time, and the idle share (bubble) is
``(S - 1) / (S + M - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsplit.protocol.errors import ConfigError

MAX_SIDE = 64


@dataclass(frozen=True)
class GPipeTable:
    """A GPipe schedule of ``stages`` x ``microbatches``.

    ``cells[s][t]`` is ``"F<m>"``, ``"B<m>"`` or ``""`` (idle) for stage ``s`` at tick ``t``;
    ``phases[t]`` is ``fill``, ``steady`` or ``drain`` (forward half) and
    ``backward fill`` / ``backward steady`` / ``backward drain`` (backward half).
    """

    stages: int
    microbatches: int
    cells: tuple[tuple[str, ...], ...]
    phases: tuple[str, ...]

    @property
    def forward_ticks(self) -> int:
        """Ticks of the forward half: ``S + M - 1``."""
        return self.stages + self.microbatches - 1

    @property
    def sequential_ticks(self) -> int:
        """Forward ticks without pipelining (one micro-batch through all stages at a time)."""
        return self.stages * self.microbatches

    @property
    def bubble(self) -> float:
        """Share of stage-ticks left idle: ``(S - 1) / (S + M - 1)``."""
        busy = sum(1 for row in self.cells for c in row if c)
        return 1 - busy / (self.stages * len(self.phases))


def _phase(busy: int, peak: int, rising: bool) -> str:
    if busy == peak:
        return "steady"
    return "fill" if rising else "drain"


def gpipe_table(stages: int, microbatches: int) -> GPipeTable:
    """Build the tick table (see the module docstring)."""
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIDE:
            raise ConfigError(f"--{name} must be an integer from 1 to {MAX_SIDE}. Received: {value!r}")
    s_count, m_count = stages, microbatches
    half = s_count + m_count - 1
    grid = [[""] * (2 * half) for _ in range(s_count)]
    for s in range(s_count):
        for m in range(m_count):
            grid[s][s + m] = f"F{m}"
            grid[s][half + (s_count - 1 - s) + m] = f"B{m}"
    peak = min(s_count, m_count)
    phases = []
    for t in range(2 * half):
        local = t % half
        busy = sum(1 for s in range(s_count) if grid[s][t])
        phase = _phase(busy, peak, rising=local < peak - 1)
        phases.append(phase if t < half else f"backward {phase}")
    return GPipeTable(s_count, m_count, tuple(tuple(r) for r in grid), tuple(phases))
