"""The hospital's own policy, applied at the hospital: what its agent runs and what leaves it.

`policy_mod` is the Flower ClientApp mod every fedsplit ClientApp runs its handlers under
(`client.policy.enforce`); `client.policy.egress` keeps the egress log of every reply sent;
`client.policy.paths` finds the policy file and the state folder from the node config.
"""

from fedsplit.client.policy.contents import Contents, Item, reply_contents
from fedsplit.client.policy.egress import append
from fedsplit.client.policy.enforce import (
    check_reply,
    check_request,
    message_run_kind,
    policy_mod,
    read_request,
)
from fedsplit.client.policy.paths import hospital_policy, state_dir

__all__ = ["Contents", "Item", "append", "check_reply", "check_request", "hospital_policy",
           "message_run_kind", "policy_mod", "read_request", "reply_contents", "state_dir"]
