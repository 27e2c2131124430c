"""The web view scores a run by the round it keeps (``global.h5``), never by its last round, and
gives a failed run no score (TestClient over the real app; run folders in the coordinator's
layout)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from tests.admin.conftest import ADMIN_TOKEN
from tests.ui.conftest import sign_in
from tests.ui.rundata import write_hostile_run

#: each round's test accuracy (summary.json): round 2 is kept, round 3 is the last with a model
TEST_ACCURACY = {1: 0.611, 2: 0.933, 3: 0.722}


def _write_run(folder: Path, *, status: str, kept: int | None) -> None:
    """A three-round run whose rounds score `TEST_ACCURACY`, keeping round ``kept``."""
    fed = write_hostile_run(folder, rounds=3)
    history = json.loads((fed / "history.json").read_text())
    history["status"] = status
    if status == "failed":
        history["error"] = "the coordinator stopped: every hospital failed in round 4"
    if kept is not None:
        history["selection"] = {"keep": "best-val", "metric": "accuracy", "rounds_kept": kept,
                                "val_score": 0.9, "val_metric": []}
    (fed / "history.json").write_text(json.dumps(history))
    summary = json.loads((folder / "summary.json").read_text())
    summary["rounds"] = [{"round": n, "metrics": {"accuracy": a}} for n, a in TEST_ACCURACY.items()]
    (folder / "summary.json").write_text(json.dumps(summary))


def _row(overview: str, folder: str) -> str:
    """The overview's table row of the run written into ``runs/FOLDER``."""
    name = f"runs/{folder}/federation"
    found = re.search(rf"<tr>\s*<th scope=\"row\"><a href=\"/ui/runs/[0-9a-f]{{12}}\">{re.escape(name)}"
                      rf"</a></th>(.*?)</tr>", overview, re.S)
    assert found, f"no row for {name}"
    return found.group(1)


def _run_page(client: TestClient, overview: str, folder: str) -> str:
    name = f"runs/{folder}/federation"
    run_id = re.search(rf'href="/ui/runs/([0-9a-f]{{12}})">{re.escape(name)}</a>', overview).group(1)
    return client.get(f"/ui/runs/{run_id}").text


def test_the_run_list_shows_the_kept_rounds_score(make_client: Callable[..., TestClient],
                                                  runs_dir: Path) -> None:
    """Finished, keeping round 2 of 3: the list shows round 2's 0.933 and names the round, not
    the last round's 0.722; the run page names the kept round, its rule and score, and tags its
    row in the rounds table."""
    _write_run(runs_dir / "kept", status="finished", kept=2)
    client = sign_in(make_client(), ADMIN_TOKEN)
    overview = client.get("/ui").text
    assert "Score (kept round)" in overview
    row = _row(overview, "kept")
    assert "accuracy 0.933" in row and "(round 2)" in row
    assert "0.722" not in row and "0.611" not in row
    page = _run_page(client, overview, "kept")
    kept = re.search(r'<dd id="kept-round">(.*?)</dd>', page, re.S).group(1)
    assert kept == "Round 2 (best-val, by validation accuracy): accuracy 0.933", kept
    tagged = re.findall(r'Round (\d+)</a> <span class="tag tag-kept">kept</span>', page)
    assert tagged == ["2"]


def test_a_running_run_shows_the_round_kept_so_far(make_client: Callable[..., TestClient],
                                                   runs_dir: Path) -> None:
    _write_run(runs_dir / "live", status="running", kept=1)
    client = sign_in(make_client(), ADMIN_TOKEN)
    overview = client.get("/ui").text
    row = _row(overview, "live")
    assert "accuracy 0.611" in row and "(round 1, so far)" in row
    assert "Round 1 so far (best-val" in _run_page(client, overview, "live")


def test_a_failed_run_shows_no_score(make_client: Callable[..., TestClient], runs_dir: Path) -> None:
    """A failed run (here with a round kept before it failed, and rounds that were scored) is
    listed without a score; its page says it keeps none and tags no round."""
    _write_run(runs_dir / "broken", status="failed", kept=2)
    client = sign_in(make_client(), ADMIN_TOKEN)
    overview = client.get("/ui").text
    row = _row(overview, "broken")
    assert "none (failed)" in row
    assert not re.search(r"accuracy \d", row), row
    page = _run_page(client, overview, "broken")
    kept = re.search(r'<dd id="kept-round">(.*?)</dd>', page, re.S).group(1)
    assert kept.startswith("none: the run failed"), kept
    assert "tag-kept" not in page


def test_a_run_without_a_kept_round_shows_no_score(make_client: Callable[..., TestClient],
                                                   runs_dir: Path) -> None:
    """No selection recorded and no summary naming one: no score rather than the last round's."""
    _write_run(runs_dir / "old", status="finished", kept=None)
    client = sign_in(make_client(), ADMIN_TOKEN)
    overview = client.get("/ui").text
    assert not re.search(r"accuracy \d", _row(overview, "old"))
    assert "none yet" in _run_page(client, overview, "old")
