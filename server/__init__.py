"""The coordinator: Flower ServerApp (`server.app`) and the admin API, thin over `aggregation`."""

# `import server` (its bare folder name) would load every module twice: refused
try:
    from fedsplit import only_as_fedsplit
except ImportError:  # Python found a clone's folder named fedsplit first: see fedsplit/__init__.py
    import sys
    from pathlib import Path

    _root = sys.modules.get("fedsplit")
    if _root is None or getattr(_root, "__file__", "") is not None:
        raise
    _root.__file__ = str(Path(__file__).resolve().parents[1] / "fedsplit" / "__init__.py")
    _root.__path__ = [str(Path(_root.__file__).parent)]
    exec(compile(Path(_root.__file__).read_text(), _root.__file__, "exec"), vars(_root))
    from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
