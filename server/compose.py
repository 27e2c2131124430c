"""The strategy factory: the rule a run's coordinator aggregates with and the wrappers around it.

A run's strategy is a stack, built here from the run config, like Flower's
``DifferentialPrivacy*FixedClipping`` wrappers around a strategy::

    PrivateStrategy(SecureStrategy(RegistryStrategy(rule)))   # each layer only when asked for

- `server.strategy.RegistryStrategy`: Flower's FedAvg round loop (sampling, quorum, deadlines,
  history, server optimizer) merging with the registry ``rule`` (``strategy``,
  ``strategy-params``).
- hospital-level ``dp``: the rule becomes `aggregation.hospital_dp.HospitalDPFedAvg` (clip each
  change, count-weight, add noise). Only a rule that declares itself ``linear`` (the
  count-weighted mean, whose sensitivity to one hospital is its count share) can be replaced by
  it: today fedavg.
- ``secure-aggregation``: `server.secure.strategy.SecureStrategy` wraps the loop; the
  coordinator sees only masked sums. It asks the rule (`check_secure_rule`): a ``linear`` rule
  is one secure sum per round, an ``iterative_on_sums`` rule (geometric-median) one more per
  step of its own iteration; a rule with neither compares single updates and is refused.
- ``dp`` at either level: `server.privacy.PrivateStrategy` wraps outermost and records each
  hospital's spent epsilon every round.

Which settings can go together regardless of the rule (dp with BatchNorm, FedProx or parallel
training; hospital-level dp with secure aggregation; simulated attacks with either) is the run
config's own check (`protocol.config.RunConfig`, `protocol.privacy.check_run`).
"""

from __future__ import annotations

from typing import Any

from fedsplit.aggregation.base import AggregationStrategy
from fedsplit.aggregation.hospital_dp import HospitalDPFedAvg, HospitalDPParams, plan_sigma
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import DPSpec, SecureSpec
from fedsplit.server.history import RunHistory
from fedsplit.server.privacy import PrivateStrategy
from fedsplit.server.secure.strategy import SecureStrategy, check_secure_rule
from fedsplit.server.strategy import RegistryStrategy
from flwr.serverapp.strategy import Strategy

from fedsplit import aggregation


def linear_rules() -> list[str]:
    """The registered rules that declare themselves linear in the updates, by name."""
    return [n for n in aggregation.strategy_names() if aggregation.get_strategy(n).linear]


def check_composition(cfg: RunConfig, rule: AggregationStrategy | None = None) -> None:
    """Refuse a rule that the run's privacy wrappers cannot wrap (`ConfigError` saying why).

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


def compose_strategy(cfg: RunConfig, aggregator: AggregationStrategy, history: RunHistory,
                     **loop: Any) -> Strategy:
    """The run's strategy stack around a `RegistryStrategy` (``aggregator``, ``history`` and
    ``loop``: its keyword arguments), as the module docstring lays out."""
    strategy: Strategy = RegistryStrategy(aggregator, history, **loop)
    secure = SecureSpec.parse(cfg.secure_aggregation)
    if secure is not None:
        strategy = SecureStrategy(strategy, secure=secure, timeout=cfg.round_timeout)
    dp = DPSpec.parse(cfg.dp)
    if dp is not None:
        strategy = PrivateStrategy(strategy, dp=dp)
    return strategy
