"""Where a hospital's policy and its own records are, as its agent configured them.

Both come from the node config, which the hospital's agent sets (``fedsplit site run --policy
FILE --state-dir DIR``) and the coordinator cannot change:

- the policy (`protocol.site_policy.SitePolicy`): node config ``policy``, else the defaults;
- the state folder, where the privacy ledger and the egress log live: node config ``state-dir``;
  in Flower's simulation engine (``fedsplit simulate``: sites numbered by ``partition-id``) the
  staged site folder's ``hospital-state/``; else ``~/.fedsplit/<site>/state``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.site_policy import NODE_POLICY, NODE_STATE_DIR, SitePolicy

STATE_FOLDER = "hospital-state"


def hospital_policy(node_config: dict[str, Any]) -> SitePolicy:
    """This hospital's policy (read once per process and file)."""
    return _policy(str(node_config.get(NODE_POLICY, "") or ""))


@lru_cache(maxsize=4)
def _policy(path: str) -> SitePolicy:
    return SitePolicy.load(path or None)


def default_root() -> Path:
    """``~/.fedsplit``: where a hospital keeps its state when its agent names no folder."""
    return Path.home() / ".fedsplit"


def state_dir(node_config: dict[str, Any], cfg: RunConfig, site: str) -> Path:
    """The folder holding this hospital's privacy ledger and egress log (created)."""
    if configured := str(node_config.get(NODE_STATE_DIR, "") or ""):
        folder = Path(configured)
    elif "partition-id" in node_config and "data-path" not in node_config and cfg.data_dir:
        folder = Path(cfg.data_dir) / f"site-{int(node_config['partition-id'])}" / STATE_FOLDER
    else:
        folder = default_root() / site / "state"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder
