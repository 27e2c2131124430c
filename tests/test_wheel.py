"""The built wheel installs fedsplit as one namespace, beside a user's own server.py / client.py.

A Flower project folder often holds ``server.py``, ``client.py`` and ``cli.py`` (Flower's older
examples all do). Python puts the working folder first on ``sys.path``, so a package installed
as top-level ``server`` would be shadowed there; installed as ``fedsplit.server`` it cannot be.

The wheel is built from this checkout offline (hatchling from the dev extras, no build
isolation) and installed with ``--no-deps --no-index`` into a fresh venv; the dependencies
(torch, Flower, ...) come from the development venv's site-packages through a plain path entry,
which adds the folder but not its ``.pth`` hooks, so the checkout's editable install stays out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

# Building the wheel, a fresh venv and a fresh interpreter importing torch take ~10 s: these run
# with the slow tests (CI, `make test`), where the wheel is built once for all three.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
USER_FILES = {
    "server.py": "raise SystemExit('the user folder server.py was imported instead of fedsplit')\n",
    "client.py": "raise SystemExit('the user folder client.py was imported instead of fedsplit')\n",
    "cli.py": "raise SystemExit('the user folder cli.py was imported instead of fedsplit')\n",
}


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, (
        f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(dist), str(ROOT)], timeout=300)
    (wheel,) = dist.glob("fedsplit-*.whl")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     timeout=60).stdout.strip())
    dev_site = sysconfig.get_paths()["purelib"]
    (site / "fedsplit_test_dependencies.pth").write_text(dev_site + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
          "--no-index", str(wheel)], timeout=300)
    # Flower's console scripts (flower-superlink, flwr, ...) for this venv's interpreter
    for script in Path(sys.executable).parent.iterdir():
        if script.name.startswith(("flwr", "flower-")) and script.is_file():
            lines = script.read_text().splitlines(keepends=True)
            if lines and lines[0].startswith("#!"):
                target = venv / "bin" / script.name
                target.write_text(f"#!{python}\n" + "".join(lines[1:]))
                target.chmod(0o755)
    user = base / "user-project"
    user.mkdir()
    for name, text in USER_FILES.items():
        (user / name).write_text(text)
    return {"venv": venv, "python": python, "site": site, "user": user, "wheel": wheel}


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    return env


def test_wheel_holds_only_the_fedsplit_namespace(installed: dict[str, Path]) -> None:
    import zipfile

    tops = {name.split("/")[0] for name in zipfile.ZipFile(installed["wheel"]).namelist()}
    assert tops == {"fedsplit", installed["wheel"].name.split("-py3")[0] + ".dist-info"}, tops


def test_installed_wheel_imports_beside_user_server_client_cli(installed: dict[str, Path]) -> None:
    probe = ("import json, fedsplit, fedsplit.server.strategy as s, fedsplit.client.app as c, "
             "fedsplit.cli.app as a; from fedsplit.server.strategy import RegistryStrategy; "
             "print(json.dumps([fedsplit.__file__, s.__file__, c.__file__, a.__file__]))")
    done = _run([str(installed["python"]), "-c", probe], cwd=installed["user"], env=_env(installed["venv"]),
                timeout=300)
    files = json.loads(done.stdout.strip().splitlines()[-1])
    for file in files:
        assert Path(file).is_relative_to(installed["site"] / "fedsplit"), files
    help_out = _run([str(installed["venv"] / "bin" / "fedsplit"), "--help"], cwd=installed["user"],
                    env=_env(installed["venv"]), timeout=300)
    assert "simulate" in help_out.stdout


def test_installed_wheel_runs_simulate_beside_user_files(installed: dict[str, Path]) -> None:
    """`fedsplit simulate` from the installed wheel, in the user's folder: a real Flower run."""
    out = installed["user"] / "run"
    _run([str(installed["venv"] / "bin" / "fedsplit"), "simulate", "--dataset", "breast-cancer",
          "--sites", "2", "--rounds", "1", "--out", str(out)], cwd=installed["user"],
         env=_env(installed["venv"]), timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["federated"]["metrics"]["accuracy"] > 0.5
    staged = out / "flower"
    assert any(p.name == "fedsplit" for p in staged.rglob("fedsplit")), "the staged app ships fedsplit/"
