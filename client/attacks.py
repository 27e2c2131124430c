"""Hostile hospitals for simulations: turn an honest update or dataset into a hostile one.

Pure functions, no I/O. ``--attack`` strings (``fedsplit simulate``/``compare-strategies``):

===============  ==============================================================================
``signflip``     send the reversed, amplified step: ``g - K (w - g)``, K=4 unless ``signflip:K``
``scale:K``      boost the honest step K times (model replacement): ``g + K (w - g)``
``gaussian:S``   add N(0, S^2) noise to every honest weight: ``w + S * eps``
``nan``          every value NaN (a diverged or corrupted site; the coordinator's guard excludes it)
``labelflip``    train on flipped labels, ``y -> C - 1 - y`` (classification only)
``none``         honest
===============  ==============================================================================

``w`` is the site's honestly trained weights and ``g`` the global weights it started from.
Update attacks (all but ``labelflip``) act on the weights a site sends; ``labelflip`` acts on
its training labels, so the update it sends is honestly trained on poisoned data.
`hostile_sites` says which sites are hostile: the last M.

The default sign-flip strength K=4 follows the sign-flipping attack of Li et al. (RSA, AAAI
2019), where a Byzantine worker sends -4 times its true step: with one hostile site in five,
K=1 only shrinks FedAvg's step to 3/5, while K=4 cancels the honest sites' progress.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from fedsplit.protocol.errors import ConfigError

#: Attack kinds and whether each takes a ``:VALUE``: required (True), optional (None), no (False).
ATTACKS: dict[str, bool | None] = {
    "signflip": None,
    "scale": True,
    "gaussian": True,
    "nan": False,
    "labelflip": False,
}

_SYNTAX = "signflip[:K], scale:K, gaussian:SIGMA, nan, labelflip or none"
#: Sign-flip strength when ``signflip`` is given without ``:K`` (Li et al. 2019).
SIGNFLIP_DEFAULT = 4.0


@dataclass(frozen=True)
class Attack:
    """One kind of hostile behaviour, with its strength where it has one."""

    kind: str
    value: float | None = None

    @property
    def on_labels(self) -> bool:
        """True when the attack poisons training labels rather than the sent weights."""
        return self.kind == "labelflip"

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value:g}"

    def poison_update(
        self,
        arrays: Mapping[str, np.ndarray],
        global_arrays: Mapping[str, np.ndarray],
        *,
        seed: int = 0,
    ) -> dict[str, np.ndarray]:
        """Return the hostile version of honest weights ``arrays`` trained from ``global_arrays``.

        Names, shapes and dtypes are kept (so the attack is not caught by a mere layout check).
        ``labelflip`` returns the weights unchanged: its harm is in `poison_labels`.
        """
        missing = [n for n in arrays if n not in global_arrays]
        if missing and self.kind in ("signflip", "scale"):
            raise ConfigError(
                f"Attack {self} needs the global weights the site started from, but parameter "
                f"{missing[0]!r} is not among them. Pass the round's global arrays. "
                f"Received: {list(global_arrays)[:5]}"
            )
        rng = np.random.default_rng(seed)
        out: dict[str, np.ndarray] = {}
        for name, w in arrays.items():
            w = np.asarray(w)
            w64 = w.astype(np.float64)
            if self.kind == "signflip":
                g = np.asarray(global_arrays[name], dtype=np.float64)
                bad = g - (self.value if self.value is not None else SIGNFLIP_DEFAULT) * (w64 - g)
            elif self.kind == "scale":
                g = np.asarray(global_arrays[name], dtype=np.float64)
                bad = g + float(self.value or 0.0) * (w64 - g)
            elif self.kind == "gaussian":
                bad = w64 + float(self.value or 0.0) * rng.standard_normal(w.shape)
            elif self.kind == "nan":
                bad = np.full(w.shape, np.nan)
            else:  # labelflip: honest weights, poisoned data
                bad = w64
            with np.errstate(over="ignore"):
                out[name] = bad.astype(w.dtype)
        return out

    def poison_labels(self, y: np.ndarray, num_classes: int) -> np.ndarray:
        """Return hostile training labels (``labelflip``); other attacks keep ``y``."""
        if not self.on_labels:
            return y
        y = np.asarray(y)
        if y.dtype.kind not in "iu" or num_classes < 2:
            raise ConfigError(
                f"Attack labelflip flips class labels y -> C-1-y, so it needs a classification "
                f"task with integer labels and at least 2 classes; use signflip, scale:K or "
                f"gaussian:SIGMA for regression. Received: labels {y.dtype}, "
                f"{num_classes} class(es)"
            )
        if y.size and (y.min() < 0 or y.max() >= num_classes):
            raise ConfigError(
                f"Attack labelflip needs labels in 0..{num_classes - 1}. "
                f"Received: labels {int(y.min())}..{int(y.max())}"
            )
        return (num_classes - 1 - y).astype(y.dtype)


def parse_attack(text: str | None) -> Attack | None:
    """Parse an ``--attack`` string; ``None``, ``""`` or ``"none"`` mean no attack."""
    if text is None or not str(text).strip() or str(text).strip().lower() == "none":
        return None
    raw = str(text).strip()
    kind, sep, value_text = raw.partition(":")
    kind = kind.strip().lower()
    if kind not in ATTACKS:
        raise ConfigError(f"Unknown attack {kind!r}. Use one of: {_SYNTAX}. Received: {raw!r}")
    takes = ATTACKS[kind]
    if not sep:
        if takes is True:
            example = "scale:10" if kind == "scale" else "gaussian:0.5"
            raise ConfigError(
                f"Attack {kind!r} needs a value after a colon, e.g. {example}. Received: {raw!r}"
            )
        return Attack(kind)
    if takes is False:
        raise ConfigError(f"Attack {kind!r} takes no value; write just {kind}. Received: {raw!r}")
    try:
        value = float(value_text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(
            f"The value of attack {kind!r} must be a finite number, e.g. {kind}:10. "
            f"Received: {raw!r}"
        )
    if kind == "gaussian" and value <= 0:
        raise ConfigError(
            f"gaussian:SIGMA needs a noise standard deviation > 0. Received: {raw!r}"
        )
    if kind in ("scale", "signflip") and value == 0:
        raise ConfigError(
            f"{kind}:0 would send the global weights back unchanged (a silent site, not an "
            f"attack); use a non-zero factor such as {kind}:10. Received: {raw!r}"
        )
    return Attack(kind, value)


def hostile_sites(num_sites: int, attackers: int) -> list[int]:
    """Indices of the hostile sites: the last ``attackers`` of ``num_sites``."""
    if isinstance(attackers, bool) or not isinstance(attackers, int) or not (
        0 <= attackers < max(num_sites, 1)
    ):
        raise ConfigError(
            f"--attackers is how many of the {num_sites} sites are hostile: a whole number from 0 "
            f"to {max(num_sites - 1, 0)} (at least one site must stay honest). "
            f"Received: {attackers!r}"
        )
    return list(range(num_sites - attackers, num_sites))
