"""Start-up of ``fedsplit aggregate``: what it imports, which kernels it loads, lazy commands.

Each process check runs ``fedsplit`` in a fresh interpreter (the test process has imported
everything already) and prints what got loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
import typer
from fedsplit.cli.app import COMMANDS, app
from fedsplit.protocol import Update, write_weights
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]

#: Runs ``fedsplit ARGS`` in-process, then prints the modules loaded and, per compiled
#: kernel, how many signatures it has loaded.
PROBE = """
import json, sys
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
code = run_guarded(app, sys.argv[1:])
loaded = {}
kernels = sys.modules.get("fedsplit.aggregation._numba_kernels")
if kernels is not None:
    from numba.core.registry import CPUDispatcher
    loaded = {n: len(v.overloads) for n, v in vars(kernels).items()
              if isinstance(v, CPUDispatcher) and v.overloads}
print(json.dumps({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules}),
                  "full": sorted(sys.modules), "kernels": loaded}))
"""

HEAVY = ("torch", "flwr", "pandas", "fastapi", "sklearn", "starlette", "uvicorn")


def _probe(args: list[str], **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, **env}, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    rng = np.random.default_rng(3)
    return [
        write_weights(Update({"w": rng.normal(size=(40, 25)).astype(np.float32),
                              "b": rng.normal(size=25).astype(np.float32)},
                             num_examples=10 + k, site=f"h{k}"), tmp_path / f"h{k}.h5")
        for k in range(5)
    ]


def test_aggregate_imports_no_heavy_package_and_no_numba_for_fedavg(files, tmp_path) -> None:
    """FedAvg over files: none of torch, flwr, pandas, FastAPI, sklearn, scipy, numba."""
    got = _probe(["aggregate", *map(str, files), "-o", str(tmp_path / "g.h5")])
    assert got["code"] == 0
    assert not set(HEAVY) & set(got["modules"])
    assert "numba" not in got["modules"] and "scipy" not in got["modules"]
    assert {"numpy", "h5py", "typer"} <= set(got["modules"])


def test_median_loads_only_its_kernel_from_the_cache_without_numbas_refresh(files, tmp_path) -> None:
    """With the kernels forced on, median loads one compiled kernel (its own, one signature),
    installed from the cache without numba's registry refresh (which would import its typed
    containers, random generators and CFFI support) and without scipy.linalg (numba itself
    imports the bare ``scipy`` package, about 12 ms, to check its version)."""
    pytest.importorskip("numba")
    args = ["aggregate", *map(str, files), "-o", str(tmp_path / "m.h5"), "--strategy", "median"]
    _probe(args, FEDSPLIT_AGG_BACKEND="compiled")  # compiles into the cache if it is cold
    got = _probe(args, FEDSPLIT_AGG_BACKEND="compiled")
    assert got["code"] == 0
    assert got["kernels"] == {"trim_tile": 1}
    assert "numba" in got["modules"]
    refreshed_only = {"numba.typed.typedset", "numba.np.random.generator_core",
                      "numba.core.typing.cffi_utils", "scipy.linalg"}
    assert not refreshed_only & set(got["full"])
    assert not {"cffi", "pycparser", *HEAVY} & set(got["modules"])


KERNEL_CASES = """
import sys
import numpy as np
from fedsplit.aggregation import get_strategy
from fedsplit.protocol import Update
rng = np.random.default_rng(5)
ups = [Update({"w": rng.normal(size=(300, 40)).astype(np.float32)}, num_examples=5 + k,
              site=f"h{k}") for k in range(9)]
out = []
for name, params in [("median", {}), ("trimmed-mean", {"beta": 0.2}), ("krum", {"f": 2}),
                     ("median", {"weighted": True}),
                     ("trimmed-mean", {"beta": 0.2, "weighted": True}), ("fedavg", {})]:
    res = get_strategy(name, params).aggregate(ups)
    out.append(np.asarray(res.arrays["w"], np.float64).ravel())
    out.append(np.array([s.l2_to_aggregate or 0.0 for s in res.report.sites]))
np.save(sys.argv[1], np.concatenate(out))
"""


def test_kernels_loaded_without_refresh_equal_the_reference_in_a_fresh_process(tmp_path) -> None:
    """Every order-statistic and Krum kernel, first called in a fresh process (installed from
    the cache without numba's refresh), gives the numpy reference's aggregate and distances."""
    pytest.importorskip("numba")
    results = {}
    for mode in ("compiled", "compiled", "numpy"):  # the first run fills a cold cache
        path = tmp_path / f"{mode}.npy"
        done = subprocess.run([sys.executable, "-c", KERNEL_CASES, str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "FEDSPLIT_AGG_BACKEND": mode})
        assert done.returncode == 0, done.stderr[-2000:]
        results[mode] = np.load(path)
    np.testing.assert_allclose(results["compiled"], results["numpy"], rtol=1e-5, atol=1e-5)


def test_help_loads_only_the_command_asked_for() -> None:
    """``fedsplit aggregate --help`` imports cli.aggregate and no other command's module."""
    got = _probe(["aggregate", "--help"])
    assert got["code"] == 0
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from fedsplit.cli.app import app; "
         "from fedsplit.cli.errors import run_guarded; run_guarded(app, ['aggregate', '--help']); "
         "print(sorted(m for m in sys.modules if m.startswith('fedsplit.cli.')))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    modules = done.stdout.strip().splitlines()[-1]
    assert "'fedsplit.cli.aggregate'" in modules
    for name in ("simulate", "up", "upload", "vertical", "admin"):
        other = f"fedsplit.cli.{name}"
        assert f"'{other}'" not in modules


def test_every_command_is_listed_in_order_and_builds_as_registered() -> None:
    """``fedsplit --help`` lists every command of `COMMANDS` in order; each one resolves to a
    command with its module's help (a group keeps its subcommands)."""
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    lines = [line.strip("│ ").split(" ")[0] for line in result.output.splitlines()]
    positions = [lines.index(name) for name, _, _ in COMMANDS]
    assert positions == sorted(positions)
    group = typer.main.get_command(app)
    ctx = click.Context(group)
    assert group.list_commands(ctx) == [name for name, _, _ in COMMANDS]
    for name, module, attr in COMMANDS:
        cmd = group.get_command(ctx, name)
        assert cmd is not None and cmd.name == name
        target = getattr(sys.modules[module], attr)
        if isinstance(target, typer.Typer):
            assert isinstance(cmd, click.Group) and cmd.list_commands(ctx)
        else:
            assert (cmd.help or "").split("\n")[0] == target.__doc__.split("\n")[0]


def test_unknown_command_suggests_the_close_one() -> None:
    result = CliRunner().invoke(app, ["aggregat"])
    assert result.exit_code != 0
    assert "Did you mean 'aggregate'?" in result.output


#: Runs the console-script entry point with an exit handler that says whether the
#: interpreter's teardown ran.
MAIN_PROBE = """
import atexit, sys
atexit.register(lambda: print("teardown ran", file=sys.stderr, flush=True))
from fedsplit.cli.app import main
sys.argv[0] = "fedsplit"
main()
"""


def test_a_successful_aggregate_ends_without_the_teardown_and_loses_no_output(files, tmp_path) -> None:
    """`fedsplit aggregate` ends with `os._exit` once everything is written: the whole report
    reaches a piped stdout, the model and report files are complete, the exit code is 0; the
    interpreter's teardown (here an exit handler) is skipped. A failing aggregate and every
    other command end normally, teardown included."""
    from fedsplit.protocol import open_weights

    out = tmp_path / "m.h5"
    done = subprocess.run(
        [sys.executable, "-c", MAIN_PROBE, "aggregate", *map(str, files), "-o", str(out),
         "--strategy", "median"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "teardown ran" not in done.stderr
    # The last line printed arrived, whole: on a pipe rich wraps it at 80 columns and folds a
    # path longer than that (pytest-xdist's tmp_path, .../popen-gw0/..., is 86 characters), so
    # the line breaks are taken out before comparing with the report's full path.
    assert done.stdout.replace("\n", "").rstrip().endswith(str(tmp_path / "m.report.json"))
    assert "total" in done.stdout and "h4" in done.stdout
    with open_weights(out) as f:
        assert f.header.num_examples == sum(10 + k for k in range(5))
    assert json.loads((tmp_path / "m.report.json").read_text())["strategy"] == "median"

    failed = subprocess.run(
        [sys.executable, "-c", MAIN_PROBE, "aggregate", str(tmp_path / "missing.h5"), "-o",
         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert failed.returncode != 0
    assert "WeightFileError" in failed.stderr and "teardown ran" in failed.stderr
    other = subprocess.run([sys.executable, "-c", MAIN_PROBE, "strategies"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 0 and "teardown ran" in other.stderr
