"""On Flower's deployment runtime the round moves the model it sent out of memory once the
instructions are pushed (`Round.park`, issue 43): large tensors to unlinked, mapped files,
small ones copied; the run is the same as with the model held."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import read_weights
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.protocol.update import array_view, to_array_record
from fedsplit.server import bookkeeping, exchange, rounds
from fedsplit.server.bookkeeping import Round
from flwr.app import Array, ArrayRecord, Message, RecordDict

from tests.server.test_exchange import Clock
from tests.server.test_fold_on_arrival import Staggered
from tests.server.test_one_message_rounds import run


class SuperLink(Staggered):
    """`Staggered`, keeping its own copy of each instruction's content at the push, as
    Flower's SuperLink does (the coordinator may drop its arrays afterwards)."""

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for mid in ids:
            msg, at = self.pushed[mid]
            kept = Message(RecordDict(dict(msg.content.items())),
                           dst_node_id=msg.metadata.dst_node_id,
                           message_type=msg.metadata.message_type)
            kept.metadata.__dict__["_message_id"] = mid
            self.pushed[mid] = (kept, at)
        return ids


def _round(arrays: dict[str, np.ndarray], shared: list[str]) -> Round:
    record = to_array_record(arrays)
    rnd = Round(1, record=record)
    rnd.model = {k: array_view(a) for k, a in record.items()}
    rnd.shared = {k: rnd.model[k] for k in shared}
    content = RecordDict({wire.ARRAYS: record})
    rnd.train = [Message(content, dst_node_id=n, message_type=wire.TRAIN) for n in (1, 2)]
    return rnd


def test_park_maps_large_tensors_copies_small_ones_and_leaves_no_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {"big": rng.standard_normal((600, 600)).astype(np.float32),  # 1.4 MB
              "small": np.arange(6, dtype=np.float64).reshape(2, 3),
              "empty": np.zeros((0, 3), np.float32),
              "count": np.array(5.0)}
    rnd = _round(arrays, shared=["big", "small"])
    rnd.park(tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing left if the run dies
    assert isinstance(rnd.model["big"], np.memmap) and not rnd.model["big"].flags.writeable
    assert not isinstance(rnd.model["small"], np.memmap)
    for name, want in arrays.items():
        np.testing.assert_array_equal(rnd.model[name], want)
        assert rnd.model[name].dtype == want.dtype
    assert rnd.shared is not None and set(rnd.shared) == {"big", "small"}
    assert rnd.shared["big"] is rnd.model["big"]
    assert rnd.record is None
    assert all(wire.ARRAYS not in m.content.array_records for m in rnd.train)
    again = rnd.sent()  # a short round sends the parked model again
    assert again is not None and list(again) == list(arrays)
    for name, want in arrays.items():
        np.testing.assert_array_equal(again[name].numpy(), want)
    rnd.let_go()
    assert rnd.model is None and rnd.sent() is None


def test_park_without_a_model_does_nothing() -> None:
    rnd = Round(1)
    rnd.park()
    assert rnd.model is None and rnd.sent() is None


@pytest.mark.parametrize("optimizer", [None, "adam"])
def test_a_parked_run_is_the_run_with_the_model_held(
        optimizer: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rounds with every tensor parked (the round loop parks on the deployment grid
    only: told it is one here), round 2 short (every hospital fails, so round 3 sends the
    parked model again), with and without a server optimizer reading the parked model: the
    same models each round as the run holding it."""
    monkeypatch.setattr(bookkeeping, "PARK_MIN_BYTES", 1)
    models = {}
    for parks in (False, True):
        monkeypatch.setattr(rounds, "lean_pull_supported", lambda grid, parks=parks: parks)
        monkeypatch.setattr(exchange, "time", Clock())
        grid = SuperLink(exchange.time, {1: 0.2, 2: 0.7, 3: 1.1})
        grid.fail = {1: 2, 2: 2, 3: 2}
        out = tmp_path / str(parks)
        opt = ServerOptimizer(optimizer, lr=0.1) if optimizer else None
        run(out, grid, rounds=3, server_optimizer=opt)
        record = RunRecord.load(out / "history.json")
        assert [r.error is not None for r in record.rounds] == [False, True, False]
        models[parks] = [read_weights(out / "models" / f"round-{r:03d}.h5").arrays["w"]
                         for r in (1, 3)]
    for held, parked in zip(models[False], models[True], strict=True):
        np.testing.assert_array_equal(held, parked)


class Watching(SuperLink):
    """`SuperLink`, noting at each pull whether the record the coordinator sent is still alive
    in the coordinator (the grid's own copy holds its arrays, not the record)."""

    def __init__(self, clock: Clock, ready: dict[int, float]) -> None:
        super().__init__(clock, ready)
        self.sent: weakref.ref | None = None
        self.alive_at_pull: list[bool] = []

    def push_messages(self, messages):
        # a training round's exchange (the closing evaluation's replies are small: the loop
        # keeps the model it returns)
        self.sent = (weakref.ref(messages[0].content.array_records[wire.ARRAYS])
                     if messages[0].metadata.message_type == wire.TRAIN else None)
        ids = super().push_messages(messages)
        for mid in ids:  # the copy holds the arrays, not the coordinator's record
            kept = self.pushed[mid][0]
            record = kept.content.array_records[wire.ARRAYS]
            kept.content[wire.ARRAYS] = ArrayRecord(
                {k: Array(np.array(array_view(a))) for k, a in record.items()})
        return ids

    def pull_messages(self, ids):
        gc.collect()
        self.alive_at_pull.append(self.sent is not None and self.sent() is not None)
        return super().pull_messages(ids)


def test_while_replies_are_pulled_the_coordinator_holds_no_model_it_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bookkeeping, "PARK_MIN_BYTES", 1)
    monkeypatch.setattr(rounds, "lean_pull_supported", lambda grid: True)
    monkeypatch.setattr(exchange, "time", Clock())
    grid = Watching(exchange.time, {1: 0.2, 2: 0.7, 3: 1.1})
    run(tmp_path, grid, rounds=3)
    assert len(grid.alive_at_pull) >= 3 and not any(grid.alive_at_pull)


def test_a_model_that_cannot_be_parked_stays_in_memory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No room to park (here: the folder is a file): the round keeps the model as it was and
    says so; nothing is lost."""
    arrays = {"big": np.ones((600, 600), np.float32)}
    rnd = _round(arrays, shared=["big"])
    record = rnd.record
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    rnd.park(blocker)
    assert rnd.record is record and not isinstance(rnd.model["big"], np.memmap)
    assert all(wire.ARRAYS in m.content.array_records for m in rnd.train)
    assert "stays in memory" in caplog.text
    np.testing.assert_array_equal(rnd.sent()["big"].numpy(), arrays["big"])


def _hospital_dp(tmp_path: Path, seed: int = 3) -> dict:
    """`run`'s keywords for hospital-level DP: the rule (noise seeded) and the privacy hook
    that hands it each round's model, over a history in ``tmp_path``."""
    from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, HospitalDPParams
    from fedsplit.protocol.privacy import DPSpec
    from fedsplit.server.history import RunHistory
    from fedsplit.server.merge import PlainMerge
    from fedsplit.server.privacy import PrivacyHook

    from tests.server.test_one_message_rounds import MODEL_ID

    history = RunHistory(tmp_path, {})
    history.set_model(MODEL_ID)
    rule = HospitalDPFedAvg(HospitalDPParams(clip=0.5, sigma=0.8), seed=seed)
    hook = PrivacyHook(rule, history, dp=DPSpec(level="hospital", epsilon=5.0, delta=1e-3))
    return {"merge": PlainMerge(rule), "history": history, "hooks": [hook]}


def test_under_hospital_dp_the_rule_reads_the_parked_model_and_holds_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hospital-level DP clips each change against the model sent: the rule reads it where
    the round holds it when merging (parked once pushed), so while replies are pulled the sent
    record is not alive, and the models are the run's with the model held (same noise seed)."""
    from fedsplit.aggregation import hospital_dp

    monkeypatch.setattr(bookkeeping, "PARK_MIN_BYTES", 1)
    # the scripted hospitals' one tensor "w" counts as trained (clipped, noised), not a buffer
    monkeypatch.setattr(hospital_dp, "TRAINED", ("w",))
    models = {}
    for parks in (False, True):
        monkeypatch.setattr(rounds, "lean_pull_supported", lambda grid, parks=parks: parks)
        monkeypatch.setattr(exchange, "time", Clock())
        grid = Watching(exchange.time, {1: 0.2, 2: 0.7, 3: 1.1})
        out = tmp_path / str(parks)
        dp = _hospital_dp(out)
        rule = dp["merge"].aggregator
        on_disk: list[bool] = []  # at each pull: the rule's reference reads the parked files
        pull = grid.pull_messages

        def watched(ids, pull=pull, rule=rule, on_disk=on_disk, grid=grid):
            if rule.reference is not None and grid.sent is not None:
                on_disk.append(all(isinstance(v, np.memmap) for v in rule.reference.values()))
            return pull(ids)

        grid.pull_messages = watched
        run(out, grid, rounds=3, **dp)
        assert rule.reference is None  # let go with the round
        if parks:
            assert len(grid.alive_at_pull) >= 3 and not any(grid.alive_at_pull)
            assert len(on_disk) >= 3 and all(on_disk)
        models[parks] = [read_weights(out / "models" / f"round-{r:03d}.h5").arrays["w"]
                         for r in (1, 2, 3)]
    for held, parked in zip(models[False], models[True], strict=True):
        np.testing.assert_array_equal(held, parked)
    assert not np.array_equal(models[True][0], models[True][1])  # the rounds moved the model
