"""Sign-in failure limits per client address, with a growing delay.

Every failed sign-in (a wrong token on ``POST /ui/login`` or an unknown bearer token on the API)
counts against the client's address. The first `FREE_FAILURES` cost nothing; after that each
failure makes the address wait before its next attempt: 1 s, then 2, 4, 8 ... up to
`MAX_DELAY_S`. While it waits, every request carrying a token from that address is answered 429
with ``Retry-After`` and the token is not even checked, so guessing is capped at a few tokens per
minute. `QUIET_RESET_S` without a failure forgets the address; a success resets it. At most
`MAX_ADDRESSES` addresses are tracked (the least recently failing is forgotten first).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

FREE_FAILURES = 5
BASE_DELAY_S = 1.0
MAX_DELAY_S = 300.0
QUIET_RESET_S = 900.0
MAX_ADDRESSES = 10_000


@dataclass
class _Failures:
    count: int
    last: float
    next_allowed: float


class SignInLimiter:
    """Failed sign-ins per address and the delay they impose; thread-safe."""

    def __init__(self, *, free: int = FREE_FAILURES, base_s: float = BASE_DELAY_S,
                 max_s: float = MAX_DELAY_S, reset_s: float = QUIET_RESET_S,
                 max_addresses: int = MAX_ADDRESSES) -> None:
        self.free, self.base_s, self.max_s, self.reset_s = free, base_s, max_s, reset_s
        self.max_addresses = max_addresses
        self._state: OrderedDict[str, _Failures] = OrderedDict()
        self._lock = threading.Lock()

    def wait_s(self, address: str) -> float:
        """Seconds ``address`` must still wait before its next sign-in attempt (0: go ahead)."""
        now = time.monotonic()
        with self._lock:
            state = self._state.get(address)
            if state is None:
                return 0.0
            if now - state.last > self.reset_s:
                del self._state[address]
                return 0.0
            return max(0.0, state.next_allowed - now)

    def failed(self, address: str) -> tuple[int, float]:
        """Count a failure; return (failures so far, delay now imposed in seconds)."""
        now = time.monotonic()
        with self._lock:
            state = self._state.pop(address, None)
            if state is None or now - state.last > self.reset_s:
                state = _Failures(0, now, now)
            state.count += 1
            state.last = now
            over = state.count - self.free  # the first `free` failures cost nothing
            delay = 0.0 if over <= 0 else min(self.max_s, self.base_s * 2.0 ** (over - 1))
            state.next_allowed = now + delay
            self._state[address] = state
            while len(self._state) > self.max_addresses:
                self._state.popitem(last=False)
            return state.count, delay

    def succeeded(self, address: str) -> None:
        """Forget ``address``'s failures."""
        with self._lock:
            self._state.pop(address, None)
