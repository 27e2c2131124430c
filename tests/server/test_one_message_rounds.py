"""One message per hospital per round (issue 32): `server.rounds.RoundLoop` over scripted hospitals.

Each scripted hospital answers what Flower's runtime would hand its ClientApp: a train
instruction with ``evaluate-first`` is scored (the score says which model arrived) and trained,
an evaluate instruction is scored; under secure aggregation the hospital's own secure agent
(`client.secure.agent`) answers the stages and masks its change. The tests count the messages
each hospital gets and check that every round's recorded evaluation describes that round's own
global model, the kept round included, as the separate evaluate phase did, and that a secure
run records the same evaluations as a plain one (issue 42).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.client.secure.agent import handle_query, secure_train_reply, take_secure_record
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import privacy as pv
from fedsplit.protocol import read_weights
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.server.bookkeeping import MergeStep
from fedsplit.server.history import RunHistory
from fedsplit.server.merge import PlainMerge
from fedsplit.server.rounds import RoundLoop
from fedsplit.server.secure.merge import SecureMerge
from flwr.app import Array, ArrayRecord, Error, Message, RecordDict

from fedsplit import aggregation

MODEL_ID = "mlp/classification/2/2/-"
ROWS = {1: 10, 2: 30, 3: 60}  # validation rows: the recorded mean is count-weighted



def score_of(w: float, node: int) -> float:
    """What hospital ``node`` scores for a model whose weights are all ``w``."""
    return round(1.0 / (1.0 + abs(w - 4.0)) - node / 1000, 6)  # best near w = 4


class Hospitals:
    """A Flower Grid whose nodes are scripted hospital agents (train: w + 1 + node / 10); the
    secure-aggregation stages and the masked reply are the hospital agent's own code."""

    def __init__(self, nodes: tuple[int, ...] = (1, 2, 3), fail: dict[int, int] | None = None
                 ) -> None:
        self.nodes = nodes
        self.fail = fail or {}  # node -> round whose train instruction it fails
        self.received: dict[int, list[tuple[str, int, bool]]] = {n: [] for n in nodes}
        self.state = {n: RecordDict() for n in nodes}  # each hospital's Flower context state
        self.exchanges = 0

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def _answer(self, msg: Message) -> Message:
        node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
        if kind == pv.SECAGG_QUERY:
            self.received[node].append((kind, 0, False))
            return Message(handle_query(msg.content, node, self._context(node)), reply_to=msg)
        secure = take_secure_record(msg.content) if kind == wire.TRAIN else None
        config = msg.content.config_records["config"]
        r, first = int(config["server-round"]), bool(config.get(wire.EVALUATE_FIRST, False))
        self.received[node].append((kind, r, first))
        w = float(next(iter(msg.content.array_records["arrays"].values())).numpy().flat[0])
        scored = {wire.NUM_EXAMPLES: ROWS[node], "accuracy": score_of(w, node), "loss": w}
        if kind == wire.EVALUATE:
            return Message(wire.build_evaluate_reply(scored, {wire.SITE_NAME: f"h{node}"}),
                           reply_to=msg)
        if self.fail.get(node) == r:
            return Message(Error(code=0, reason=f"hospital h{node}, training: ValueError: bad "
                                                f"rows"), reply_to=msg)
        trained = {"w": np.full((2, 2), w + 1 + node / 10, np.float32)}
        if secure is not None:  # the hospital agent's own masked reply (client.secure.agent)
            start = {k: a.numpy() for k, a in msg.content.array_records["arrays"].items()}
            reply = secure_train_reply(secure, self._context(node), start, trained, 10,
                                       {wire.TRAIN_LOSS: 0.5}, {"name": f"h{node}"},
                                       evaluation=scored if first else None)
            return Message(reply, reply_to=msg)
        reply = wire.build_train_reply(trained, {wire.NUM_EXAMPLES: 10, wire.TRAIN_LOSS: 0.5},
                                       {"name": f"h{node}"},
                                       evaluation=scored if first else None)
        return Message(reply, reply_to=msg)

    def _context(self, node: int) -> Hospital:
        return Hospital(self.state[node])

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        """Flower's Grid interface, as the exchange helper's test-double path calls it."""
        self.exchanges += 1
        return [self._answer(m) for m in messages]


class Hospital:
    """A hospital's Flower context, reduced to what the secure stages use."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state


def run(tmp_path: Path, grid: Hospitals, rounds: int = 4, merge: MergeStep | None = None,
        history: RunHistory | None = None, **loop) -> RunHistory:
    if history is None:
        history = RunHistory(tmp_path, {})
        history.set_model(MODEL_ID)
    merge = merge or PlainMerge(aggregation.get_strategy("fedavg"))
    RoundLoop(history, merge, **loop).run(
        grid, initial_arrays=ArrayRecord({"w": Array(np.zeros((2, 2), np.float32))}),
        num_rounds=rounds, timeout=10, train_config=wire.train_config(MODEL_ID, 0.0),
        evaluate_config=wire.evaluate_config(MODEL_ID))
    return history


def model_w(out: Path, r: int) -> float:
    return float(read_weights(out / "models" / f"round-{r:03d}.h5").arrays["w"].flat[0])


def test_one_message_per_hospital_per_round_and_each_evaluation_under_its_own_round(
        tmp_path: Path) -> None:
    """4 rounds, 3 hospitals: 5 exchanges (4 rounds + the closing evaluation), one message per
    hospital in each; round r's recorded evaluation is global model r's, count-weighted."""
    grid = Hospitals()
    history = run(tmp_path, grid)
    assert grid.exchanges == 5
    for node, got in grid.received.items():
        assert got == [("train", 1, False), ("train", 2, True), ("train", 3, True),
                       ("train", 4, True), ("evaluate", 4, False)], node
    saved = json.loads((tmp_path / "history.json").read_text())
    assert [r["round"] for r in saved["rounds"]] == [1, 2, 3, 4]
    for entry in saved["rounds"]:
        w = model_w(tmp_path, entry["round"])
        sites = {s["site"]: s for s in entry["evaluate"]["sites"]}
        assert set(sites) == {"h1", "h2", "h3"}
        for node in ROWS:
            assert sites[f"h{node}"]["metrics"]["accuracy"] == pytest.approx(score_of(w, node))
            assert sites[f"h{node}"]["num_examples"] == ROWS[node]
        mean = sum(ROWS[n] * score_of(w, n) for n in ROWS) / sum(ROWS.values())
        assert entry["evaluate"]["metrics"]["accuracy"] == pytest.approx(mean)
        assert entry["seconds"] is not None and entry["train_seconds"] is not None
    # the kept round is the one whose own model scores best (w nearest 4: round 3, w = 3.6)
    best = max(range(1, 5), key=lambda r: score_of(model_w(tmp_path, r), 2))
    assert history.record.selection.rounds_kept == best == 3
    np.testing.assert_array_equal(read_weights(tmp_path / "global.h5").arrays["w"],
                                  read_weights(tmp_path / "models" / "round-003.h5").arrays["w"])


def test_hospitals_not_sampled_for_training_still_score_every_model(tmp_path: Path) -> None:
    """fraction-train 1/3: one hospital trains per round, the other two get an evaluate message
    for the previous model in the same exchange; every model is scored by all three."""
    grid = Hospitals()
    run(tmp_path, grid, rounds=3, fraction_train=0.34)
    assert grid.exchanges == 4
    for got in grid.received.values():
        # round 1 scores nothing (only the sampled hospital trains); from round 2 on every
        # hospital gets exactly one message per exchange: train, or evaluate of model r-1
        later = [(kind, r, first) for kind, r, first in got if kind == "evaluate" or r > 1]
        assert len(later) == 3, got
        assert all((kind == "train" and first) or (kind == "evaluate" and r == n)
                   for n, (kind, r, first) in enumerate(later[:2], start=1)), got
    saved = json.loads((tmp_path / "history.json").read_text())
    for entry in saved["rounds"]:
        assert {s["site"] for s in entry["evaluate"]["sites"]} == {"h1", "h2", "h3"}
        assert not any(s.get("excluded") for s in entry["evaluate"]["sites"])


def test_a_failed_train_reply_leaves_the_previous_models_evaluation_with_its_reason(
        tmp_path: Path) -> None:
    """Hospital h2 fails round 3's message: round 3 trains without it, and model 2's evaluation
    lists h2 as excluded with the same one-line reason (the others' scores are kept)."""
    grid = Hospitals(fail={2: 3})
    run(tmp_path, grid, rounds=3)
    saved = json.loads((tmp_path / "history.json").read_text())
    second = {s["site"]: s for s in saved["rounds"][1]["evaluate"]["sites"]}
    assert second["h2"]["excluded"] and "ValueError: bad rows" in second["h2"]["reason"]
    assert not second["h1"].get("excluded") and not second["h3"].get("excluded")
    third = {s["site"]: s for s in saved["rounds"][2]["train"]["sites"]}
    assert third["h2"]["excluded"]
    assert {s["site"] for s in saved["rounds"][2]["evaluate"]["sites"]} == {"h1", "h2", "h3"}


def test_a_resumed_run_scores_the_model_it_resumes_from_first(tmp_path: Path) -> None:
    """After 2 recorded rounds a restarted coordinator (its history continuing the saved one)
    sends round 3 first, asking for the evaluation of model 2, recorded under round 2."""
    run(tmp_path, Hospitals(), rounds=2)
    previous = RunHistory(tmp_path, {}, previous=json.loads((tmp_path / "history.json")
                                                            .read_text()))
    grid = Hospitals()
    run(tmp_path, grid, rounds=1, history=previous)
    assert grid.received[1] == [("train", 3, True), ("evaluate", 3, False)]
    saved = json.loads((tmp_path / "history.json").read_text())
    assert [r["round"] for r in saved["rounds"]] == [1, 2, 3]
    assert [r["round"] for r in saved["rounds"] if r.get("evaluate")] == [1, 2, 3]
    assert saved["resumed"][0]["after_round"] == 2


def test_a_train_reply_without_its_evaluation_is_excluded_from_the_evaluation(
        tmp_path: Path) -> None:
    """An agent that ignores evaluate-first still trains; the evaluation names it with the fix."""
    class Old(Hospitals):
        def _answer(self, msg: Message) -> Message:
            reply = super()._answer(msg)
            if reply.has_content() and wire.EVALUATION in reply.content.metric_records:
                content = RecordDict({k: v for k, v in reply.content.items()
                                      if k != wire.EVALUATION})
                return Message(content, reply_to=msg)
            return reply

    run(tmp_path, Old(nodes=(1, 2)), rounds=2)
    saved = json.loads((tmp_path / "history.json").read_text())
    first = saved["rounds"][0]
    assert all(s["excluded"] and "update the hospital's agent" in s["reason"]
               for s in first["evaluate"]["sites"])
    assert not any(s.get("excluded") for s in first["train"]["sites"])  # training unaffected


def test_a_secure_run_records_each_rounds_evaluation_as_a_plain_run_does(tmp_path: Path) -> None:
    """The same three hospitals, plain and under secure aggregation: the evaluation rides on the
    masked train reply (no separate evaluate phase), and history.json's evaluate entries agree:
    the same rounds, hospitals and validation rows, scores within the secure quantisation."""
    plain, secure = Hospitals(), Hospitals()
    run(tmp_path / "plain", plain)
    run(tmp_path / "secure", secure,
        merge=SecureMerge(aggregation.get_strategy("fedavg"), secure=SecureSpec(bound=4.0)))
    for node, got in secure.received.items():  # train each round, one closing evaluation
        assert [k for k, _, _ in got if k != pv.SECAGG_QUERY] == [k for k, _, _ in
                                                                plain.received[node]], node
        assert [(k, r, first) for k, r, first in got if k == "train"] == [
            ("train", 1, False), ("train", 2, True), ("train", 3, True), ("train", 4, True)]
        assert [k for k, _, _ in got].count("evaluate") == 1
    saved = {mode: json.loads((tmp_path / mode / "history.json").read_text())
             for mode in ("plain", "secure")}
    assert [r["round"] for r in saved["secure"]["rounds"]] == [1, 2, 3, 4]
    for p, s in zip(saved["plain"]["rounds"], saved["secure"]["rounds"], strict=True):
        assert s["aggregation"]["details"]["secure_aggregation"]["hospitals"] == 3
        assert all(site.get("secure") for site in s["train"]["sites"])
        mine = {x["site"]: x for x in s["evaluate"]["sites"]}
        theirs = {x["site"]: x for x in p["evaluate"]["sites"]}
        assert set(mine) == set(theirs) == {"h1", "h2", "h3"}
        for site, entry in mine.items():
            assert not entry.get("excluded")
            assert entry["num_examples"] == theirs[site]["num_examples"]
            assert set(entry["metrics"]) == set(theirs[site]["metrics"])
            for key, value in entry["metrics"].items():
                assert value == pytest.approx(theirs[site]["metrics"][key], abs=1e-4), (site, key)
        assert set(s["evaluate"]["metrics"]) == set(p["evaluate"]["metrics"])
        for key, value in s["evaluate"]["metrics"].items():
            assert value == pytest.approx(p["evaluate"]["metrics"][key], abs=1e-4), key
        assert s["seconds"] is not None and s["train_seconds"] is not None
    assert (saved["secure"]["selection"]["rounds_kept"]
            == saved["plain"]["selection"]["rounds_kept"] == 3)


def test_the_wire_refuses_an_evaluation_with_a_metric_it_does_not_list() -> None:
    with pytest.raises(Exception, match="evaluation"):
        wire.build_train_reply({"w": np.zeros(2, np.float32)}, {wire.NUM_EXAMPLES: 3}, {},
                               evaluation={wire.NUM_EXAMPLES: 3, "row-ids": 1.0})
    config = wire.evaluating_first(wire.train_config(MODEL_ID, 0.0))
    assert config[wire.EVALUATE_FIRST] is True
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(2, np.float32))}),
                          "config": config})
    msg = Message(content, dst_node_id=1, message_type="train")
    assert wire.parse_model_instruction(msg, wire.TRAIN).evaluate_first
