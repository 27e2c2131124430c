"""The backend seam: numba, cffi and torch are imported only by the backend modules, rules
never name a technology, and `select` alone chooses (its GPU rules checked here; the CPU ones
in test_kernels.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation import _compiled, _device, backend
from fedsplit.aggregation._device import TorchDevice, using
from fedsplit.aggregation.errors import AggregationError

AGGREGATION = Path(backend.__file__).resolve().parent

#: The only modules of aggregation/ that may import each technology.
ALLOWED = {
    "numba": {"_compiled.py", "_numba_kernels.py"},
    "cffi": {"_ckernels.py"},
    "torch": {"_device.py"},
}
#: The rules: they call `backend.<operation>` and import no backend module.
RULES = ("fedavg.py", "median.py", "trimmed_mean.py", "krum.py", "geometric_median.py")
BACKEND_MODULES = ("_compiled", "_ckernels", "_numba_kernels", "_device", "_reference")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (top level, functions, strings aside)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_only_the_backend_modules_import_numba_cffi_or_torch() -> None:
    found = {}
    for path in sorted(AGGREGATION.glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in ALLOWED and path.name not in ALLOWED[top]:
                found.setdefault(path.name, set()).add(name)
    assert not found, f"imported outside the backend modules: {found}"


def test_the_scan_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    """The check has teeth: a lazy import of torch inside a function is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import torch.cuda\n    from numba import njit\n")
    assert {"torch.cuda", "numba", "numba.njit"} <= _imports(probe)


def test_rules_call_the_backend_and_import_no_backend_module() -> None:
    for rule in RULES:
        imported = _imports(AGGREGATION / rule)
        assert "fedsplit.aggregation.backend" in imported, rule
        assert not any(n.endswith(m) for n in imported for m in BACKEND_MODULES), (rule, imported)
        assert not {n.split(".")[0] for n in imported} & set(ALLOWED), rule


def test_gpu_rules_of_select(monkeypatch) -> None:
    """A named device takes every pass; the default device takes large ones under auto only;
    FEDSPLIT_AGG_BACKEND=gpu wants a GPU and refuses --device cpu. (torch's code on the CPU
    stands in for a CUDA device.)"""
    pytest.importorskip("torch")
    monkeypatch.delenv("FEDSPLIT_AGG_KERNELS", raising=False)
    cpu_torch = TorchDevice("cpu")
    monkeypatch.delenv("FEDSPLIT_AGG_BACKEND", raising=False)
    with using(cpu_torch):  # named: every pass, whatever its size or the variable
        assert backend.select("gram", 1).name == "gpu"
        monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "numpy")
        assert backend.select("weighted_sum", 1).name == "gpu"
    monkeypatch.delenv("FEDSPLIT_AGG_BACKEND")
    default = _device._Choice(cpu_torch, False, "auto")  # what `auto` finds on a GPU machine
    token = _device._CURRENT.set(default)
    try:
        assert backend.select("trimmed_mean", backend.COMPILED_FROM).name == "gpu"
        assert backend.select("trimmed_mean", backend.COMPILED_FROM - 1).name == "numpy"
        monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "compiled")  # auto's GPU: not taken
        assert backend.select("trimmed_mean", backend.COMPILED_FROM).name == "compiled"
        monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "gpu")  # every pass
        assert backend.select("weighted_sum", 1).name == "gpu"
    finally:
        _device._CURRENT.reset(token)
    with using("cpu"), pytest.raises(AggregationError, match="asks for the CPU"):
        backend.select("gram", 1)


def test_auto_leaves_the_gram_matrix_to_numpy_at_any_size(monkeypatch) -> None:
    """Krum's Gram matrix is BLAS's tile product in either backend; under auto it stays in
    numpy (numba's start-up is not won back), while the sorting passes take the kernels from
    COMPILED_FROM values, and FEDSPLIT_AGG_BACKEND=compiled still compiles the Gram pass."""
    monkeypatch.delenv("FEDSPLIT_AGG_KERNELS", raising=False)
    monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "auto")
    big = backend.COMPILED_FROM * 300
    with using("cpu"):
        assert backend.select("gram", big).name == "numpy"
        if _compiled.missing("trimmed_mean") is None:
            assert backend.select("trimmed_mean", big).name == "compiled"
        if _compiled.missing("gram") is None:
            monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "compiled")
            assert backend.select("gram", 1).name == "compiled"


def test_gpu_backend_without_a_gpu_is_refused(monkeypatch, h) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "gpu")
    with pytest.raises(AggregationError, match=r"FEDSPLIT_AGG_BACKEND=gpu.*torch sees none"):
        backend.weighted_sum(h.make_updates(3, seed=1), np.ones(3))
