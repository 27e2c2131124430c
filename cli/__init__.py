"""The ``fedsplit`` command line: thin commands over the library packages, one module each."""

import os

# One BLAS/OpenMP thread per process, set before numpy or torch load: the coordinator and the
# simulated hospitals share few cores, and oversubscribed thread pools made aggregation and
# small training jobs 10-70x slower on 2 cores (measured).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# `import cli` (its bare folder name) would load every module twice: refused
from fedsplit import only_as_fedsplit  # noqa: E402

only_as_fedsplit(__name__)
