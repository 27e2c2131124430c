"""Recipes that live outside fedsplit, and hospitals whose data is folders of PNG files.

`recipe_dir` copies the worked examples of docs/recipes.md (``tests/recipes/examples/``) into a
temporary folder that is importable only through ``PYTHONPATH`` (or ``sys.path``), as a
hospital's own code would be. `png_hospitals` writes scikit-learn's 8x8 digits as grayscale PNG
files, one folder per hospital with one sub-folder per class, label-skewed: each class has a home
hospital holding 85% of its images (nothing is downloaded).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).parent / "examples"
FEDSPLIT = [sys.executable, "-c", "import sys; from fedsplit.cli.app import main; sys.exit(main())"]


def run_fedsplit(args: list[str], recipe_dir: Path | None, timeout: float = 900
                 ) -> subprocess.CompletedProcess:
    """Run the fedsplit CLI as a hospital's operator would: a fresh interpreter, with the folder
    of its own recipes on PYTHONPATH (or none), in that folder."""
    env = {**os.environ, "PYTHONPATH": str(recipe_dir) if recipe_dir else ""}
    return subprocess.run([*FEDSPLIT, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=recipe_dir or Path.cwd())


@pytest.fixture
def fedsplit() -> Callable[..., subprocess.CompletedProcess]:
    """`run_fedsplit`: ``fedsplit(args, recipe_dir)``."""
    return run_fedsplit
HOSPITALS = ("north", "south", "east")


@pytest.fixture(scope="session")
def recipe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder outside the package holding the example recipes (png_cnn.py, tabular_loss.py)
    and a second version of the PNG recipe (png_cnn_v2.py: PngCNN version 1.1)."""
    folder = tmp_path_factory.mktemp("user-recipes")
    for source in EXAMPLES.glob("*.py"):
        shutil.copy2(source, folder / source.name)
    (folder / "png_cnn_v2.py").write_text(
        '"""The PNG recipe, one version later."""\n\n'
        "from png_cnn import PngCNN\n\n\n"
        "class PngCNNv2(PngCNN):\n"
        '    """Same model, version 1.1."""\n\n'
        '    version = "1.1"\n'
    )
    return folder


@pytest.fixture
def on_path(recipe_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The example recipes importable in this test process (removed again afterwards)."""
    monkeypatch.syspath_prepend(str(recipe_dir))
    yield recipe_dir
    for name in ("png_cnn", "png_cnn_v2", "tabular_loss"):
        sys.modules.pop(name, None)


def write_png(path: Path, image: np.ndarray) -> None:
    """An 8x8 digit (values 0..16) as an 8-bit grayscale PNG."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.round(image / 16.0 * 255).astype(np.uint8), mode="L").save(path)


@pytest.fixture(scope="session")
def png_hospitals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three hospitals' PNG folders (HOSPITAL/<digit>/<n>.png) from half of sklearn's digits,
    label-skewed (class c: 85% at hospital c % 3, 7.5% at each other), and a flat folder of
    unlabelled PNGs (``unlabelled``: 40 digits no hospital holds, with their labels in
    ``labels.csv``)."""
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("png-hospitals")
    digits = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(digits.target))
    held, used = order[:40], order[40:40 + 900]
    folders = {name: root / name for name in HOSPITALS}
    for i in used:
        label = int(digits.target[i])
        home = label % 3
        share = rng.random()
        k = home if share < 0.85 else (home + 1) % 3 if share < 0.925 else (home + 2) % 3
        write_png(folders[HOSPITALS[k]] / str(label) / f"{i}.png", digits.images[i])
    flat = root / "unlabelled"
    lines = ["input,label"]
    for i in held:
        write_png(flat / f"digit-{i}.png", digits.images[i])
        lines.append(f"digit-{i}.png,{int(digits.target[i])}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return {**folders, "unlabelled": flat, "labels": root / "labels.csv"}


SIGNAL_HOSPITALS = {"north": 420, "south": 250, "east": 150}


def write_signals(path: Path, x: np.ndarray, y: np.ndarray | None) -> Path:
    """One hospital's HDF5 file: ``signals`` (N x 2 x L) and, when given, ``label``."""
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f["signals"] = x.astype(np.float32)
        if y is not None:
            f["label"] = y.astype(np.int64)
    return path


@pytest.fixture(scope="session")
def signal_hospitals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three hospitals' 2-lead signals (one HDF5 file each: 420, 250 and 150 rows) for the
    signal recipe (``tests/recipes/examples/signal_bn.py``), and ``unlabelled``: a file with
    signals but no labels. Each signal is one of scikit-learn's 8x8 digits 0-4 read as two
    leads of 32 samples, with a hospital-specific gain and offset (another device per site)."""
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("signal-hospitals")
    digits = load_digits()
    keep = np.flatnonzero(digits.target < 5)
    rng = np.random.default_rng(1)
    order = rng.permutation(keep)
    x = (digits.images[order] / 16.0).reshape(len(order), 2, 32)
    y = digits.target[order]
    files, start = {}, 0
    for k, (name, rows) in enumerate(SIGNAL_HOSPITALS.items()):
        part = slice(start, start + rows)
        gain, offset = 1.0 + 0.5 * k, 0.2 * k
        files[name] = write_signals(root / f"{name}.h5", x[part] * gain + offset, y[part])
        start += rows
    files["unlabelled"] = write_signals(root / "unlabelled.h5", x[start:start + 40], None)
    return files
