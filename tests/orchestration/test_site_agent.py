"""The site agent's supervision of a real child process: refusals are recognised, not retried forever."""

from __future__ import annotations

import sys

import pytest
from fedsplit.orchestration import site_agent
from fedsplit.protocol.errors import SiteAgentError

# A stand-in SuperNode: Flower's refusal line, then a long traceback (as Flower 1.42 prints), exit 1.
REFUSED = (
    "import sys; print('[code: 2004] Failed to activate SuperNode.', flush=True); "
    "[print(f'  File \"x.py\", line {i}, in <module>') for i in range(80)]; sys.exit(1)"
)


def test_refusal_followed_by_a_long_traceback_ends_the_agent(monkeypatch) -> None:
    """The refusal is found anywhere in the run's output; after the grace the agent gives up."""
    monkeypatch.setattr(site_agent, "ACTIVATION_GRACE_S", 0.5)
    monkeypatch.setattr(site_agent, "ACTIVATION_RETRY_S", 0.2)
    said: list[str] = []
    with pytest.raises(SiteAgentError, match="refused this hospital") as info:
        site_agent.supervise([sys.executable, "-c", REFUSED], {}, max_restarts=1, name="intruder",
                             say=said.append)
    assert "Failed to activate" in str(info.value)
    assert any("activation refused" in s for s in said)  # retried as a refusal, not a crash
    assert not any("SuperNode exited with code" in s for s in said)
