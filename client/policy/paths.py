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

from fedsplit.client.node_config import NodeConfig
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.site_policy import SitePolicy

STATE_FOLDER = "hospital-state"


def hospital_policy(node: NodeConfig) -> SitePolicy:
    """This hospital's policy (read once per process and file)."""
    return _policy(node.policy)


@lru_cache(maxsize=4)
def _policy(path: str) -> SitePolicy:
    return SitePolicy.load(path or None)


def default_root() -> Path:
    """``~/.fedsplit``: where a hospital keeps its state when its agent names no folder."""
    return Path.home() / ".fedsplit"


def state_dir(node: NodeConfig, cfg: RunConfig, site: str) -> Path:
    """The folder holding this hospital's privacy ledger and egress log (created)."""
    if node.state_dir:
        folder = Path(node.state_dir)
    elif node.simulated and (partition := node.partition_folder(cfg.data_dir)) is not None:
        folder = partition / STATE_FOLDER
    else:
        folder = default_root() / site / "state"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder
