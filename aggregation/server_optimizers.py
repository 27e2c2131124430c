"""Server optimizers over any aggregation rule (Reddi et al. 2021, "Adaptive Federated
Optimization"; server momentum: Hsu et al. 2019, FedAvgM).

The registry rule (FedAvg, median, trimmed mean, Krum, ...) turns the round's replies into an
aggregate ``a``; with ``x`` the global model sent out that round, the pseudo-gradient is
``d = a - x`` and the server takes one optimizer step on it (Reddi et al., Algorithm 2)::

    m = beta1 * m + (1 - beta1) * d
    adagrad: v = v + d**2
    adam:    v = beta2 * v + (1 - beta2) * d**2
    yogi:    v = v - (1 - beta2) * d**2 * sign(v - d**2)
    x = x + lr * m / (sqrt(v) + tau)

    avgm:    m = momentum * m + d;  x = x + lr * m

``m`` starts at 0 and ``v`` at ``tau**2`` (the paper's v_{-1} >= tau^2). Because the step acts on
whatever the rule produced, robust and adaptive compose (median + Adam). Arrays whose names end
in `RUNNING_STATS` (BatchNorm running statistics and counters) are statistics, not weights:
they take the rule's aggregate as it is. The state (``m``, ``v``, step count) is plain numpy
so the coordinator can checkpoint it with each round (`state_arrays` / `load_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from fedsplit.protocol.errors import ConfigError

OPTIMIZERS = ("adam", "yogi", "adagrad", "avgm")
#: Default server learning rates (used when the run gives 0).
DEFAULT_LR = {"adam": 0.01, "yogi": 0.01, "adagrad": 0.01, "avgm": 1.0}
RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass
class ServerOptimizer:
    """One server optimizer and its state.

    Parameters
    ----------
    name : str
        ``adam``, ``yogi``, ``adagrad`` or ``avgm``.
    lr : float (default: 0.0)
        Server learning rate; 0 takes `DEFAULT_LR` of ``name``.
    beta1, beta2 : float (default: 0.9, 0.99)
        Moment decays (``beta2`` is unused by adagrad).
    tau : float (default: 1e-3)
        Adaptivity: the denominator is ``sqrt(v) + tau``.
    momentum : float (default: 0.9)
        avgm's momentum.
    """

    name: str
    lr: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    momentum: float = 0.9
    step_count: int = 0
    m: dict[str, np.ndarray] = field(default_factory=dict)
    v: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"server-opt must be one of {', '.join(OPTIMIZERS)} (or none). "
                              f"Received: {self.name!r}")
        if self.lr < 0 or self.tau <= 0 or not 0 <= self.beta1 < 1 or not 0 <= self.beta2 < 1 \
                or not 0 <= self.momentum < 1:
            raise ConfigError(
                f"Server optimizer settings out of range: server-lr >= 0, server-tau > 0, betas "
                f"and momentum in [0, 1). Received: lr={self.lr}, tau={self.tau}, "
                f"beta1={self.beta1}, beta2={self.beta2}, momentum={self.momentum}"
            )
        if self.lr == 0:
            self.lr = DEFAULT_LR[self.name]

    def step(self, current: Mapping[str, np.ndarray],
             aggregate: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the new global model: one step on ``aggregate - current``."""
        if list(current) != list(aggregate):
            raise ConfigError(
                "The server optimizer needs the aggregate and the global model it started from to "
                "hold the same parameters in the same order. Received: "
                f"{list(aggregate)[:4]} vs {list(current)[:4]}"
            )
        self.step_count += 1
        out: dict[str, np.ndarray] = {}
        for name, x in current.items():
            a = np.asarray(aggregate[name])
            if name.endswith(RUNNING_STATS):
                out[name] = a
                continue
            x64 = np.asarray(x, dtype=np.float64)
            d = a.astype(np.float64) - x64
            m = self.m.get(name, np.zeros_like(d))
            if self.name == "avgm":
                m = self.momentum * m + d
                new = x64 + self.lr * m
            else:
                m = self.beta1 * m + (1 - self.beta1) * d
                v = self.v.get(name, np.full_like(d, self.tau**2))
                d2 = d * d
                if self.name == "adagrad":
                    v = v + d2
                elif self.name == "adam":
                    v = self.beta2 * v + (1 - self.beta2) * d2
                else:  # yogi
                    v = v - (1 - self.beta2) * d2 * np.sign(v - d2)
                self.v[name] = v
                new = x64 + self.lr * m / (np.sqrt(v) + self.tau)
            self.m[name] = m
            out[name] = new.astype(a.dtype)
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The state as named float64 arrays (``m.<param>``, ``v.<param>``) for a checkpoint."""
        arrays = {f"m.{k}": v for k, v in self.m.items()}
        arrays.update({f"v.{k}": v for k, v in self.v.items()})
        return {k: np.asarray(v, dtype=np.float64) for k, v in arrays.items()}

    def load_state(self, arrays: Mapping[str, np.ndarray], step_count: int) -> None:
        """Restore a checkpoint written from `state_arrays` after ``step_count`` steps."""
        m, v = {}, {}
        for key, value in arrays.items():
            kind, _, name = key.partition(".")
            if kind not in ("m", "v") or not name:
                raise ConfigError(f"Not a server-optimizer state array (m.NAME or v.NAME). "
                                  f"Received: {key!r}")
            (m if kind == "m" else v)[name] = np.asarray(value, dtype=np.float64)
        self.m, self.v, self.step_count = m, v, int(step_count)
