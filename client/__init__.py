"""The hospital agent: Flower ClientApp (`client.app`), models, trainers and data loading."""

# `import client` (its bare folder name) would load every module twice: refused
try:
    from fedsplit import only_as_fedsplit
except ImportError:  # Python found a clone's folder named fedsplit first: see fedsplit/__init__.py
    import runpy
    from pathlib import Path

    _repair = Path(__file__).resolve().parents[1] / "fedsplit" / "_clone_root.py"
    runpy.run_path(str(_repair))["adopt"](__file__)
    from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
