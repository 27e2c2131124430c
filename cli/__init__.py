"""The ``fedsplit`` command line: thin commands over the library packages, one module each."""

import os

# One BLAS/OpenMP thread per process, set before numpy or torch load: the coordinator and the
# simulated hospitals share few cores, and oversubscribed thread pools made aggregation and
# small training jobs 10-70x slower on 2 cores (measured).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# `import cli` (its bare folder name) would load every module twice: refused
try:
    from fedsplit import only_as_fedsplit
except ImportError:  # Python found a clone's folder named fedsplit first: see fedsplit/__init__.py
    from pathlib import Path

    _repair: dict = {}
    exec(Path(__file__).resolve().parents[1].joinpath("fedsplit", "_clone_root.py").read_text(),
         _repair)
    _repair["adopt"](__file__)
    from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
