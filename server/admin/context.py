"""`AdminContext`: the settings and shared services one admin API process holds."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from fedsplit.aggregation.settings import BackendSettings
from fedsplit.protocol.errors import ConfigError
from fedsplit.server.admin.audit import AuditLog
from fedsplit.server.admin.auditkey import AuditKey, key_path
from fedsplit.server.admin.auth import ADMIN, Principal, authenticate
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.errors import AuthenticationError, TooManyRequestsError
from fedsplit.server.admin.keras_layouts import move_layouts_out_of_rounds
from fedsplit.server.admin.limits import normalize_hosts
from fedsplit.server.admin.metrics import AdminMetrics
from fedsplit.server.admin.ratelimit import SignInLimiter
from fedsplit.server.admin.retention import prune_replaced
from fedsplit.server.admin.sandbox import Sandbox
from fedsplit.server.admin.security import hash_token
from fedsplit.server.admin.sitelimits import RequestRate, UploadSlots
from fedsplit.server.admin.storage import FileStore
from fedsplit.server.admin.store import make_engine, make_private, make_sessionmaker
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("fedsplit.admin.security")


@dataclass
class AdminContext:
    """Everything a request handler needs beyond its request."""

    settings: AdminSettings
    engine: Engine
    sessions: sessionmaker[Session]
    files: FileStore
    sandbox: Sandbox
    metrics: AdminMetrics
    admin_token_hash: str
    owns_sandbox: bool = True
    # Serialises the short "rename files + commit rows" step of uploads.
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    # One aggregation at a time: bounds memory to one strategy's working set.
    aggregate_lock: threading.Lock = field(default_factory=threading.Lock)
    # Failed sign-ins (web view and bearer tokens) per client address.
    limiter: SignInLimiter = field(default_factory=SignInLimiter)
    audit: AuditLog = field(init=False)
    # Per-hospital limits: uploads in progress, request rate (sitelimits.py).
    upload_slots: UploadSlots = field(init=False)
    request_rate: RequestRate = field(init=False)

    def __post_init__(self) -> None:
        self.audit = AuditLog(self.engine, AuditKey.open(
            key_path(self.settings.data_dir, self.settings.audit_key_file), create=True))
        self.upload_slots = UploadSlots(self.settings.site_concurrent_uploads)
        per_minute = self.settings.site_requests_per_minute
        self.request_rate = RequestRate(per_minute, burst=max(1, per_minute // 5))

    @classmethod
    def open(cls, settings: AdminSettings, sandbox: Sandbox | None = None) -> AdminContext:
        """Create directories, the database and (unless one is shared in) the sandbox."""
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            settings.data_dir.chmod(0o700)  # uploads, database and audit key: this user's only
        except OSError as e:
            raise ConfigError(
                f"--data-dir must be a folder this user owns: it is made private (mode 0700) so that "
                f"no other user of the machine reads hospitals' weights ({e.strerror}). "
                f"Received: {settings.data_dir}") from e
        files = FileStore(settings.files_dir)
        files.prepare()
        engine = make_engine(settings.resolved_database_url)
        make_private(engine)
        sessions = make_sessionmaker(engine)
        prune_replaced(files, sessions)  # replaced uploads' files a crash or an older server left
        move_layouts_out_of_rounds(sessions)  # Keras layouts older servers kept in round rows
        return cls(
            settings=settings,
            engine=engine,
            sessions=sessions,
            files=files,
            sandbox=sandbox or _started_sandbox(settings),
            owns_sandbox=sandbox is None,
            metrics=AdminMetrics(),
            admin_token_hash=hash_token(settings.admin_token.get_secret_value()),
        )

    @property
    def backend(self) -> BackendSettings:
        """How aggregations' passes run (`AdminSettings.backend`, built where the service starts)."""
        return self.settings.backend

    @property
    def allowed_hosts(self) -> tuple[str, ...]:
        """``--allowed-hosts``, normalized."""
        return normalize_hosts(self.settings.allowed_hosts)

    def check_bearer(self, token: str | None, address: str, *, kind: str = "api") -> Principal:
        """The principal of ``token`` sent from ``address``.

        Raises `AuthenticationError` (no or unknown token) or `TooManyRequestsError` (an unknown
        token while the address waits after failed sign-ins). Only failures are slowed down: a
        valid token is served during its address's wait (everyone behind one proxy or hospital
        NAT shares an address, and one wrong token every few minutes kept them all out). A
        failure outside a wait is logged and counts against the address; one during a wait is
        answered 429 and counted in the unauthenticated summary.
        """
        if not token:
            self.unauthenticated("no_token", address, flush=True)
            return authenticate(None, session=None, admin_token_hash="")  # type: ignore[arg-type]
        wait = self.limiter.wait_s(address)
        try:
            with self.sessions() as session:
                principal = authenticate(token, session=session, admin_token_hash=self.admin_token_hash)
        except AuthenticationError:
            if wait > 0:
                self.unauthenticated("rate_limited", address, flush=True)
                raise TooManyRequestsError(
                    f"Too many failed sign-ins from {address}; wait {wait:.0f} s before trying "
                    f"another token (the wait doubles with each further failure; a valid token is "
                    f"served meanwhile). Received: an unknown token while waiting", wait) from None
            failures, delay = self.limiter.failed(address)
            self.metrics.unauthenticated("bad_token")
            log.warning("sign-in failure (%s) from %s: unknown token; %d failure(s), next attempt "
                        "allowed in %.0f s", kind, address, failures, delay)
            self.audit.record("signin_failed", actor="unauthenticated", address=address,
                              channel=kind, failures=failures, delay_s=round(delay, 1))
            raise
        return principal  # a success does not reset the count: a valid token buys no more guesses

    def unauthenticated(self, kind: str, address: str | None, *, flush: bool = False) -> bool:
        """Count a request refused before any identity was known (metric and audit summary).

        Returns whether the audit summary is due; ``flush`` writes it here when it is.
        """
        self.metrics.unauthenticated(kind)
        due = self.audit.noise(kind, address)
        if due and flush:
            self.audit.flush_noise(force=False)
        return due

    def record(self, event: str, principal: Principal | None, address: str | None = None,
               **detail: object) -> None:
        """Append an audit record of ``principal``'s ``event`` (`audit.AuditLog.record`)."""
        if principal is None:
            actor, site_id = "unauthenticated", None
        elif principal.role == ADMIN:
            actor, site_id = ADMIN, None
        else:
            actor, site_id = str(principal.site_name), principal.site_id
        self.audit.record(event, actor=actor, site_id=site_id, address=address, **detail)

    def close(self) -> None:
        """Stop the sandbox and release the database connections."""
        self.audit.flush_noise()
        if self.owns_sandbox:
            self.sandbox.close()
        self.engine.dispose()


def _started_sandbox(settings: AdminSettings) -> Sandbox:
    sandbox = Sandbox(workers=settings.parse_workers, timeout_s=settings.parse_timeout_s)
    sandbox.start()
    return sandbox
