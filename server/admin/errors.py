"""Admin API errors (the `protocol.errors.FedsplitError` tree's admin branch).

    FedsplitError
    └── AdminError                     exit code 9 (protocol.errors), HTTP 400
        ├── AuthenticationError        HTTP 401  no token, or a token nobody was issued
        ├── PermissionDeniedError      HTTP 403  valid token, wrong role or wrong site
        ├── NotFoundError              HTTP 404  no such round, model or start model
        ├── ConflictError              HTTP 409  the round's state forbids it (aggregated, deadline)
        ├── UploadTooLargeError        HTTP 413  body over the size limit (checked while streaming)
        ├── InsufficientStorageError   HTTP 507  no room on the server's disk for the upload
        ├── TooManyRequestsError       HTTP 429  sign-in failures from this address: wait Retry-After
        └── UploadRefusedError         HTTP 422  the file or its count is refused; `reason` names why

`STATUS_OF` maps these (and protocol/aggregation errors) to HTTP: `server.admin.app` answers
with it, `services.refusals` records a refused upload's status with it.
"""

from __future__ import annotations

from fedsplit.aggregation.errors import (
    AggregationError,
    IncompatibleUpdatesError,
    NotEnoughUpdatesError,
    StrategyParamsError,
    UnknownStrategyError,
)
from fedsplit.protocol.errors import (
    AdminError,
    ConfigError,
    FedsplitError,
    UpdateError,
    WeightFileError,
)


class AuthenticationError(AdminError):
    """No bearer token, or one that matches no admin or site."""


class PermissionDeniedError(AdminError):
    """The token is valid but may not do this (site on an admin route, or another site's upload)."""


class NotFoundError(AdminError):
    """The round, model or start model does not exist."""


class ConflictError(AdminError):
    """The round's state forbids the request (already aggregated, past deadline, too few uploads)."""


class UploadTooLargeError(AdminError):
    """The upload is larger than the server's limit."""


class InsufficientStorageError(AdminError):
    """The server's files directory has no room for the upload (checked before its body is read)."""


class UploadRefusedError(AdminError):
    """An uploaded weight file or its sample count was refused; nothing was stored.

    ``reason`` is a short machine-readable code (``non_finite``, ``external_link``, ...), the
    label of the ``fedsplit_uploads_refused_total`` metric.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class TooManyRequestsError(AdminError):
    """Too many failed sign-ins (bad tokens) from one client address; ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


#: Domain error -> HTTP status; the first class in an error's MRO that is listed wins.
STATUS_OF: dict[type[FedsplitError], int] = {
    AuthenticationError: 401,
    PermissionDeniedError: 403,
    NotFoundError: 404,
    ConflictError: 409,
    UploadTooLargeError: 413,
    InsufficientStorageError: 507,
    TooManyRequestsError: 429,
    UploadRefusedError: 422,
    WeightFileError: 422,
    UpdateError: 422,
    ConfigError: 422,
    UnknownStrategyError: 422,
    StrategyParamsError: 422,
    IncompatibleUpdatesError: 422,
    NotEnoughUpdatesError: 409,
    AggregationError: 422,
    FedsplitError: 400,
}


def status_of(error: FedsplitError) -> int:
    """HTTP status for a fedsplit error."""
    for cls in type(error).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]  # type: ignore[index]
    return 400
