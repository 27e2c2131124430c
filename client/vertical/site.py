"""A vertical feature site's side of every exchange, independent of Flower.

`SiteAgent.handle(message_type, payload, state)` answers one coordinator message and updates
``state`` (what must survive until the next message: the PSI shuffle, the aligned rows, the
preprocessing and the branch with its optimiser). The Flower ClientApp (`client.vertical.app`)
keeps ``state`` in ``context.state``; tests call `handle` directly. The site's rows, column
names and IDs never appear in a reply: only PSI points, counts and embeddings do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fedsplit.client.vertical.data import Preprocessor, SiteTable, read_site_table
from fedsplit.client.vertical.model import Branch, build_branch
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.vertical.psi import PsiSession
from fedsplit.protocol.vertical.saved import BranchSpec, SiteModelMeta
from fedsplit.protocol.vertical.wire import Payload, check_payload, pack_points, unpack_points

MEAN_ROW = -1  # position that stands for the site's mean (training) row: the "mean" fill


@dataclass
class SiteState:
    """What a site keeps between messages."""

    config: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


_TABLES: dict[tuple[str, float], SiteTable] = {}
_ENCODED: dict[tuple[str, str, bytes], np.ndarray] = {}


def load_table(path: str, id_column: str) -> SiteTable:
    """Read (and cache per process) the site's file."""
    key = (str(Path(path).resolve()), Path(path).stat().st_mtime if Path(path).exists() else 0.0)
    if key not in _TABLES:
        if len(_TABLES) >= 8:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = read_site_table(path, id_column)
    return _TABLES[key]


class SiteAgent:
    """Answers the coordinator for one site whose file is ``path``."""

    def __init__(self, path: str, id_column: str, name: str, out_dir: str = "") -> None:
        self.path = path
        self.id_column = id_column
        self.name = name
        self.out_dir = out_dir
        self.table = load_table(path, id_column)

    def handle(self, message_type: str, payload: Payload, state: SiteState) -> Payload:
        """Answer one message (checked against `protocol.vertical.wire.ALLOWED` both ways)."""
        check_payload(message_type, payload, reply=False)
        handler = {
            "query.psi_start": self._psi_start,
            "query.psi_finish": self._psi_finish,
            "query.prepare": self._prepare,
            "train.step": self._step,
            "query.embed": self._embed,
            "query.save": self._save,
        }[message_type]
        reply = handler(payload, state)
        check_payload(message_type, reply, reply=True)
        return reply

    # --- private ID alignment -------------------------------------------------------------
    def _psi_start(self, payload: Payload, state: SiteState) -> Payload:
        session = PsiSession(self.table.ids)
        mine = session.outgoing()
        answer = session.answer(unpack_points(payload.arrays["points"]))
        state.arrays["psi-order"] = np.asarray(session.order, dtype=np.int64)
        return Payload(config={"rows": len(self.table), "site": self.name},
                       arrays={"points": pack_points(mine), "answer": pack_points(answer)})

    def _psi_finish(self, payload: Payload, state: SiteState) -> Payload:
        if "psi-order" not in state.arrays:
            raise ConfigError("query.psi_finish arrived before query.psi_start; restart the "
                              "alignment. Received: no PSI session")
        order = state.arrays.pop("psi-order")
        session = PsiSession.resume(self.table.ids, order)
        theirs = unpack_points(payload.arrays["theirs"])
        alignment, _ = session.finish(unpack_points(payload.arrays["mine"]), theirs, theirs)
        state.arrays["aligned-rows"] = np.asarray(alignment.rows, dtype=np.int64)
        return Payload(config={"shared": alignment.size})

    # --- preprocessing and the branch -----------------------------------------------------
    def _rows(self, state: SiteState) -> np.ndarray:
        if "aligned-rows" not in state.arrays:
            raise ConfigError("The site has not been aligned yet (query.psi_* must come first). "
                              "Received: no alignment")
        return state.arrays["aligned-rows"]

    def _prepare(self, payload: Payload, state: SiteState) -> Payload:
        rows = self._rows(state)
        train_pos = np.asarray(payload.arrays["train-positions"], dtype=np.int64)
        if len(train_pos) == 0 or train_pos.min() < 0 or train_pos.max() >= len(rows):
            raise ConfigError(f"Training positions must index the {len(rows)} aligned rows. "
                              f"Received: {len(train_pos)} positions")
        frame = self.table.frame.iloc[rows[train_pos]]
        prep = Preprocessor.fit(frame)
        x_train = prep.transform(frame)
        c = payload.config
        branch_cfg = {"in-dim": int(x_train.shape[1]), "embedding-dim": int(c["embedding-dim"]),
                      "branch-hidden": int(c["branch-hidden"]), "lr": float(c["lr"]),
                      "seed": int(c["seed"])}
        branch = self._new_branch(branch_cfg)
        state.config["prep"] = json.dumps(prep.to_dict())
        state.config["branch"] = json.dumps(branch_cfg)
        state.arrays["mean-row"] = x_train.mean(axis=0).astype(np.float32)
        self._store(branch, state)
        return Payload(config={"input-width": int(x_train.shape[1])})

    @staticmethod
    def _new_branch(cfg: dict[str, Any], *, initial: bool = True) -> Branch:
        """The branch ``cfg`` describes: seeded initial weights, or (``initial=False``) a shell
        whose parameters and Adam moments `_branch` loads from the message state."""
        module = build_branch(cfg["in-dim"], cfg["embedding-dim"], cfg["branch-hidden"],
                              cfg["seed"] if initial else None)
        return Branch(module, cfg["lr"])

    def _branch(self, state: SiteState) -> Branch:
        if "branch" not in state.config:
            raise ConfigError("The site has no branch yet (query.prepare must come first). "
                              "Received: no branch")
        branch = self._new_branch(json.loads(state.config["branch"]), initial=False)
        branch.load_state({k[len("branch."):]: v for k, v in state.arrays.items()
                           if k.startswith("branch.")})
        return branch

    @staticmethod
    def _store(branch: Branch, state: SiteState) -> None:
        for key in [k for k in state.arrays if k.startswith("branch.")]:
            del state.arrays[key]
        state.arrays.update({f"branch.{k}": v for k, v in branch.state().items()})

    def features(self, positions: np.ndarray, state: SiteState) -> np.ndarray:
        """Encoded rows at aligned ``positions`` (`MEAN_ROW` gives the training mean row)."""
        rows = self._rows(state)
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and (positions.min() < MEAN_ROW or positions.max() >= len(rows)):
            raise ConfigError(f"Positions must be -1 (mean row) or index the {len(rows)} aligned "
                              f"rows. Received: min {positions.min()}, max {positions.max()}")
        encoded = self._encoded(rows, state)
        x = np.empty((len(positions), encoded.shape[1]), dtype=np.float32)
        real = positions >= 0
        x[real] = encoded[positions[real]]
        x[~real] = state.arrays["mean-row"]
        return x

    def _encoded(self, rows: np.ndarray, state: SiteState) -> np.ndarray:
        """All aligned rows encoded (cached per process: a step touches only a batch)."""
        key = (self.table.source, state.config["prep"], rows.tobytes())
        if key not in _ENCODED:
            if len(_ENCODED) >= 8:
                _ENCODED.pop(next(iter(_ENCODED)))
            prep = Preprocessor.from_dict(json.loads(state.config["prep"]))
            _ENCODED[key] = prep.transform(self.table.frame.iloc[rows])
        return _ENCODED[key]

    def _step(self, payload: Payload, state: SiteState) -> Payload:
        branch = self._branch(state)
        if "gradients" in payload.arrays:
            x = self.features(payload.arrays["grad-positions"], state)
            branch.backward(x, payload.arrays["gradients"])
            self._store(branch, state)
        arrays = {}
        if "positions" in payload.arrays:
            arrays["embeddings"] = branch.embed(self.features(payload.arrays["positions"], state))
        return Payload(arrays=arrays)

    def _embed(self, payload: Payload, state: SiteState) -> Payload:
        branch = self._branch(state)
        return Payload(arrays={"embeddings": branch.embed(self.features(payload.arrays["positions"], state))})

    def _save(self, payload: Payload, state: SiteState) -> Payload:
        """Write the branch and preprocessing where only this site reads them (for predict).

        Config ``slot``: empty (the kept round's branch, in the output folder itself) or
        ``last`` (the last round's, in its ``last/`` subfolder).
        """
        if not self.out_dir:
            raise ConfigError("This site has no output folder to save its branch in; set the "
                              "run's site-out-dir or the node config 'out-dir'. Received: ''")
        slot = str(payload.config.get("slot", ""))
        if slot not in ("", "last"):
            raise ConfigError(f"query.save's slot is '' (the kept round) or 'last'. Received: {slot!r}")
        folder = Path(self.out_dir) / slot if slot else Path(self.out_dir)
        branch = self._branch(state)
        branch.save(folder / "branch.npz")
        SiteModelMeta(site=self.name, branch=BranchSpec.model_validate_json(state.config["branch"]),
                      prep=json.loads(state.config["prep"]), id_column=self.id_column,
                      tag=str(payload.config.get("tag", ""))).save(folder / "site.json")
        return Payload(config={"saved": str(folder)})
