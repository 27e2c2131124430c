"""The hospital agent: Flower ClientApp (`client.app`), models, trainers and data loading."""

# `import client` (its bare folder name) would load every module twice: refused
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
