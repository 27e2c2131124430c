"""Runs and supervises federations: what the ``fedsplit`` commands call.

- `experiment`: a simulated federation end to end (site data, Flower run, baselines, summary);
  `comparison`: the same federation under several strategies;
- `flower_runtime`: Flower's own runtime as local processes (simulation engine, deployment
  commands) and the staged Flower app;
- `local_federation`: SuperLink, coordinator, hospital agents and admin API as supervised local
  processes (``fedsplit up``); `site_agent`: a hospital's supervised SuperNode (``fedsplit site run``);
- `certs`: test CA, SuperLink certificate and SuperNode keys; `fingerprint`: what each site's data
  file holds, so a resumed run cannot silently switch data; `plots`: the per-round figures;
- `vertical`: the same for vertical federations (bundled site files, in-process runs, predict).

It builds on every other package (protocol, aggregation, server, client); nothing but the CLI,
the benchmarks and the tests imports it.
"""

# `import orchestration` (its bare folder name) would load every module twice: refused
try:
    from fedsplit import only_as_fedsplit
except ImportError:  # Python found a clone's folder named fedsplit first: see fedsplit/__init__.py
    import runpy
    from pathlib import Path

    _repair = Path(__file__).resolve().parents[1] / "fedsplit" / "_clone_root.py"
    runpy.run_path(str(_repair))["adopt"](__file__)
    from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
