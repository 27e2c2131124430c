"""The round loop's public hooks (`server.bookkeeping`): its round book and a supplied merge
step, which the loop steps with the server optimizer and records (the one history writer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.base import AggregateResult
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol import read_weights
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.history import AggregationReport, SiteEntry
from fedsplit.server.bookkeeping import Merge, RoundBook, RoundReplies
from fedsplit.server.history import RunHistory
from fedsplit.server.strategy import RegistryStrategy
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedsplit import aggregation


@pytest.fixture(autouse=True)
def task_identity():
    """Flower refuses to build Messages outside a running app unless this is set."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


class Grid:
    """The little of Flower's Grid that FedAvg's sampling uses."""

    def get_node_ids(self) -> list[int]:
        return [1, 2]


def _loop(tmp_path: Path, **kw) -> RegistryStrategy:
    history = RunHistory(tmp_path, config={})
    history.set_model("mlp/classification/2/2/-")
    return RegistryStrategy(aggregation.get_strategy("fedavg"), history, min_train_nodes=1,
                            min_available_nodes=1, **kw)


def test_a_supplied_merge_step_is_stepped_and_recorded_by_the_loop(tmp_path: Path) -> None:
    opt = ServerOptimizer("avgm", lr=0.5, momentum=0.0)
    loop = _loop(tmp_path, server_optimizer=opt)
    seen: list[RoundReplies] = []

    def merge(replies: RoundReplies) -> Merge:
        seen.append(replies)
        report = AggregationReport(strategy="mine", params={}, num_examples=7, sites=[])
        return Merge([SiteEntry(site="a", metrics={"loss": 1.0})],
                     result=AggregateResult({"w": np.full(2, 3.0, np.float32)}, 7, report),
                     metrics={"loss": 1.0})

    loop.use_merge(merge)
    start = {"w": np.ones(2, np.float32)}
    loop.configure_train(1, ArrayRecord({"w": Array(start["w"])}), ConfigRecord({}), Grid())
    arrays, metrics = loop.aggregate_train(1, [])
    assert [r.server_round for r in seen] == [1]
    assert [s.name for s in seen[0].expected] == ["w"]  # the layout sent out
    # avgm with lr 0.5 and no momentum: halfway from the model sent to the merge's aggregate
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0, 2.0])
    assert metrics["loss"] == 1.0
    saved = json.loads((tmp_path / "history.json").read_text())
    entry = saved["rounds"][0]
    assert entry["train"]["sites"][0]["site"] == "a"
    assert entry["aggregation"]["strategy"] == "mine"
    assert entry["server_opt"]["name"] == "avgm"
    assert read_weights(tmp_path / "global.h5").arrays["w"].tolist() == [2.0, 2.0]
    with pytest.raises(ConfigError, match="already replaced"):
        loop.use_merge(merge)


def test_a_short_merge_keeps_the_model_and_the_loop_records_why(tmp_path: Path) -> None:
    loop = _loop(tmp_path)
    loop.use_merge(lambda replies: Merge([SiteEntry(site="a", excluded=True, reason="x")],
                                         error="too few; global model unchanged"))
    assert loop.aggregate_train(1, []) == (None, None)
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert entry["error"] == "too few; global model unchanged"
    assert [s["site"] for s in entry["train"]["sites"]] == ["a"]
    assert not (tmp_path / "global.h5").exists()


def test_a_skipped_phase_is_recorded_without_merging(tmp_path: Path) -> None:
    loop = _loop(tmp_path)
    loop.use_merge(lambda replies: pytest.fail("a skipped round is not merged"))
    loop.book.skip("train", 1, "secure aggregation could not start")
    assert loop.aggregate_train(1, []) == (None, None)
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert entry["error"] == "secure aggregation could not start"


def test_the_book_names_replies_and_the_hospitals_that_did_not_answer() -> None:
    book = RoundBook(site_names={1: "north", 2: "south", 3: "east"}, deadline=30)
    sent = [Message(RecordDict({}), dst_node_id=n, message_type="train") for n in (1, 2, 3)]
    for i, m in enumerate(sent):  # Flower sets the ids when it pushes them
        m.metadata.__dict__["_message_id"] = f"id{i}"
    book.expect("train", 4, sent)
    assert book.sent[("train", 4)] == sent
    named = Message(RecordDict({"site": ConfigRecord({"name": "north-2"})}), reply_to=sent[0])
    failed = Message(Error(code=1, reason="boom"), reply_to=sent[1])
    senders, missing = book.missing("train", 4, [named, failed])
    assert ("train", 4) not in book.sent
    assert [m.site for m in missing] == ["east"]
    assert missing[0].late and "round-timeout (30 s)" in (missing[0].reason or "")
    assert book.site(named, senders) == "north-2" and book.site_names[1] == "north-2"
    assert book.site(failed, senders) == "south"
    book.skip("evaluate", 4, "no quorum")
    assert book.take_skip("evaluate", 4) == "no quorum"
    assert book.take_skip("evaluate", 4) is None
