"""The hospital's side of SecAgg+ (Bell et al. 2020), ported from Flower's ``secaggplus_mod``
to fedsplit's messages, on Flower's primitives (key agreement, Shamir shares, masking,
quantisation): no cryptography of its own.

Per round, four stages (the coordinator drives them, `server.secure`):

1. ``setup``: make two key pairs (pk1/sk1 for pairwise masks, pk2/sk2 to encrypt shares).
2. ``share-keys``: given the public keys of its neighbours, draw a fresh private-mask seed
   ``b`` (`protocol.secure_vector.SEED_BYTES`, 128 bits), split ``b`` and ``sk1`` into Shamir
   shares (threshold T of K), and encrypt each
   neighbour's pair of shares with the key agreed from sk2 and its pk2.
3. ``collect`` (with the train instruction, or a Weiszfeld step): decrypt the shares received,
   encode the update (`protocol.secure_vector.encode`) and add the private mask PRG(b) and,
   for every neighbour j that sent shares, +PRG(s_kj) if k < j else -PRG(s_kj), where s_kj is
   the key agreed from sk1 and j's pk1. Only this masked vector leaves.
4. ``unmask``: for each neighbour still active, reveal its share of ``b``; for each one that
   dropped, its share of ``sk1``; never both for one node.

The state between stages lives in the node's Flower ``Context.state`` (a config record).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.errors import FederationError

STATE = "secagg-state"


def _state(context: Any) -> dict[str, Any]:
    record = context.state.config_records.get(STATE)
    return dict(record) if record is not None else {}


def _save(context: Any, state: dict[str, Any]) -> None:
    from flwr.app import ConfigRecord

    context.state.config_records[STATE] = ConfigRecord(state)


def _expect(state: dict[str, Any], stage: str) -> None:
    order = {"share-keys": "setup", "collect": "share-keys", "unmask": "collect"}
    if state.get("stage") != order[stage]:
        raise FederationError(f"Secure aggregation stage {stage} must follow {order[stage]}; this "
                              f"hospital is at {state.get('stage')!r}. The coordinator restarts "
                              f"the round from setup. Received: stage={stage}")


def setup(context: Any, node_id: int, config: dict[str, Any]) -> dict[str, Any]:
    """Stage 1: new key pairs for this round; reply with the public keys."""
    from flwr.supercore.primitives.asymmetric import (
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )

    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    state = {"stage": "setup", "nid": str(int(node_id)), "round": int(config["round"]),
             "share-num": int(config["share-num"]), "threshold": int(config["threshold"]),
             "bound": float(config["bound"]), "levels": int(config["levels"]),
             "sk1": private_key_to_bytes(sk1), "pk1": public_key_to_bytes(pk1),
             "sk2": private_key_to_bytes(sk2), "pk2": public_key_to_bytes(pk2)}
    if int(config["modulus"]) != sv.MODULUS:
        raise FederationError(f"This hospital masks modulo 2^62. Received: modulus "
                              f"{config['modulus']}")
    _save(context, state)
    return {"pk1": state["pk1"], "pk2": state["pk2"]}


def share_keys(context: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Stage 2: Shamir-share b and sk1 among the neighbours; reply with encrypted shares."""
    from flwr.common.secure_aggregation.crypto.shamir import create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        encrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    state = _state(context)
    _expect(state, "share-keys")
    nodes = [int(n) for n in config["nodes"]]
    pk1s, pk2s = list(config["pk1"]), list(config["pk2"])
    me = int(state["nid"])
    if me not in nodes or len(set(pk1s + pk2s)) != 2 * len(nodes):
        raise FederationError("The neighbour keys must include this hospital's own, and every "
                              f"key must differ. Received: {len(nodes)} nodes")
    if pk1s[nodes.index(me)] != state["pk1"] or pk2s[nodes.index(me)] != state["pk2"]:
        raise FederationError("The coordinator relayed this hospital's own public keys wrongly. "
                              "Received: other keys under its node id")
    if len(nodes) < state["threshold"]:
        raise FederationError(f"Fewer neighbours ({len(nodes)}) than the reconstruction "
                              f"threshold ({state['threshold']}). Received: {nodes}")
    seed = os.urandom(sv.SEED_BYTES)
    b_shares = create_shares(seed, state["threshold"], len(nodes))
    sk_shares = create_shares(state["sk1"], state["threshold"], len(nodes))
    sk2 = bytes_to_private_key(state["sk2"])
    dsts, ciphertexts, ss2 = [], [], []
    held_nodes, held_b, held_sk = [me], [b_shares[nodes.index(me)]], [sk_shares[nodes.index(me)]]
    for i, (node, pk2) in enumerate(zip(nodes, pk2s, strict=True)):
        if node == me:
            ss2.append(b"")
            continue
        key = generate_shared_key(sk2, bytes_to_public_key(pk2))
        plain = share_keys_plaintext_concat(me, node, b_shares[i], sk_shares[i])
        dsts.append(str(node))
        ciphertexts.append(encrypt(key, plain))
        ss2.append(key)
    # "ss2": the key agreed with each neighbour, kept to decrypt its shares at the collect stage
    # (as Flower's secaggplus_mod keeps ss2_dict; the state holds sk2 itself anyway)
    state.update({"stage": "share-keys", "rd-seed": seed, "nodes": [str(n) for n in nodes],
                  "pk1s": pk1s, "pk2s": pk2s, "ss2": ss2,
                  "held-nodes": [str(n) for n in held_nodes], "held-b": held_b,
                  "held-sk": held_sk})
    _save(context, state)
    return {"dsts": dsts, "ciphertexts": ciphertexts}


def masked_vector(context: Any, config: dict[str, Any], vector: np.ndarray) -> np.ndarray:
    """Stage 3: keep the shares sent to this hospital; return ``vector`` masked."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
        decrypt,
        generate_shared_key,
    )
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    state = _state(context)
    _expect(state, "collect")
    me, nodes = int(state["nid"]), [int(n) for n in state["nodes"]]
    srcs = [int(s) for s in config["srcs"]]
    if len(srcs) + 1 < state["threshold"]:
        raise FederationError(f"Only {len(srcs)} neighbours sent shares, fewer than the "
                              f"threshold allows. Received: {srcs}")
    sk1 = bytes_to_private_key(state["sk1"])
    held_nodes = [int(n) for n in state["held-nodes"]]
    held_b, held_sk = list(state["held-b"]), list(state["held-sk"])
    masked = sv.add(vector.astype(np.int64) % sv.MODULUS, sv.mask(state["rd-seed"], len(vector)))
    for src, ciphertext in zip(srcs, config["ciphertexts"], strict=True):
        if src not in nodes or src == me:
            raise FederationError(f"Shares arrived from a node that is not a neighbour. "
                                  f"Received: {src}")
        plain = decrypt(state["ss2"][nodes.index(src)], ciphertext)
        got_src, got_dst, b_share, sk_share = share_keys_plaintext_separate(plain)
        if got_src != src or got_dst != me:
            raise FederationError(f"A share was relayed to the wrong hospital. Received: from "
                                  f"{got_src} to {got_dst}")
        held_nodes.append(src)
        held_b.append(b_share)
        held_sk.append(sk_share)
        pair = sv.mask(generate_shared_key(sk1, bytes_to_public_key(state["pk1s"][nodes.index(src)])),
                       len(vector))
        masked = sv.add(masked, pair) if me < src else sv.sub(masked, pair)
    state.update({"stage": "collect", "held-nodes": [str(n) for n in held_nodes], "held-b": held_b,
                  "held-sk": held_sk})
    _save(context, state)
    return masked


def unmask(context: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Stage 4: shares of b for active neighbours, of sk1 for dropped ones (never both)."""
    state = _state(context)
    _expect(state, "unmask")
    active, dropped = {int(n) for n in config["active"]}, {int(n) for n in config["dropped"]}
    if active & dropped:
        raise FederationError(f"A node cannot be both active and dropped: revealing both its "
                              f"shares would unmask its update. Received: {sorted(active & dropped)}")
    nodes, shares = [], []
    for node, b, sk in zip(state["held-nodes"], state["held-b"], state["held-sk"], strict=True):
        if int(node) in active:
            nodes.append(str(node))
            shares.append(b)
        elif int(node) in dropped:
            nodes.append(str(node))
            shares.append(sk)
    context.state.config_records.pop(STATE, None)  # the round's secrets are spent
    return {"nodes": nodes, "shares": shares}
