"""Splitting one hospital's own training across devices: ``none``, ``data``, ``model``, ``pipeline``.

One entry point, `fit_parallel`, with `client.train.fit`'s contract plus ``parallel``::

    from fedsplit.client.parallel import fit_parallel
    result = fit_parallel(model, x, y, epochs=1, lr=1e-3, batch_size=32, seed=0,
                          parallel="data:replicas=2")
    result.loss, result.metrics()   # the model itself is trained in place

See docs/site-parallel.md for the modes, device maps, the learning-rate rule and the GPipe
schedule (`gpipe_table`).
"""

from fedsplit.client.parallel.api import ParallelFit, fit_parallel
from fedsplit.client.parallel.config import MODES, ParallelConfig
from fedsplit.client.parallel.device_map import DeviceMap, default_device_map, layer_names, parse_device_map
from fedsplit.client.parallel.launch import ParallelRunError
from fedsplit.client.parallel.schedule import GPipeTable, gpipe_table

__all__ = [
    "MODES",
    "DeviceMap",
    "GPipeTable",
    "ParallelConfig",
    "ParallelFit",
    "ParallelRunError",
    "default_device_map",
    "fit_parallel",
    "gpipe_table",
    "layer_names",
    "parse_device_map",
]
