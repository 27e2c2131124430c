"""Between rounds the coordinator holds one global model (issue 43): the starting model goes
once the loop has replaced it (the set-up hands it over), and each round's model goes once the
next one is made (`Round.let_go`), instead of the last two staying alive all run."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.server.bookkeeping import Round
from fedsplit.server.merge import PlainMerge
from fedsplit.server.setup import ModelSetup
from flwr.app import Array, ArrayRecord, Message, RecordDict

from fedsplit import aggregation
from tests.server.test_one_message_rounds import Hospitals, run


class Watching(Hospitals):
    """The scripted hospitals, noting at each exchange how many of the models sent in earlier
    exchanges are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[weakref.ref] = []
        self.alive_at_send: list[int] = []

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        gc.collect()
        self.alive_at_send.append(sum(1 for ref in self.sent if ref() is not None))
        record = messages[0].content.array_records[wire.ARRAYS]
        if not any(ref() is record for ref in self.sent):
            self.sent.append(weakref.ref(record))
        return super().send_and_receive(messages, timeout=timeout)


def test_each_exchange_finds_no_earlier_model_alive(tmp_path: Path) -> None:
    grid = Watching()
    run(tmp_path, grid, rounds=4)
    # 4 rounds and the closing evaluation, each sending the model the round before made: when
    # each goes out, none sent before it is alive (the loop's starting model included)
    assert grid.alive_at_send == [0, 0, 0, 0, 0]
    assert len(grid.sent) == 5


def test_a_closed_round_lets_go_of_the_model_it_sent() -> None:
    record = ArrayRecord({"w": Array(np.ones((3, 3), np.float32))})
    content = RecordDict({wire.ARRAYS: record})
    rnd = Round(1, model={"w": np.ones((3, 3), np.float32)})
    rnd.shared = dict(rnd.model)
    rnd.train = [Message(content, dst_node_id=n, message_type=wire.TRAIN) for n in (1, 2)]
    rnd.evaluate = [Message(RecordDict({wire.ARRAYS: record}), dst_node_id=3,
                            message_type=wire.EVALUATE)]
    ref = weakref.ref(record)
    del record, content
    rnd.let_go()
    gc.collect()
    assert rnd.model is None and rnd.shared is None
    assert ref() is None
    assert all(wire.ARRAYS not in m.content.array_records for m in (*rnd.train, *rnd.evaluate))
    rnd.let_go()  # twice is harmless


def test_the_setup_hands_its_model_over() -> None:
    record = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    setup = ModelSetup(record, "mlp")
    assert setup.hand_over() is record
    assert len(setup.arrays) == 0


class Images(Hospitals):
    """The scripted hospitals, noting whether each exchange's model is held in Flower's record
    as the aggregate's own ``.npy`` image (`protocol.update.npy_empty`) rather than a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.own_image: list[bool] = []

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        record = messages[0].content.array_records[wire.ARRAYS]
        self.own_image.append(all(isinstance(a.data, bytearray) for a in record.values()))
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize("rule", ["fedavg", "median"])
def test_each_new_global_model_is_the_aggregate_itself_not_a_copy(tmp_path: Path, rule) -> None:
    grid = Images()
    history = run(tmp_path, grid, rounds=3, merge=PlainMerge(aggregation.get_strategy(rule)))
    # the starting model is the set-up's (Flower's bytes); every later model is the aggregate
    # written once, into the memory Flower's record then carries
    assert grid.own_image == [False, True, True, True]
    assert history.record.completed_rounds == 3
