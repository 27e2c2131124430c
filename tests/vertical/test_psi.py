"""Private set intersection: correct, agreed order, and nothing outside the intersection."""

from __future__ import annotations

import numpy as np
import pytest
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.vertical.psi import PsiParty, PsiSession


def _run(a_ids: list[str], b_ids: list[str]):
    a, b = PsiSession(a_ids), PsiSession(b_ids)
    a1, b1 = a.outgoing(), b.outgoing()
    a2, b2 = b.answer(a1), a.answer(b1)  # each re-encrypts what the other sent
    (al, ap), (bl, bp) = a.finish(a2, b1, b2), b.finish(b2, a1, a2)
    return al, ap, bl, bp, (a1, a2, b1, b2, a)


def test_both_parties_find_exactly_the_shared_ids_in_the_same_order(rng: np.random.Generator) -> None:
    universe = [f"MRN-{i:06d}" for i in rng.choice(10**6, 600, replace=False)]
    a_ids = universe[:400]
    b_ids = list(rng.permutation(universe[250:]))  # 150 shared, other order
    al, ap, bl, bp, _ = _run(a_ids, b_ids)
    shared = set(a_ids) & set(b_ids)
    assert {a_ids[r] for r in al.rows} == shared
    assert [a_ids[r] for r in al.rows] == [b_ids[r] for r in bl.rows]  # agreed order, no IDs sent
    assert ap == bp
    assert (al.own_size, al.other_size, bl.own_size, bl.other_size) == (400, 350, 350, 400)


def test_no_id_travels_in_the_clear_and_outside_ids_stay_unlinkable() -> None:
    a_ids = [f"LABEL-ONLY-{i:06d}" for i in range(50)] + [f"SHARED-{i:06d}" for i in range(20)]
    b_ids = [f"SHARED-{i:06d}" for i in range(20)] + [f"SITE-ONLY-{i:06d}" for i in range(50)]
    al, _, _, _, (a1, a2, b1, b2, label_holder) = _run(a_ids, b_ids)
    sent = b"".join(a1 + a2 + b1 + b2)
    for ident in a_ids + b_ids:
        assert ident.encode() not in sent
    # The label holder tries a dictionary attack on the site's own IDs with its own key: its
    # encryptions of them match nothing it received or computed, so it learns only shared IDs.
    guesses = set(label_holder.party.encrypt([f"SITE-ONLY-{i:06d}" for i in range(50)]))
    assert not guesses & (set(b1) | set(b2) | set(a2))
    assert {a_ids[r] for r in al.rows} == {f"SHARED-{i:06d}" for i in range(20)}


def test_encryption_is_keyed_and_commutative() -> None:
    p, q = PsiParty(), PsiParty()
    assert p.encrypt(["x"]) != q.encrypt(["x"])  # a fresh key per party
    assert q.reencrypt(p.encrypt(["x"])) == p.reencrypt(q.encrypt(["x"]))


def test_duplicate_ids_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"repeat.*Received: 3 rows, 2 distinct"):
        PsiSession(["1", "2", "2"])
