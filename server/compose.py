"""The loop factory: the rule a run's coordinator aggregates with, and the round loop around it.

A run's rounds are one `server.rounds.RoundLoop`, built here from the run config::

    RoundLoop(merge=PlainMerge(rule) | SecureMerge(rule), hooks=[PrivacyHook] if dp)

- the merge step: `server.merge.PlainMerge` checks each reply and merges with the registry
  ``rule`` (``strategy``, ``strategy-params``); with ``secure-aggregation`` it is
  `server.secure.merge.SecureMerge` (the coordinator sees only masked sums). The secure step
  asks the rule (`check_secure_rule`): a ``linear`` rule is one secure sum per round, an
  ``iterative_on_sums`` rule (geometric-median) one more per step of its own iteration; a rule
  with neither compares single updates and is refused.
- hospital-level ``dp``: the rule becomes `aggregation.hospital_dp.HospitalDPFedAvg` (clip each
  change, count-weight, add noise). Only a rule that declares itself ``linear`` (the
  count-weighted mean, whose sensitivity to one hospital is its count share) can be replaced by
  it: today fedavg.
- ``dp`` at either level: the hook `server.privacy.PrivacyHook` records each hospital's spent
  epsilon every round.

Which settings can go together regardless of the rule (dp with BatchNorm, FedProx or parallel
training; hospital-level dp with secure aggregation; simulated attacks with either) is the run
config's own check (`protocol.config.RunConfig`, `protocol.privacy.check_run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, HospitalDPParams, plan_sigma
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import DPSpec, SecureSpec
from fedsplit.server.bookkeeping import MergeStep, RoundHook
from fedsplit.server.history import RunHistory
from fedsplit.server.merge import PlainMerge
from fedsplit.server.privacy import PrivacyHook
from fedsplit.server.rounds import RoundLoop
from fedsplit.server.secure.merge import SecureMerge, check_secure_rule

from fedsplit import aggregation


def linear_rules() -> list[str]:
    """The registered rules that declare themselves linear in the updates, by name."""
    return [n for n in aggregation.strategy_names() if aggregation.get_strategy(n).linear]


def check_composition(cfg: RunConfig, rule: AggregationStrategy | None = None) -> None:
    """Refuse a rule the run's privacy settings cannot run with (`ConfigError` saying why).

    ``rule``: the registry rule (default: ``cfg.strategy`` with ``cfg.params``; a bad name or
    parameter raises the registry's error).
    """
    rule = rule if rule is not None else aggregation.get_strategy(cfg.strategy, cfg.params)
    if SecureSpec.parse(cfg.secure_aggregation) is not None:
        check_secure_rule(rule)
    dp = DPSpec.parse(cfg.dp)
    if dp is not None and dp.level == "hospital" and not rule.linear:
        raise ConfigError(
            f"Hospital-level DP clips each hospital's change and noises their count-weighted "
            f"mean: it needs a rule linear in the updates ({', '.join(linear_rules())}). Use one, "
            f"or --dp level=patient with {rule.name}. Received: strategy={rule.name}")


def compose_aggregator(cfg: RunConfig, rule: AggregationStrategy | None = None
                       ) -> AggregationStrategy:
    """The rule the run's loop merges with: ``rule`` (default: the configured one), or under
    hospital-level dp its clipped and noised count-weighted mean, planned for the run's rounds."""
    rule = rule if rule is not None else aggregation.get_strategy(cfg.strategy, cfg.params)
    check_composition(cfg, rule)
    dp = DPSpec.parse(cfg.dp)
    if dp is None or dp.level != "hospital":
        return rule
    sigma = plan_sigma(dp.epsilon, dp.delta, dp.rounds or cfg.num_server_rounds)
    return HospitalDPFedAvg(HospitalDPParams(clip=dp.clip, sigma=sigma), seed=cfg.seed)


def compose_loop(cfg: RunConfig, aggregator: AggregationStrategy, history: RunHistory, *,
                 quorum: int = 1, cohort_caps: dict[str, int] | None = None,
                 cap_policy: str = "clip", backend: aggregation.BackendSettings | None = None,
                 **loop: Any) -> RoundLoop:
    """The run's round loop (module docstring): its merge step for ``aggregator`` (plain or
    secure), the privacy hook under dp, and ``loop`` (`RoundLoop`'s keyword arguments)."""
    merge: MergeStep
    secure = SecureSpec.parse(cfg.secure_aggregation)
    if secure is not None:
        merge = SecureMerge(aggregator, secure=secure, quorum=quorum)
    else:
        merge = PlainMerge(aggregator, quorum=quorum, cohort_caps=cohort_caps,
                           cap_policy=cap_policy, backend=backend)
    hooks: Sequence[RoundHook] = ()
    dp = DPSpec.parse(cfg.dp)
    if dp is not None:
        hooks = [PrivacyHook(aggregator, history, dp=dp)]
    return RoundLoop(history, merge, hooks=hooks, quorum=quorum, **loop)
