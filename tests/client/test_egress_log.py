"""The egress log: appended whole under a lock by any number of processes, and every change to
it after the fact (an edited, deleted or moved line, a cut tail, a forged record) named."""

from __future__ import annotations

import itertools
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from fedsplit.client.policy import append
from fedsplit.protocol import egress_log
from fedsplit.protocol.errors import ConfigError


def fields(n: int, **extra: object) -> dict:
    """A train reply's record fields (as the ClientApp mod writes them)."""
    return {"run": 1, "coordinator": "", "site": "st-mary", "run_kind": "horizontal",
            "message": "train", "group": str(n), "round": n, "outcome": "sent", "reason": None,
            "tensors": [{"record": "arrays", "name": "w", "kinds": ["weights"], "shape": [2],
                         "dtype": "float32", "bytes": 8}],
            "counts": {"num-examples": 96}, "metrics": {"train-loss": 0.5}, "labels": [],
            "categories": {}, "withheld": {}, "epsilon": None, "bytes": 8, **extra}


@pytest.fixture
def log(tmp_path: Path) -> Path:
    """A state folder with five records."""
    for n in range(1, 6):
        append(tmp_path, fields(n))
    return tmp_path


def lines(folder: Path) -> list[str]:
    return (folder / egress_log.LOG_NAME).read_text().splitlines(keepends=True)


def rewrite(folder: Path, new: list[str]) -> None:
    (folder / egress_log.LOG_NAME).write_text("".join(new))


def problem(folder: Path) -> str:
    verdict = egress_log.verify(folder)
    assert not verdict.ok
    return f"{verdict.problem} (line {verdict.line})"


def test_an_intact_log_verifies_and_its_key_is_the_hospitals_alone(log: Path) -> None:
    verdict = egress_log.verify(log)
    assert verdict.ok and verdict.records == 5
    records = egress_log.read_records(log)
    assert [r.id for r in records] == [1, 2, 3, 4, 5]
    assert records[0].prev_hash == egress_log.GENESIS
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(records))
    assert records[-1].hash == verdict.head
    for name in (egress_log.KEY_NAME, egress_log.HEAD_NAME, egress_log.LOG_NAME):
        assert stat.S_IMODE((log / name).stat().st_mode) & 0o077 == 0, name
    os.chmod(log / egress_log.KEY_NAME, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        egress_log.verify(log)


def test_an_edited_line_is_named(log: Path) -> None:
    text = lines(log)
    text[2] = text[2].replace('"num-examples":96', '"num-examples":9')
    rewrite(log, text)
    assert problem(log) == "line 3 was changed: its hash does not match its content (line 3)"


def test_a_line_rewritten_with_its_hash_recomputed_needs_the_key(log: Path) -> None:
    text = lines(log)
    record = json.loads(text[3])
    record["labels"] = ["forged"]
    record["hash"] = egress_log.record_hash(record)
    text[3] = egress_log.record_line(record) + "\n"
    rewrite(log, text)
    # the next line no longer follows it; fixing that too needs the MACs
    assert problem(log).startswith("line 4 carries a MAC this key did not make")


def test_a_deleted_line_is_named(log: Path) -> None:
    text = lines(log)
    del text[2]
    rewrite(log, text)
    assert problem(log).startswith("record 3 missing before line 3 (ids jump from 2 to 4)")


def test_a_reordered_pair_is_named(log: Path) -> None:
    text = lines(log)
    text[1], text[2] = text[2], text[1]
    rewrite(log, text)
    assert problem(log).startswith("line 2 holds record 3; record 2 is at line 3: reordered")


def test_a_truncated_tail_is_named(log: Path) -> None:
    rewrite(log, lines(log)[:3])
    assert "line(s) 4-5 were removed from the end (truncated)" in problem(log)
    rewrite(log, [])
    assert "the head names record 5 but the log ends at record 0" in problem(log)
    (log / egress_log.HEAD_NAME).unlink()
    (log / egress_log.LOG_NAME).unlink()
    assert egress_log.verify(log).ok  # the key alone: nothing was ever sent


def test_a_half_written_line_is_named_and_cut_by_the_next_writer(log: Path) -> None:
    with open(log / egress_log.LOG_NAME, "a") as fh:
        fh.write('{"id":6,"at":"2026')  # a writer that died mid-line (its head never written)
    assert problem(log).startswith("line 6 is incomplete (no newline)")
    record = append(log, fields(6))
    assert record["id"] == 6 and egress_log.verify(log).ok


def test_a_forged_head_and_a_missing_head_are_named(log: Path) -> None:
    head = json.loads((log / egress_log.HEAD_NAME).read_text())
    (log / egress_log.HEAD_NAME).write_text(json.dumps({**head, "id": 3}))
    assert "was not written with this key" in problem(log)
    (log / egress_log.HEAD_NAME).unlink()
    assert "head file egress.head is missing" in problem(log)


def test_concurrent_appends_from_several_processes_keep_one_chain(tmp_path: Path) -> None:
    """Four ClientApp-like processes of one hospital, 25 records each, at the same time."""
    script = (
        "import sys\nfrom fedsplit.client.policy.egress import append\n"
        "for n in range(25):\n"
        "    append(sys.argv[1], {'run': int(sys.argv[2]), 'site': 'st-mary', 'message': 'train',"
        " 'round': n, 'outcome': 'sent', 'tensors': [], 'counts': {}, 'metrics': {},"
        " 'labels': [], 'categories': {}, 'withheld': {}, 'bytes': 0})\n")
    workers = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(run)])
               for run in range(4)]
    assert [w.wait(timeout=120) for w in workers] == [0, 0, 0, 0]
    verdict = egress_log.verify(tmp_path)
    assert verdict.ok, verdict.problem
    records = egress_log.read_records(tmp_path)
    assert [r.id for r in records] == list(range(1, 101))
    for run in range(4):
        assert [r.round for r in records if r.run == run] == list(range(25))
