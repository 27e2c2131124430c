"""The backend seam: numba, cffi and torch are imported only by the backend modules, rules
never name a technology, and `BackendSettings.select` alone chooses (its GPU rules checked here; the CPU ones
in test_kernels.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation import _compiled, _device, backend
from fedsplit.aggregation._device import TorchDevice
from fedsplit.aggregation.errors import AggregationError
from fedsplit.aggregation.settings import COMPILED_FROM, BackendSettings

from fedsplit import aggregation

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
    mode gpu (FEDSPLIT_AGG_BACKEND=gpu) wants a GPU and refuses --device cpu. (torch's code on
    the CPU stands in for a CUDA device.)"""
    pytest.importorskip("torch")
    cpu_torch = TorchDevice("cpu")
    named = BackendSettings(device=cpu_torch)  # named: every pass, whatever its size or mode
    assert named.select("gram", 1).name == "gpu"
    assert BackendSettings(mode="numpy", device=cpu_torch).select("weighted_sum", 1).name == "gpu"
    # what `auto` finds on a GPU machine
    monkeypatch.setattr(_device, "resolve", lambda spec: _device.Choice(cpu_torch, False, "auto"))
    auto = BackendSettings()
    assert auto.select("trimmed_mean", COMPILED_FROM).name == "gpu"
    assert auto.select("trimmed_mean", COMPILED_FROM - 1).name == "numpy"
    # compiled: auto's GPU not taken; gpu: every pass
    assert BackendSettings(mode="compiled").select("trimmed_mean", COMPILED_FROM).name == "compiled"
    assert BackendSettings(mode="gpu").select("weighted_sum", 1).name == "gpu"
    monkeypatch.undo()
    with pytest.raises(AggregationError, match="asks for the CPU"):
        BackendSettings(mode="gpu", device="cpu").select("gram", 1)


def test_auto_leaves_the_gram_matrix_to_numpy_at_any_size() -> None:
    """Krum's Gram matrix is BLAS's tile product in either backend; under auto it stays in
    numpy (numba's start-up is not won back), while the sorting passes take the kernels from
    COMPILED_FROM values, and mode compiled still compiles the Gram pass."""
    big = COMPILED_FROM * 300
    auto = BackendSettings(device="cpu")
    assert auto.select("gram", big).name == "numpy"
    if _compiled.missing("trimmed_mean") is None:
        assert auto.select("trimmed_mean", big).name == "compiled"
    if _compiled.missing("gram") is None:
        assert BackendSettings(mode="compiled", device="cpu").select("gram", 1).name == "compiled"


def test_settings_are_read_once_and_passed_in(monkeypatch, h) -> None:
    """The environment is read when the settings are built (`from_environ`, where a process
    starts), never during a pass: changing it afterwards changes nothing, and each setting is
    checked when built."""
    monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "numpy")
    monkeypatch.setenv("FEDSPLIT_AGG_THREADS", "3")
    built = BackendSettings.from_environ(os.environ, device="cpu")
    assert (built.mode, built.device, built.threads) == ("numpy", "cpu", 3)
    monkeypatch.setenv("FEDSPLIT_AGG_BACKEND", "gpu")  # too late: the settings are built
    monkeypatch.setenv("FEDSPLIT_AGG_THREADS", "x")
    chosen = built.select("weighted_sum", 1 << 30)
    assert (chosen.name, chosen.workers) == ("numpy", 3)
    updates = h.make_updates(3, seed=2)
    mean = backend.weighted_sum(updates, np.ones(3), settings=built)
    for name, got in mean.arrays.items():
        np.testing.assert_allclose(got, np.mean([u.arrays[name] for u in updates], axis=0),
                                   rtol=1e-5, atol=1e-6)
    assert BackendSettings.from_environ({}).mode == "auto"
    with pytest.raises(AggregationError, match="Received: 'fast'"):
        BackendSettings(mode="fast")
    with pytest.raises(AggregationError, match=r"'cuda:N'\. Received: 'gpu0'"):
        BackendSettings(device="gpu0")
    with pytest.raises(AggregationError, match=r"whole number >= 1\. Received: 0"):
        BackendSettings(threads=0)
    with pytest.raises(AggregationError, match="FEDSPLIT_AGG_THREADS must be a whole number"):
        BackendSettings.from_environ({"FEDSPLIT_AGG_THREADS": "many"})


def test_gpu_backend_without_a_gpu_is_refused(monkeypatch, h) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(AggregationError, match=r"FEDSPLIT_AGG_BACKEND=gpu.*torch sees none"):
        backend.weighted_sum(h.make_updates(3, seed=1), np.ones(3),
                             settings=BackendSettings(mode="gpu"))


@pytest.mark.parametrize("name", ["fedavg", "median", "trimmed-mean", "krum", "geometric-median"])
def test_no_pass_reads_the_environment(monkeypatch, h, name) -> None:
    """With the settings passed in, every rule (and aggregate_updates' guard and distance pass)
    runs without asking the environment again: the readers fail if called."""
    from fedsplit.aggregation import _threads, settings

    given = BackendSettings.from_environ({"FEDSPLIT_AGG_THREADS": "2"}, device="cpu")

    def refuse(*_args, **_kw):
        raise AssertionError("the environment was read during an aggregation")

    monkeypatch.setattr(settings, "_mode_from", refuse)
    monkeypatch.setattr(settings, "worker_count", refuse)
    monkeypatch.setattr(_threads, "worker_count", refuse)
    monkeypatch.setattr(_threads, "THREADED_FROM", 0)  # the threaded paths too
    params = {"krum": {"f": 1}, "trimmed-mean": {"beta": 0.2}}.get(name, {})
    rule = aggregation.get_strategy(name, params)
    result = aggregation.aggregate_updates(rule, h.make_updates(7, seed=3), settings=given)
    assert all(s.l2_to_aggregate is not None for s in result.report.sites)
