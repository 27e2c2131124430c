"""Class labels at the hospital and at the merge (issue 40): a rare label is never named, its
rows train only where the agreed schema holds it; "refuse" stops the run without naming it; a
hospital's label cap and the federation's label cap refuse in one line."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fedsplit.client.app import app
from fedsplit.client.data import split_indices
from fedsplit.client.node_config import NodeConfig
from fedsplit.client.site import load_site, site_columns
from fedsplit.protocol import RunConfig
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.schema import (
    ColumnReport,
    SiteColumns,
    TableSettings,
    TargetReport,
    merge_reports,
)
from fedsplit.protocol.site_policy import PolicyRefusal
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

NODE_ID = 12
RARE = "HIV+ (J. Doe, MRN 123456)"
CFG = RunConfig(target="diagnosis")


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, NODE_ID, 1
    yield


def _table(n: int = 100, seed: int = 0, labels: list[str] | None = None) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "age": rng.integers(30, 80, n), "ward": rng.choice(["A", "B"], n),
        "diagnosis": labels if labels is not None else rng.choice(["benign", "malignant"], n),
    })


def _hospital(tmp_path: Path, frame: pd.DataFrame, policy: str = "", name: str = "north"
              ) -> dict[str, str]:
    frame.to_csv(tmp_path / f"{name}.csv", index=False)
    node = {"data-path": str(tmp_path / f"{name}.csv"), "site-name": name,
            "state-dir": str(tmp_path / "state")}
    if policy:
        (tmp_path / f"{name}-policy.toml").write_text(policy)
        node["policy"] = str(tmp_path / f"{name}-policy.toml")
    return node


def _one_patient(tmp_path: Path, policy: str = "") -> tuple[dict[str, str], int]:
    """North's table with one training patient labelled `RARE`: (node config, its row)."""
    frame = _table()
    keep, _ = split_indices(len(frame), CFG.val_fraction, CFG.seed)
    frame.loc[int(keep[3]), "diagnosis"] = RARE  # a training row: it would be reported
    return _hospital(tmp_path, frame, policy), int(keep[3])


def _ask(message_type: str, node: dict[str, str]) -> Message:
    context = Context(run_id=1, node_id=NODE_ID, node_config=node, state=RecordDict(),
                      run_config=CFG.to_flower())
    content = RecordDict({"config": ConfigRecord({})})
    return app(Message(content, dst_node_id=NODE_ID, message_type=message_type), context)


def test_a_one_patient_label_never_leaves_and_its_rows_train_only_if_others_name_it(tmp_path
                                                                                   ) -> None:
    node, _ = _one_patient(tmp_path)
    for question in ("query.schema", "query.setup"):
        reply = _ask(question, node)
        assert not reply.has_error(), reply.error
        sent = repr(reply.content) + str(dict(reply.content.config_records[wire.COLUMNS]))
        for part in (RARE, "HIV", "MRN", "123456", "J. Doe"):
            assert part not in sent
    report = site_columns(NodeConfig.from_flower(node), NODE_ID, CFG)
    assert report.target == TargetReport("categorical", {"benign": report.target.labels["benign"],
                                                         "malignant": report.target.labels[
                                                             "malignant"]}, withheld=1)
    # alone (its own schema), its row is dropped from training
    alone = load_site(NodeConfig.from_flower(node), NODE_ID, CFG)
    assert len(alone.train) == report.rows - 1 and alone.train.schema.labels == ("benign",
                                                                                 "malignant")
    # another hospital names the label (12 of its patients): the agreed schema holds it, and
    # north's patient trains with it, although north never named it
    south = _table(50, seed=1)
    south.loc[:11, "diagnosis"] = RARE
    south_node = _hospital(tmp_path, south, name="south")
    merged = merge_reports([report, site_columns(NodeConfig.from_flower(south_node), NODE_ID, CFG)],
                           CFG.table_settings)
    assert RARE in merged.schema.labels
    assert any("rare class labels withheld" in w and "north (1)" in w for w in merged.warnings)
    agreed = load_site(NodeConfig.from_flower(node), NODE_ID, CFG, merged.schema.to_json())
    assert len(agreed.train) == report.rows
    assert merged.schema.labels.index(RARE) in set(agreed.train.y.tolist())


def test_rare_labels_refuse_stops_the_run_without_naming_the_label(tmp_path) -> None:
    node, _ = _one_patient(tmp_path, 'rare_labels = "refuse"\n')
    reply = _ask("query.schema", node)
    assert reply.has_error()
    reason = reply.error.reason
    assert "\n" not in reason and "Hospital north refuses the run: 1 of its class labels" in reason
    assert "HIV" not in reason and "MRN" not in reason and "Received: 1 rare label(s)" in reason
    with pytest.raises(PolicyRefusal, match="refuses the run"):
        load_site(NodeConfig.from_flower(node), NODE_ID, CFG)  # nor does it train


def test_the_hospital_applies_its_own_minimum_count_to_categories_and_numeric_labels(tmp_path
                                                                                    ) -> None:
    """Policy min_category_count 10 over the run's 5: a category of 6 rows is withheld, and a
    numeric class held by 6 rows too."""
    frame = _table(100, labels=[str(v) for v in [0] * 47 + [1] * 47 + [2] * 6])
    frame["ward"] = ["C"] * 6 + ["A"] * 47 + ["B"] * 47
    node = _hospital(tmp_path, frame, "min_category_count = 10\n")
    report = site_columns(NodeConfig.from_flower(node), NODE_ID, CFG)
    keep, _ = split_indices(100, CFG.val_fraction, CFG.seed)
    ward = next(c for c in report.columns if c.name == "ward")
    assert ward.withheld == 1 and set(ward.categories) == {"A", "B"}  # 'C' (6 rows) withheld
    assert report.target.kind == "numeric" and set(report.target.labels) == {"0", "1"}
    assert report.target.withheld == 1
    # the rows of class 2 are dropped, train and held-out
    site = load_site(NodeConfig.from_flower(node), NODE_ID, CFG)
    assert len(site.train) == len(keep) - int((keep >= 94).sum()) and len(site.val) == 100 - len(
        keep) - (6 - int((keep >= 94).sum()))


def test_a_hospital_with_100000_labels_refuses_in_one_line(tmp_path) -> None:
    frame = _table(100_000, labels=[f"patient {i}" for i in range(100_000)])
    node = _hospital(tmp_path, frame)
    reply = _ask("query.schema", node)
    assert reply.has_error()
    reason = reply.error.reason
    assert "\n" not in reason and "Hospital north refuses the run" in reason
    # its 80,000 training rows (the rest are its held-out rows) hold 80,000 labels
    assert "80,000 distinct class labels, more than the 100 its policy allows" in reason


def test_a_schema_with_more_labels_than_the_hospital_allows_is_refused(tmp_path) -> None:
    node = _hospital(tmp_path, _table(), "max_labels = 2\n")
    other = SiteColumns("south", 30, True, (ColumnReport("age", "numeric", 30, 0),
                                            ColumnReport("ward", "categorical", 30, 0,
                                                         categories={"A": 15, "B": 15})),
                        TargetReport("categorical", {"benign": 10, "malignant": 10, "other": 10}))
    schema = merge_reports([site_columns(NodeConfig.from_flower(node), NODE_ID, CFG), other],
                           CFG.table_settings).schema
    with pytest.raises(PolicyRefusal, match=r"north refuses the agreed schema with 3 class "
                                            r"labels.*Received: 3 labels"):
        load_site(NodeConfig.from_flower(node), NODE_ID, CFG, schema.to_json())


def test_the_merge_refuses_100000_labels_in_one_line_naming_the_hospital() -> None:
    columns = (ColumnReport("age", "numeric", 10, 0),)
    flood = SiteColumns("flood", 500_000, True, columns,
                        TargetReport("categorical", {f"label {i:06d}": 5 for i in range(100_000)}))
    others = [SiteColumns(s, 100, True, columns,
                          TargetReport("categorical", {"benign": 50, "malignant": 50}))
              for s in ("north", "south")]
    wire_reports = [flood.to_json(), *(r.to_json() for r in others)]
    start = time.perf_counter()
    reports = [SiteColumns.from_json(text) for text in wire_reports]  # as the coordinator reads
    with pytest.raises(ConfigError) as refused:
        merge_reports(reports, TableSettings(target="diagnosis"))
    assert time.perf_counter() - start < 3.0  # linear: no pairwise work on the labels
    line = str(refused.value)
    assert "\n" not in line and "hospital flood brought the most (100,000)" in line
    assert "100,002 distinct class labels" in line and line.endswith("100,002 in all")
    merge_reports(others, TableSettings(target="diagnosis"))  # two labels: merged as before
