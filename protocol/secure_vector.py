"""The numbers secure aggregation moves: the encoded update, the masks, the neighbour graph.

Both ends use these (the hospital to encode and mask, the coordinator to unmask and decode);
the masks, keys, shares and quantisation are Flower's own primitives
(``flwr.common.secure_aggregation``), nothing here is cryptography of its own.

Encoding (`encode`): hospital k's change to the global model ``d_k = w_k - g`` (every array,
flattened in name order) must lie in ``[-B, B]`` coordinate-wise; outside it the hospital
refuses (`out_of_range`), nothing is clipped silently. Flower's ``quantize`` maps it to integers
in ``[0, L]`` (stochastic rounding), which are multiplied by the integer weight ``a_k`` (its
count for FedAvg) and followed by ``a_k`` itself, so the vector is
``[a_k * q(d_k), a_k]`` and the sum over hospitals is ``[sum a_k q(d_k), sum a_k]``: the
coordinator learns the weighted sum and the total weight, nothing per hospital. Arithmetic is
modulo ``M = 2^62``; the sum is exact while ``sum a_k * L < M`` (with the default
``L = 2^20``: a total count below 2^42 rows, checked when decoding; no per-hospital ceiling).

BatchNorm's running statistics follow the data's scale, not the weights': their change is
encoded divided by ``max(16, |g|)`` (`relative_scale`), which both ends know, so the declared
bound suits both kinds of tensor and the mean stays exact.

Decoding (`decode`): ``mean = (sum a_k q_k / sum a_k) * 2B / L - B``. Stochastic rounding moves
each coordinate of each update by less than one step ``2B / L``, so the decoded weighted mean
differs from the exact one by less than ``2B / L`` per coordinate (``2^-19 * B`` by default).

Neighbours (`neighbours`): SecAgg+ (Bell et al. 2020): hospitals sorted by node id on a ring,
each sharing secrets with itself and the ``(K - 1) / 2`` nearest on each side (an even ``K``
below N is raised by one so the graph stays symmetric).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from fedsplit.protocol.errors import UpdateError

MODULUS = 1 << 62
#: Bytes of a hospital's private-mask seed b: 128 bits of entropy. Flower's ``combine_shares``
#: pads a secret with PKCS7 to whole 16-byte blocks and reconstructs each block on its own, so a
#: 16-byte seed is 2 blocks against 3 for 32 bytes (a third less of the coordinator's
#: reconstruction time); fewer than 16 bytes would go below 128 bits. Flower's
#: ``pseudo_rand_gen`` folds any seed to 32 bits by XOR anyway (docs/privacy.md).
SEED_BYTES = 16
_LOW = np.int64(MODULUS - 1)  # x mod 2^62 == x & (2^62 - 1), also for negative int64 x


#: Tensors whose change is encoded relative to their size (`relative_scale`): BatchNorm's
#: running statistics, which follow the scale of the data, not of the weights.
RELATIVE = ("running_mean", "running_var")
#: The least scale of a running statistic: its change may reach ``STATS_SCALE x bound`` (a
#: hidden feature's variance moved by 1.16 in one round of a breast-cancer MLP, beyond the
#: default bound of 1), at a quantisation step of ``2 x 16 x bound / levels`` (3e-5 by default).
STATS_SCALE = 16.0


def relative_scale(start: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-coordinate scale ``max(STATS_SCALE, |g|)`` of the tensors named like BatchNorm
    running statistics (`RELATIVE`) in the global model ``start``, which every hospital and the
    coordinator hold: their change is encoded divided by it and the decoded weighted mean
    multiplied back, so it may reach 16 x bound, or bound x |g| for larger statistics. The
    mean is exact (every hospital divides by the same scale); other tensors are not scaled."""
    return {name: np.maximum(STATS_SCALE, np.abs(np.asarray(a, dtype=np.float64)))
            for name, a in start.items() if name.rpartition(".")[2] in RELATIVE}


def out_of_range(delta: Mapping[str, np.ndarray], bound: float) -> tuple[str, float] | None:
    """The first array whose change leaves ``[-bound, bound]`` and its largest magnitude, or None."""
    for name in sorted(delta):
        top = float(np.max(np.abs(delta[name]))) if np.size(delta[name]) else 0.0
        if not np.isfinite(top) or top > bound:
            return name, top
    return None


def encode(delta: Mapping[str, np.ndarray], weight: int, bound: float, levels: int) -> np.ndarray:
    """``[weight * quantize(delta), weight]`` as int64 (see the module docstring)."""
    from flwr.common.secure_aggregation.quantization import quantize

    if (bad := out_of_range(delta, bound)) is not None:
        raise UpdateError(
            f"This hospital's update changes {bad[0]} by {bad[1]:.4g}, outside the secure "
            f"aggregation range [-{bound}, {bound}]; it is not sent (nothing is clipped silently). "
            f"Raise the declared bound (secure-aggregation bound=B) or lower the learning rate. "
            f"Received: max |change| {bad[1]:.4g} in {bad[0]}"
        )
    if weight < 1 or weight * levels >= MODULUS:
        raise UpdateError(f"The secure weight must be an integer in [1, 2^62 / levels). "
                          f"Received: {weight}")
    flat = [np.asarray(delta[n], dtype=np.float64).reshape(-1) for n in sorted(delta)]
    q = quantize(flat, bound, levels)
    body = np.concatenate([a.astype(np.int64) for a in q]) if q else np.zeros(0, np.int64)
    return np.r_[body * np.int64(weight), np.int64(weight)].astype(np.int64)


def decode(total: np.ndarray, like: Mapping[str, np.ndarray], bound: float,
           levels: int) -> tuple[dict[str, np.ndarray], int]:
    """The weighted mean change (shaped like ``like``) and the total weight from a summed vector."""
    from flwr.common.secure_aggregation.quantization import dequantize

    weight = int(total[-1])
    if weight < 1 or weight * levels >= MODULUS:
        raise UpdateError(f"The secure sum's total weight {weight} times {levels} levels does not "
                          f"fit the modulus 2^62: the sum wrapped around. Lower levels. "
                          f"Received: total weight {weight}")
    mean_q = total[:-1].astype(np.float64) / weight
    flat = dequantize([mean_q], bound, levels)[0]
    out, at = {}, 0
    for name in sorted(like):
        size = int(np.size(like[name]))
        out[name] = flat[at:at + size].reshape(np.shape(like[name]))
        at += size
    if at != len(flat):
        raise UpdateError(f"The secure sum holds {len(flat)} values, the model {at}. "
                          f"Received: {len(total)} entries")
    return out, weight


def vector_size(like: Mapping[str, np.ndarray]) -> int:
    """Length of an encoded vector for a model shaped like ``like``."""
    return sum(int(np.size(a)) for a in like.values()) + 1


def mask(seed: bytes, size: int) -> np.ndarray:
    """A pseudo-random int64 vector in ``[0, M)`` from ``seed`` (Flower's ``pseudo_rand_gen``)."""
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    return pseudo_rand_gen(seed, MODULUS, [(size,)])[0].astype(np.int64, copy=False)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a + b) mod M`` for values in ``[0, M)`` (the sum stays below 2^63)."""
    return (a + b) & _LOW


def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a - b) mod M`` for values in ``[0, M)`` (two's complement: the mask is exact)."""
    return (a - b) & _LOW


def neighbours(nodes: Sequence[int], share_num: int) -> dict[int, list[int]]:
    """SecAgg+ ring: node -> the ``share_num`` nodes (itself included) it shares secrets with."""
    ring = sorted(nodes)
    n = len(ring)
    k = min(share_num, n)
    if k < n and k % 2 == 0:  # itself plus as many on each side: the graph stays symmetric
        k += 1
    out = {}
    for i, node in enumerate(ring):
        picked = {node}
        step = 1
        while len(picked) < k:
            picked.add(ring[(i + step) % n])
            if len(picked) < k:
                picked.add(ring[(i - step) % n])
            step += 1
        out[node] = sorted(picked)
    return out


# --- Weiszfeld steps of the geometric median under secure aggregation -----------------------
#: Resolution of a hospital's Weiszfeld weight: a_k = round(2^WEIGHT_BITS n_k D / max(nu', dist)).
WEIGHT_BITS = 10
#: Resolution of a distance: dist / (2 B sqrt(P)) in units of 2^-DIST_BITS.
DIST_BITS = 36


def flat(delta: Mapping[str, np.ndarray]) -> np.ndarray:
    """A change as one float64 vector, arrays in name order (the order `encode` uses)."""
    parts = [np.asarray(delta[n], dtype=np.float64).reshape(-1) for n in sorted(delta)]
    return np.concatenate(parts) if parts else np.zeros(0)


def max_distance(size: int, bound: float) -> float:
    """The largest distance two changes in ``[-B, B]^P`` can have: ``2 B sqrt(P)``."""
    return 2.0 * bound * float(np.sqrt(max(size, 1)))


def weiszfeld_weight(count: int, distance: float, scale: float, nu: float) -> int:
    """Hospital k's integer Weiszfeld weight for one step (see `encode_weiszfeld`)."""
    nu_eff = max(nu, scale * 2.0 ** -WEIGHT_BITS)
    return round((1 << WEIGHT_BITS) * count * scale / max(nu_eff, distance))


def encode_weiszfeld(delta: Mapping[str, np.ndarray], count: int, point: np.ndarray,
                     scale: float, nu: float, bound: float, levels: int) -> np.ndarray:
    """One smoothed-Weiszfeld step's vector ``[a_k q(d_k), a_k, n_k, n_k * dist_k]``.

    ``dist_k = ||d_k - z||`` to the broadcast point z; the weight alpha_k = n_k / max(nu,
    dist_k) is sent in fixed point relative to the broadcast scale D (the mean distance of
    the previous step): ``a_k = round(2^10 n_k D / max(nu', dist_k))`` with
    ``nu' = max(nu, D 2^-10)`` (weights are only defined up to a common factor; nu' caps a
    weight at 2^20 n_k). The sum gives the next point ``sum a_k d_k / sum a_k``, the total
    count and the objective ``g(z) = sum n_k dist_k`` (in units of ``2 B sqrt(P) 2^-36``).
    A hospital whose weight rounds to 0 (farther than 2^11 D) sends a zero contribution.
    """
    from flwr.common.secure_aggregation.quantization import quantize

    d = flat(delta)
    if (bad := out_of_range(delta, bound)) is not None:
        raise UpdateError(f"This hospital's update leaves [-{bound}, {bound}] ({bad[0]}). "
                          f"Received: max |change| {bad[1]:.4g}")
    if point.shape != d.shape or not np.all(np.isfinite(point)):
        raise UpdateError(f"The broadcast Weiszfeld point must be {d.size} finite values. "
                          f"Received: shape {point.shape}")
    distance = float(np.linalg.norm(d - point))
    weight = weiszfeld_weight(count, distance, scale, nu)
    body = np.concatenate([a.astype(np.int64) for a in quantize([d], bound, levels)])
    far = round(distance / max_distance(d.size, bound) * (1 << DIST_BITS))
    if weight * levels >= MODULUS or count * (1 << DIST_BITS) >= MODULUS:
        raise UpdateError(f"A Weiszfeld weight {weight} or count {count} does not fit the "
                          f"modulus. Received: weight {weight}, count {count}")
    return np.r_[body * np.int64(weight), np.int64(weight), np.int64(count),
                 np.int64(count) * np.int64(far)].astype(np.int64)


def decode_weiszfeld(total: np.ndarray, like: Mapping[str, np.ndarray], bound: float,
                     levels: int) -> tuple[dict[str, np.ndarray], int, int, float]:
    """(next point shaped like ``like``, weight sum, total count, objective g) from a sum."""
    size = vector_size(like) - 1
    count, far = int(total[-2]), int(total[-1])
    if count < 1 or len(total) != size + 3:
        raise UpdateError(f"A Weiszfeld sum holds {size} values, a weight, a count and a "
                          f"distance sum. Received: {len(total)} entries, count {count}")
    objective = far / (1 << DIST_BITS) * max_distance(size, bound)
    if int(total[-3]) < 1:  # every hospital is far: nothing to move to; the caller keeps z
        return {}, 0, count, objective
    point, weight = decode(total[:-2], like, bound, levels)
    return point, weight, count, objective
