"""``fedsplit up``'s sequencing: a federation of simulated hospitals as local processes.

`run_up` checks the run config against the strategy factory (`server.compose`), then either
submits it to a running SuperLink (``superlink``: compose's federation job; the hospitals hold
their own data; the SuperLink must accept a connection within ``connect_timeout``) or, on
127.0.0.1: writes each hospital's partition under WORK/sites (or, with ``site_files``, takes
each hospital's own file as it is, read first exactly as its agent will read it), puts the
data's fingerprint in the run config, refuses to resume an unfinished run on other data (before
any process starts), starts the `LocalFederation` (SuperLink, coordinator, one agent per
hospital, admin API) and runs the federation to its end. SIGTERM stops every process it
started, like Ctrl-C.

A run that ends without a model (no round trained, or no global.h5) raises `NoTrainingError`
with each hospital's reason (`check_trained`): it is never reported as a success.
"""

from __future__ import annotations

import hashlib
import json
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from fedsplit.client.site import recipe_line
from fedsplit.client.survival.tcga import DATASET as TCGA
from fedsplit.orchestration.experiment import SiteSource, _left_out, prepare_partitions
from fedsplit.orchestration.fingerprint import fingerprint_file
from fedsplit.orchestration.flower_runtime import CONNECT_TIMEOUT_S, attach
from fedsplit.orchestration.local_federation import LocalFederation, Site, check_trained
from fedsplit.orchestration.site_agent import forget_reads, read_site_data
from fedsplit.orchestration.site_files import HEADER_SUFFIXES, own_sites, table_columns
from fedsplit.orchestration.survival_summary import tcga_partitions
from fedsplit.protocol.column_sets import check_table_columns
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import HospitalFailure
from fedsplit.protocol.record.common import HISTORY_FILE
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.server.compose import check_composition
from fedsplit.server.history import find_resume_point


@dataclass(frozen=True)
class UpPlan:
    """Where and how `run_up` runs ``cfg`` (its ``out_dir``, ``min_nodes`` and ``seed`` set)."""

    cfg: RunConfig
    work: Path
    sites: int = 3
    dataset: str = "breast-cancer"
    partition: str = "iid"
    tls: bool = False
    port: int = 0
    admin_port: int | None = 0  # None: no admin API
    timeout: float = 3600.0
    superlink: str | None = None  # attach to it instead of starting processes
    root_cert: Path | None = None
    # each hospital's own file (``--site NAME=FILE``) instead of a bundled dataset's partitions
    site_files: tuple[str | Path | SiteSource, ...] = ()
    connect_timeout: float = CONNECT_TIMEOUT_S  # with superlink: how long to wait for its port
    # the SuperLink's state and message objects in this SQLite file, not in memory
    superlink_database: Path | None = None


#: What `fingerprint_file` reads itself; any other file (or a folder) is hashed byte for byte.
FINGERPRINTED = (".csv", ".parquet", ".pq", ".npz")


def _sha256(path: Path) -> str:
    """sha256 of a file's bytes, or of a folder's files (relative names and bytes, in order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(f"{file.relative_to(path).as_posix()}\0".encode())
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def site_fingerprint(files: Mapping[str, Path], rows: Mapping[str, int]) -> str:
    """The run config's ``data-fingerprint`` of the hospitals' own files: `fingerprint_file`'s
    for tables and NPZ, else the rows the reader read and a sha256 of the bytes (an .h5 file or
    a folder a recipe reads)."""
    found = {}
    for name, path in files.items():
        if path.is_file() and path.suffix.lower() in FINGERPRINTED:
            found[name] = fingerprint_file(path)
        else:
            found[name] = {"rows": rows.get(name), "columns": None, "sha256": _sha256(path)}
    return json.dumps(found, sort_keys=True)


def left_out_failure(history: RunRecord, out: Path) -> HospitalFailure | None:
    """A `HospitalFailure` (exit 13) when a hospital's own data or code failed in every round
    it was asked to train, so the federation trained without it (as ``fedsplit simulate``
    reports it: `orchestration.experiment`); None when every hospital took part at least once.
    The model exists (``out/global.h5``): `fedsplit up` prints ``done`` first, then this line."""
    names = sorted({s.site for r in history.rounds if r.train for s in r.train.sites if s.site})
    lines = _left_out(history, names)
    if not lines:
        return None
    more = f" (and {len(lines) - 1} more hospital(s))" if len(lines) > 1 else ""
    return HospitalFailure.from_line(f"{lines[0]}{more}. The federated model was written to {out} "
                                     f"without it; fix that hospital and run again. "
                                     f"Received: {out / HISTORY_FILE}")


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_up(plan: UpPlan, *, on_progress: Callable[[RunRecord], None] | None = None,
           on_stage: Callable[[str], None] = lambda _msg: None,
           say: Callable[[str], None] = lambda _msg: None) -> RunRecord:
    """Run the federation ``plan`` describes to its end; return its run record.

    ``on_stage`` gets one line when the federation starts, ``say`` each process's start and
    stop, ``on_progress`` the run record each time the coordinator rewrites it.
    """
    cfg = plan.cfg
    out = Path(cfg.out_dir)
    check_composition(cfg)  # a bad strategy, parameter or secure-aggregation pairing fails here
    if plan.superlink is not None:  # the hospitals hold their own data: no fingerprint from here
        on_stage(f"federation on {plan.superlink}: {recipe_line(cfg, load=False)}, {cfg.strategy}, "
                 f"{cfg.num_server_rounds} rounds")
        history = attach(cfg, plan.superlink, plan.work, root_cert=plan.root_cert,
                         on_progress=on_progress, timeout=plan.timeout,
                         connect_timeout=min(plan.connect_timeout, plan.timeout), say=say)
        check_trained(history, out)
        return history
    sources = own_sites(plan.site_files)  # before anything is read or started
    if cfg.recipe:  # the local hospitals import it: a missing module or bad params fail here
        from fedsplit.client.recipes import load_recipe

        load_recipe(cfg.recipe, cfg.recipe_params)
    headers = {s.name: table_columns(s.train) for s in sources} if not cfg.recipe else {}
    if headers and None not in headers.values():  # tables: the odd hospital(s) named, not the
        check_table_columns(headers, cfg.table_settings)  # first that reads differently
    if sources:  # each hospital's own file, read as its agent will (one line naming it if not)
        rows = {}
        try:
            for source in sources:
                rows[source.name], _ = read_site_data(source.train.resolve(), source.name,
                                                      recipe=cfg.recipe,
                                                      recipe_params=cfg.recipe_params, cfg=cfg)
        finally:
            forget_reads()
        files = {s.name: s.train.resolve() for s in sources}
        fingerprint = site_fingerprint(files, rows)
        sites = [Site(name, path, recipe=cfg.recipe, recipe_params=cfg.recipe_params)
                 for name, path in files.items()]
    else:
        files = (tcga_partitions(plan.work / "sites") if plan.dataset == TCGA  # its 6 regions
                 else prepare_partitions(plan.work / "sites", plan.dataset, plan.sites,
                                         plan.partition, cfg.seed))
        fingerprint = site_fingerprint(files, {})
        # the simulated hospitals run the run's recipe as their own (`--recipe` of their agents):
        # one operator runs them all here, as in simulate (a real hospital's policy decides)
        sites = [Site(n, path.parent, recipe=cfg.recipe, recipe_params=cfg.recipe_params)
                 for n, path in files.items()]
    cfg = cfg.model_copy(update={"data_fingerprint": fingerprint})
    tables = all(Path(p).suffix.lower() in HEADER_SUFFIXES for p in files.values())
    model = recipe_line(cfg, "mlp" if tables else None)  # the start line names the model
    if cfg.resume:  # refuse an unfinished run on other data before starting any process
        find_resume_point(Path(cfg.out_dir), cfg.to_flower())
    federation = LocalFederation(plan.work, sites, tls=plan.tls, port=plan.port,
                                 admin_port=plan.admin_port, say=say,
                                 database=plan.superlink_database)
    previous = signal.signal(signal.SIGTERM, _terminate)  # `kill` stops everything, like Ctrl-C
    try:
        with federation:
            federation.start()
            on_stage(f"federation: {len(sites)} hospitals, {model}, {cfg.strategy}, "
                     f"{cfg.num_server_rounds} rounds, quorum {cfg.quorum or len(sites)}; "
                     f"logs in {federation.logs}")
            history = federation.run(cfg, timeout=plan.timeout, on_progress=on_progress)
        check_trained(history, out)
        return history
    finally:
        signal.signal(signal.SIGTERM, previous)
