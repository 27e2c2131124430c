"""Partial overlap: every fill trains; nearest borrows a linked patient; drop keeps complete rows."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.orchestration.vertical.local import local_coordinator
from fedsplit.protocol.vertical.config import FusionParams
from fedsplit.server.vertical.coordinator import MEAN_ROW


@pytest.mark.parametrize("fill", ["nearest", "mean", "zero", "drop"])
def test_each_fill_trains_and_scores_all_held_out_rows(bc_partial, fill: str) -> None:
    files, labels = bc_partial
    params = FusionParams(fill=fill, steps_per_round=15, embedding_dim=8)
    coord, transport = local_coordinator(labels, files.sites, files.id_column, params, keep=True)
    report = coord.align()
    assert [o.share_of_labels for o in report] == pytest.approx([0.8, 0.8], abs=0.05)
    coord.prepare()
    complete = (coord.present >= 0).all(axis=1)
    if fill == "drop":
        assert complete[coord.train_rows].all()
    else:
        assert not complete[coord.train_rows].all()
    for _ in range(3):
        coord.train_round()
    result = coord.evaluate()
    assert result.num_examples == len(coord.test_rows) > (result.complete_rows or 0) > 0
    assert result.metrics["accuracy"] > 0.85
    asked = [rec for t, d, _, rec in transport.log if t == "train.step" and d == "to-site"]
    positions = np.concatenate([r.array_records["arrays"]["positions"].numpy() for r in asked
                                if "positions" in r.array_records["arrays"]])
    if fill == "zero":
        assert (positions >= 0).all()  # missing views are zeros at the coordinator, not asked for
    if fill == "mean":
        assert (positions == MEAN_ROW).any()


def test_nearest_borrows_the_closest_linked_patient_on_the_present_view(bc_partial) -> None:
    files, labels = bc_partial
    params = FusionParams(fill="nearest", steps_per_round=5, embedding_dim=8)
    coord, _ = local_coordinator(labels, files.sites, files.id_column, params)
    coord.align()
    coord.prepare()
    neighbours = coord.neighbours()
    have = coord.present >= 0
    only_a = coord.train_rows[have[coord.train_rows, 0] & ~have[coord.train_rows, 1]]
    assert len(only_a) > 0
    linked = coord.train_rows[have[coord.train_rows].all(axis=1)]
    emb_a = dict(zip(coord.train_rows, coord._embed_rows(coord.train_rows)[0], strict=True))
    for row in only_a[:20]:
        donor_pos = neighbours[row, 1]
        donor = int(np.flatnonzero(coord.present[:, 1] == donor_pos)[0])
        assert donor in set(linked)  # a patient both sites hold
        dist = {q: float(((emb_a[row] - emb_a[q]) ** 2).sum()) for q in linked}
        assert dist[donor] == pytest.approx(min(dist.values()), rel=1e-6)
