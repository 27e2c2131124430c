"""New rows through a trained vertical run's branches and head (``fedsplit vertical predict``).

The site files are aligned with the same PSI (site 0 with every other site), so rows match
by patient without comparing IDs in the clear; only rows every site holds are scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from fedsplit.client.vertical.data import Preprocessor, read_site_table
from fedsplit.client.vertical.model import Branch, build_branch
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.tasks import task_kind
from fedsplit.protocol.vertical.psi import PsiSession
from fedsplit.protocol.vertical.saved import SiteModelMeta
from fedsplit.server.vertical.coordinator import read_label_file
from fedsplit.server.vertical.head import FusionHead

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class Prediction:
    """`predict_rows`' result: one row per patient every site holds (ID, ``prediction`` and,
    for classification, ``p_<class>``), how many of site 0's rows were ``skipped`` (not held by
    every site), and with labels the ``metrics`` (``accuracy`` or ``rmse``, and ``scored``: the
    rows with a label)."""

    frame: pd.DataFrame
    skipped: int
    metrics: dict[str, float] | None = None


def align_sites(ids: Sequence[Sequence[str]]) -> np.ndarray:
    """(rows, K) local row numbers of the patients all K sites hold, by PSI of site 0 with each."""
    common: dict[int, list[int]] = {r: [r] for r in range(len(ids[0]))}
    for k in range(1, len(ids)):
        a, b = PsiSession(ids[0]), PsiSession(ids[k])
        a1, b1 = a.outgoing(), b.outgoing()
        a2, b2 = b.answer(a1), a.answer(b1)
        al, _ = a.finish(a2, b1, b2)
        bl, _ = b.finish(b2, a1, a2)
        pairs = dict(zip(al.rows, bl.rows, strict=True))
        common = {r: [*v, pairs[r]] for r, v in common.items() if r in pairs}
    return np.array([common[r] for r in sorted(common)], dtype=np.int64).reshape(-1, len(ids))


def predict_rows(model_dir: Path, site_files: Sequence[Path], id_column: str,
                 labels: Path | None = None, target: str = "target") -> Prediction:
    """Predictions for rows all sites hold (and metrics when ``labels`` are given)."""
    import pandas as pd
    import torch

    head_dir = model_dir / "federation" / "head"
    if not (head_dir / "head.json").is_file():
        raise ConfigError(f"{model_dir} is not a `fedsplit vertical simulate` output (no "
                          f"federation/head/head.json). Received: {model_dir}")
    head, meta = FusionHead.load(head_dir)
    if len(site_files) != len(meta.sites):
        raise ConfigError(f"The model was trained with {len(meta.sites)} sites "
                          f"({', '.join(meta.sites)}); "
                          f"give one --site file each, in that order. Received: {len(site_files)}")
    tables = [read_site_table(p, id_column) for p in site_files]
    rows = align_sites([t.ids for t in tables])
    embeddings = []
    for k, table in enumerate(tables):
        folder = model_dir / "sites" / meta.sites[k]
        info = SiteModelMeta.load(folder / "site.json")
        prep = Preprocessor.from_dict(info.prep)
        b = info.branch
        module = build_branch(b.in_dim, b.embedding_dim, b.branch_hidden, b.seed)
        Branch.load_params(module, folder / "branch.npz")
        embeddings.append(Branch(module, b.lr).embed(prep.transform(table.frame.iloc[rows[:, k]])))
    out = head.outputs(embeddings)
    ids = [tables[0].ids[r] for r in rows[:, 0]]
    frame = pd.DataFrame({id_column: ids})
    if task_kind(meta.task).classes:
        frame["prediction"] = [meta.classes[i] for i in out.argmax(1)]
        probs = torch.softmax(torch.from_numpy(out), dim=1).numpy()
        for i, c in enumerate(meta.classes):
            frame[f"p_{c}"] = probs[:, i]
    else:
        frame["prediction"] = out[:, 0] * meta.y_std + meta.y_mean
    result = Prediction(frame=frame, skipped=len(tables[0]) - len(rows))
    if labels is not None:
        table = read_label_file(str(labels), id_column, target, meta.task)
        truth = {i: (table.classes[int(v)] if task_kind(table.task).classes else float(v))
                 for i, v in zip(table.ids, table.y, strict=True)}
        known = [i for i, x in enumerate(ids) if x in truth]
        pred = frame["prediction"].to_numpy()[known]
        y = [truth[ids[i]] for i in known]
        if task_kind(meta.task).classes:
            hits = [str(a) == str(b) for a, b in zip(pred, y, strict=True)]
            result.metrics = {"accuracy": float(np.mean(hits)), "scored": len(known)}
        else:
            err = pred.astype(float) - np.asarray(y, dtype=float)
            result.metrics = {"rmse": float(np.sqrt((err ** 2).mean())), "scored": len(known)}
    return result
