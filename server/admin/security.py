"""Bearer tokens: generation, hashing and constant-time comparison.

Tokens are 256-bit random strings, so one SHA-256 (no salt, no slow KDF) is enough to make a
stolen database useless: there is no low-entropy password to brute-force.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SITE_TOKEN_PREFIX = "fss_"


def new_site_token() -> str:
    """Return a fresh site token."""
    return SITE_TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Return the hex SHA-256 of ``token``: what the database stores."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def same_hash(a: str, b: str) -> bool:
    """Compare two token hashes in constant time."""
    return hmac.compare_digest(a.encode("ascii"), b.encode("ascii"))
