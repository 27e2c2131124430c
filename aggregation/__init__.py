"""Aggregation strategies and their registry (no Flower, no FastAPI).

Importing this package registers every built-in strategy. Look one up with
`get_strategy(name, params)`; list them with `describe_strategies()`; run one with
`aggregate_updates`, or fold a round's updates in one at a time (`Fold`). The rules are built
from six operations of `aggregation.backend`, which
runs each pass on the numpy reference, compiled kernels (C through cffi, numba) or a CUDA GPU
(torch), as the `BackendSettings` passed in decide (built once at start-up, e.g. from
``FEDSPLIT_AGG_BACKEND`` by `BackendSettings.from_environ`); importing this package imports
none of numba, cffi or torch.
"""

from fedsplit.aggregation import fedavg as _fedavg  # noqa: F401  (registers "fedavg")
from fedsplit.aggregation import geometric_median as _geometric_median  # noqa: F401  (registers "geometric-median")
from fedsplit.aggregation import krum as _krum  # noqa: F401  (registers "krum", "multi-krum")
from fedsplit.aggregation import median as _median  # noqa: F401  (registers "median")
from fedsplit.aggregation import trimmed_mean as _trimmed_mean  # noqa: F401  (registers "trimmed-mean")
from fedsplit.aggregation._blocks import DEFAULT_MEMORY_BUDGET
from fedsplit.aggregation.base import (
    AggregateResult,
    AggregationReport,
    AggregationStrategy,
    SiteReport,
    StrategyParams,
)
from fedsplit.aggregation.compat import check_compatible
from fedsplit.aggregation.errors import (
    AggregationError,
    IncompatibleUpdatesError,
    NotEnoughUpdatesError,
    StrategyParamsError,
    UnknownStrategyError,
)
from fedsplit.aggregation.registry import (
    describe_strategies,
    get_strategy,
    parse_param_pairs,
    register,
    strategy_names,
)
from fedsplit.aggregation.run import aggregate_updates
from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.aggregation.stream import Fold

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "DEFAULT_SETTINGS",
    "AggregateResult",
    "AggregationError",
    "AggregationReport",
    "AggregationStrategy",
    "BackendSettings",
    "Fold",
    "IncompatibleUpdatesError",
    "NotEnoughUpdatesError",
    "SiteReport",
    "StrategyParams",
    "StrategyParamsError",
    "UnknownStrategyError",
    "aggregate_updates",
    "check_compatible",
    "describe_strategies",
    "get_strategy",
    "parse_param_pairs",
    "register",
    "strategy_names",
]

# `import aggregation` (its bare folder name) would load every module twice: refused
try:
    from fedsplit import only_as_fedsplit
except ImportError:  # Python found a clone's folder named fedsplit first: see fedsplit/__init__.py
    import runpy
    from pathlib import Path

    _repair = Path(__file__).resolve().parents[1] / "fedsplit" / "_clone_root.py"
    runpy.run_path(str(_repair))["adopt"](__file__)
    from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
