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
    import runpy
    from pathlib import Path

    _repair = Path(__file__).resolve().parents[1] / "fedsplit" / "_clone_root.py"
    runpy.run_path(str(_repair))["adopt"](__file__)
    from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
