"""Which of a model's tensors hold the federation's statistics: the hospital's half of set-up in
one exchange (issue 32; `protocol.horizontal_wire.ModelCheck`).

A hospital's ``query.setup`` reply carries the fingerprint of the model it builds (seeded, as
``query.init`` builds it; `protocol.horizontal_wire.ModelPrint`): every tensor's name, shape and
dtype, and a digest of the values of every tensor its statistics do not fill, which must be the
same at every hospital. The hospital says which tensors its recipe's ``set_statistics`` writes
(left undigested) and with what (`protocol.horizontal_wire.STATISTIC_SOURCES`), so the
coordinator can check that the starting model holds the pooled statistics there. It finds out by trying:
two fresh copies of the model get two different, made-up sets of statistics (one with a
standard deviation under the floor); every tensor that differs between them must then hold
exactly one statistic, as `protocol.model_plan.statistic_value` places it, in both. A
recipe whose ``set_statistics`` does anything else (derives a tensor, floors otherwise,
writes nothing that differs) gets None.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import model_plan
from fedsplit.protocol.update import state_dict_arrays
from torch import nn

Statistics = tuple[np.ndarray, np.ndarray, float, float]  # mean, std, y-mean, y-std


def probes(size: int) -> tuple[Statistics, Statistics]:
    """Two made-up sets of statistics for ``size`` features whose every entry differs between
    the two and from every other statistic's; the second floors its first std entry (0 -> 1)
    and keeps a tiny second one (2e-6), the target's std floored too."""
    i = np.arange(size, dtype=np.float64)
    first = (0.5 + 0.25 * i, 1.25 + 0.5 * i, 3.25, 2.5)
    std = 3.0 + 0.75 * i
    std[0] = 0.0
    if size > 1:
        std[1] = 2e-6
    return first, (-1.5 - 0.125 * i, std, -7.5, 0.0)


def probe_statistics(model: nn.Module, size: int,
                     set_statistics: Callable[[nn.Module, np.ndarray, np.ndarray, float, float],
                                              None]
                     ) -> tuple[dict[str, str] | None, tuple[str, ...]]:
    """Which tensors ``set_statistics`` writes: (tensor name -> the statistic it stores, for
    every tensor it writes, or None when that is not a plain placement of the statistics
    (module docstring); the names of every tensor whose values depend on the statistics, which
    the model check's fingerprint leaves undigested). ``model`` is left unchanged; ``size``: the
    number of feature statistics (the mean's length)."""
    states = []
    for mean, std, y_mean, y_std in probes(size):
        probe = copy.deepcopy(model)
        set_statistics(probe, mean, std, y_mean, y_std)
        states.append(state_dict_arrays(probe.state_dict()))
    first, second = states
    varying = tuple(name for name in first if name not in second
                    or first[name].shape != second[name].shape
                    or not np.array_equal(first[name], second[name]))
    if list(first) != list(second):
        return None, varying
    found: dict[str, str] = {}
    for name in varying:
        sources = [source for source in wire.STATISTIC_SOURCES
                   if all(_holds(state[name], source, stats)
                          for state, stats in zip(states, probes(size), strict=True))]
        if len(sources) != 1:
            return None, varying
        found[name] = sources[0]
    return found or None, varying


def _holds(array: np.ndarray, source: str, stats: Statistics) -> bool:
    expected = model_plan.statistic_value(source, array.shape, array.dtype, *stats)
    return expected is not None and np.array_equal(expected, array)
