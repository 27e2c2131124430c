"""`fedsplit up --superlink HOST:PORT` says what it waits for, and stops in bounded time
(issue 31, finding 10: it waited over 3 minutes without a word). Loopback only."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration import flower_runtime
from fedsplit.orchestration.flower_runtime import free_port, probe, run_app, wait_for_superlink
from fedsplit.protocol.errors import ConfigError, FlowerRunError


def test_probe_names_the_cause() -> None:
    assert probe(f"127.0.0.1:{free_port()}") == "connection refused"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert probe(f"127.0.0.1:{listener.getsockname()[1]}") is None
    for bad in ("127.0.0.1", "host:port", ":9092", "h:70000"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            probe(bad)


def test_an_unreachable_superlink_fails_within_the_deadline_naming_address_cause_fix() -> None:
    address = f"127.0.0.1:{free_port()}"
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(FlowerRunError) as info:
        wait_for_superlink(address, 2.0, say=said.append, every=0.2)
    elapsed = time.monotonic() - started
    assert 2.0 <= elapsed < 5.0, elapsed
    assert said == [f"waiting for the SuperLink at {address} (connection refused); retrying for 2 s"]
    message = str(info.value)
    assert "\n" not in message and address in message and "connection refused" in message
    assert "Start it first" in message and message.endswith(f"Received: --superlink {address}")


def test_a_superlink_that_comes_up_while_waiting_is_used() -> None:
    port = free_port()
    listener = socket.socket()
    opened = threading.Timer(1.0, lambda: (listener.bind(("127.0.0.1", port)), listener.listen()))
    opened.start()
    said: list[str] = []
    try:
        waited = wait_for_superlink(f"127.0.0.1:{port}", 10.0, say=said.append, every=0.2)
    finally:
        opened.join()
        listener.close()
    assert 0.8 < waited < 5.0
    assert said[0].startswith("waiting for the SuperLink") and "answers (after" in said[-1]


def test_up_superlink_refuses_in_one_line_before_submitting(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI path: exit 8 (FlowerRunError) once ``--timeout`` (here below the 30 s connect
    deadline) has passed, nothing submitted."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    code = run_guarded(app, ["up", "--superlink", address, "--work", str(tmp_path / "w"),
                             "--rounds", "1", "--timeout", "2"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr()
    assert code == FlowerRunError.exit_code, err
    assert elapsed < 15, elapsed
    assert f"waiting for the SuperLink at {address} (connection refused)" in err.out
    assert f"FlowerRunError: The SuperLink at {address} is not reachable" in err.err
    assert not (tmp_path / "w" / "flwr-run.log").exists()  # nothing was submitted


def test_a_run_no_coordinator_starts_is_reported_while_waiting(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """A submitted run whose ServerApp never starts (no SuperExec, or one that cannot find
    flwr-serverapp) is reported every SILENCE_NOTE_S; when ``flwr run`` gives up, one line with
    its log's end."""
    fake = tmp_path / "flwr"
    fake.write_text(f"#!{sys.executable}\nimport time\nprint('Using SuperLink: fedsplit', "
                    "flush=True)\ntime.sleep(1.5)\nprint('\\u256d\\u2500 Error \\u2500\\u256e')\n"
                    "print('\\u2502 the run was never started \\u2502')\n")
    fake.chmod(0o755)
    monkeypatch.setattr(flower_runtime, "tool", lambda name: str(fake))
    monkeypatch.setattr(flower_runtime, "SILENCE_NOTE_S", 0.4)
    silences: list[float] = []
    with pytest.raises(FlowerRunError) as info:
        run_app(tmp_path / "app", {}, tmp_path / "run.log", tmp_path / "out" / "history.json",
                timeout=30, on_silence=silences.append)
    assert len(silences) >= 2 and silences == sorted(silences)
    message = str(info.value)
    assert "\n" not in message
    assert "Error | the run was never started" in message
    assert message.endswith("Received: status none (no history written)")
