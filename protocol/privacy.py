"""The privacy contracts: the ``dp`` and ``secure-aggregation`` run-config specs, which settings
can go together (`check_run`), and the secure-aggregation message keys.

Which aggregation rules can run under them is the rules' own declaration
(`aggregation.base.AggregationStrategy.linear` / ``iterative_on_sums``), asked by the
coordinator's strategy factory (`server.compose`); no name list lives here.

``dp`` (run config, `fedsplit simulate --dp`) is a comma-separated ``key=value`` list:

=========  ========================================================================================
key        meaning
=========  ========================================================================================
level      ``patient`` (default): DP-SGD at every hospital (per-sample clipping + Gaussian noise,
           Opacus); ``hospital``: the coordinator clips each hospital's update, weights it by its
           count and adds Gaussian noise (`aggregation.hospital_dp`).
epsilon    the budget (> 0) each hospital (patient level) or the federation (hospital level) may
           spend over the whole run.
delta      the DP delta, in (0, 1); should be below 1 / (number of patients).
clip       the clip norm: per-sample gradient norm (patient level, default 1.0) or the norm of
           each hospital's update, the change it makes to the global model (hospital level,
           default 1.0).
rounds     the rounds the budget is planned for; written by the runners from
           ``num-server-rounds`` and fixed for the run (``dp`` cannot change on resume), so a
           run continued past them stops at the hospital instead of spending more.
=========  ========================================================================================

``secure-aggregation`` is ``""`` (off) or ``bound=B[,levels=L][,neighbours=K][,threshold=T]``:
every coordinate of a hospital's update (its change to the global model) must lie in
``[-B, B]`` (a hospital whose update does not refuses to send it, saying so); ``L``
quantisation levels; each hospital shares its secrets with ``K`` neighbours (SecAgg+), any
``T`` of which can reconstruct them (so up to ``K - T`` of a hospital's neighbours may drop out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedsplit.protocol.errors import ConfigError, FederationError

DP_LEVELS = ("patient", "hospital")


class PrivacyBudgetError(FederationError):
    """A hospital's next round would spend more than its privacy budget: it stops training."""

    reason = "privacy_budget"


def _pairs(spec: str, what: str, example: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{what} is a comma-separated key=value list, e.g. {example!r}. "
                              f"Received: {spec!r}")
        out[key.strip()] = value.strip()
    return out


def _number(pairs: dict[str, str], key: str, what: str, spec: str) -> float | None:
    if key not in pairs:
        return None
    try:
        value = float(pairs[key])
    except ValueError:
        raise ConfigError(f"{what}: {key} must be a number. Received: {spec!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{what}: {key} must be finite. Received: {spec!r}")
    return value


@dataclass(frozen=True)
class DPSpec:
    """A parsed ``dp`` spec (see the module docstring)."""

    level: str
    epsilon: float
    delta: float
    clip: float = 1.0
    rounds: int = 0

    def __post_init__(self) -> None:
        where = f"level={self.level}, epsilon={self.epsilon}, delta={self.delta}, clip={self.clip}"
        if self.level not in DP_LEVELS:
            raise ConfigError(f"--dp level is one of {DP_LEVELS}. Received: {self.level!r}")
        if not self.epsilon > 0:
            raise ConfigError(f"--dp epsilon must be > 0 (the budget). Received: {where}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"--dp delta must lie in (0, 1), e.g. 1e-3. Received: {where}")
        if not self.clip > 0:
            raise ConfigError(f"--dp clip must be > 0 (a norm). Received: {where}")
        if self.rounds < 0:
            raise ConfigError(f"--dp rounds must be >= 1. Received: rounds={self.rounds}")

    @classmethod
    def parse(cls, spec: str, *, rounds: int | None = None) -> DPSpec | None:
        """Parse a ``dp`` spec; ``""`` or ``none`` is None (off). ``rounds`` fills a missing one."""
        if spec.strip().lower() in ("", "none", "off"):
            return None
        what = "--dp"
        pairs = _pairs(spec, what, "epsilon=1,delta=1e-3")
        unknown = sorted(set(pairs) - {"level", "epsilon", "delta", "clip", "rounds"})
        if unknown:
            raise ConfigError(f"--dp takes level, epsilon, delta, clip (and rounds); unknown "
                              f"{unknown}. Received: {spec!r}")
        missing = [k for k in ("epsilon", "delta") if k not in pairs]
        if missing:
            raise ConfigError(f"--dp needs epsilon and delta (e.g. epsilon=1,delta=1e-3); missing "
                              f"{missing}. Received: {spec!r}")
        planned = _number(pairs, "rounds", what, spec)
        if planned is not None and (planned != int(planned) or planned < 1):
            raise ConfigError(f"--dp rounds must be an integer >= 1. Received: {spec!r}")
        clip = _number(pairs, "clip", what, spec)
        epsilon, delta = _number(pairs, "epsilon", what, spec), _number(pairs, "delta", what, spec)
        return cls(level=pairs.get("level", "patient"), epsilon=float(epsilon or 0.0),
                   delta=float(delta or 0.0), clip=1.0 if clip is None else clip,
                   rounds=int(planned) if planned is not None else int(rounds or 0))

    def to_spec(self) -> str:
        """The canonical string (what the run config holds)."""
        return (f"level={self.level},epsilon={self.epsilon!r},delta={self.delta!r},"
                f"clip={self.clip!r},rounds={self.rounds}")


@dataclass(frozen=True)
class SecureSpec:
    """A parsed ``secure-aggregation`` spec (see the module docstring)."""

    bound: float = 1.0
    levels: int = 1 << 20
    neighbours: int = 0  # 0: chosen from the number of hospitals (`share_plan`)
    threshold: float = 0.5  # share of the neighbours (with itself) needed to reconstruct

    def __post_init__(self) -> None:
        if not self.bound > 0:
            raise ConfigError(f"secure-aggregation bound must be > 0. Received: {self.bound}")
        if not 2 <= self.levels <= 1 << 24:
            raise ConfigError(f"secure-aggregation levels must lie in [2, 2^24] (the modulus holds "
                              f"count x levels). Received: {self.levels}")
        if self.neighbours < 0 or self.neighbours == 1:
            raise ConfigError(f"secure-aggregation neighbours is 0 (automatic) or >= 2. "
                              f"Received: {self.neighbours}")
        if not 0 < self.threshold < 1:
            raise ConfigError(f"secure-aggregation threshold is a share in (0, 1). "
                              f"Received: {self.threshold}")

    @classmethod
    def parse(cls, spec: str) -> SecureSpec | None:
        """Parse a ``secure-aggregation`` spec; ``""``/``none``/``off`` is None, ``on`` defaults."""
        text = spec.strip().lower()
        if text in ("", "none", "off", "false"):
            return None
        if text in ("on", "true"):
            return cls()
        what = "secure-aggregation"
        pairs = _pairs(spec, what, "bound=1.0")
        unknown = sorted(set(pairs) - {"bound", "levels", "neighbours", "threshold"})
        if unknown:
            raise ConfigError(f"{what} takes bound, levels, neighbours, threshold; unknown "
                              f"{unknown}. Received: {spec!r}")
        values = {k: _number(pairs, k, what, spec) for k in pairs}
        for key in ("levels", "neighbours"):
            if key in values and values[key] != int(values[key] or 0):
                raise ConfigError(f"{what}: {key} must be an integer. Received: {spec!r}")
        return cls(bound=values.get("bound") or 1.0, levels=int(values.get("levels") or 1 << 20),
                   neighbours=int(values.get("neighbours") or 0),
                   threshold=values.get("threshold") or 0.5)

    def to_spec(self) -> str:
        """The canonical string (what the run config holds)."""
        return (f"bound={self.bound!r},levels={self.levels},neighbours={self.neighbours},"
                f"threshold={self.threshold!r}")

    def share_plan(self, hospitals: int) -> tuple[int, int]:
        """(share number K including the hospital itself, reconstruction threshold T).

        Automatic K: all hospitals up to 8, else ``2 * ceil(log2 N) + 1`` (SecAgg+'s
        logarithmic neighbourhood), at most N. T: ``ceil(threshold * K)``, at least 2 (one
        share alone reveals nothing), at most K.
        """
        if hospitals < 2:
            raise ConfigError(f"Secure aggregation needs at least 2 hospitals per round (with one, "
                              f"the sum is its update). Received: {hospitals}")
        if self.neighbours:
            k = min(hospitals, self.neighbours)
        else:
            k = hospitals if hospitals <= 8 else min(hospitals,
                                                     2 * math.ceil(math.log2(hospitals)) + 1)
        return k, min(k, max(2, math.ceil(self.threshold * k)))


# --- secure aggregation messages (an extension of protocol.horizontal_wire) -----------------
SECAGG = "secagg"  # record name (config) carried by every secure-aggregation message
SECAGG_QUERY = "query.secagg"  # message type of the setup, share-keys and unmask stages
MASKED = "masked"  # arrays record of a masked reply: one int64 vector
STAGE = "stage"
SETUP, SHARE, COLLECT, UNMASK = "setup", "share-keys", "collect", "unmask"
POINT = "point"  # a Weiszfeld step's collect stage: the broadcast point z in, a masked vector out
STAGES = (SETUP, SHARE, COLLECT, POINT, UNMASK)

#: stage -> (instruction keys, reply keys) of the ``secagg`` config record
SECAGG_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    SETUP: (frozenset({STAGE, "share-num", "threshold", "bound", "levels", "modulus", "round"}),
            frozenset({"pk1", "pk2"})),
    SHARE: (frozenset({STAGE, "nodes", "pk1", "pk2"}),
            frozenset({"dsts", "ciphertexts"})),
    COLLECT: (frozenset({STAGE, "srcs", "ciphertexts"}),
              frozenset({STAGE})),
    POINT: (frozenset({STAGE, "srcs", "ciphertexts", "point", "scale", "nu"}),
            frozenset({"masked"})),
    UNMASK: (frozenset({STAGE, "active", "dropped"}),
             frozenset({"nodes", "shares"})),
}


def check_secagg_record(record: dict | object, stage: str, *, reply: bool) -> None:
    """Refuse a ``secagg`` record holding keys its stage does not list (or lacking any)."""
    if stage not in SECAGG_KEYS:
        raise ConfigError(f"Unknown secure-aggregation stage; expected one of {STAGES}. "
                          f"Received: {stage!r}")
    allowed = SECAGG_KEYS[stage][int(reply)]
    keys = set(record.keys())  # type: ignore[attr-defined]
    if keys != allowed:
        error = FederationError
        raise error(f"A secure-aggregation {'reply' if reply else 'instruction'} of stage {stage} "
                    f"holds exactly {sorted(allowed)}. Received: keys {sorted(keys)}")


def check_run(*, dp: str, secure: str, attack: str = "none", norm: str = "none",
              proximal_mu: float = 0.0, parallel: str = "none") -> None:
    """Refuse privacy settings that cannot work together, before any process starts (whether
    the strategy can run under them is the rule's to say: `server.compose`)."""
    spec, sec = DPSpec.parse(dp), SecureSpec.parse(secure)
    if (spec or sec) and attack not in ("", "none"):
        raise ConfigError(f"Simulated hostile hospitals (--attack) send unprotected poisoned "
                          f"updates; run them without --dp / --secure-aggregation. Received: "
                          f"attack={attack}")
    if spec is None:
        return
    if norm != "none":
        raise ConfigError(f"--dp needs norm=none: BatchNorm mixes the rows of a batch (no "
                          f"per-sample gradients) and its statistics would travel unnoised. "
                          f"Received: norm={norm}")
    if spec.level == "patient" and proximal_mu > 0:
        raise ConfigError(f"Patient-level DP clips per-sample gradients; the FedProx term is not a "
                          f"per-sample loss. Use proximal-mu 0. Received: proximal_mu={proximal_mu}")
    if spec.level == "patient" and parallel.split(":", 1)[0].strip() != "none":
        raise ConfigError(f"Patient-level DP trains with Opacus on one device; use parallel none. "
                          f"Received: parallel={parallel!r}")
    if spec.level == "hospital" and sec is not None:
        raise ConfigError("Hospital-level DP calibrates its noise to the largest count share, which "
                          "secure aggregation hides. Use --dp level=patient with "
                          "--secure-aggregation. Received: dp level=hospital with secure aggregation")
