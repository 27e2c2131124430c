"""`AdminContext`: the settings and shared services one admin API process holds."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.metrics import AdminMetrics
from fedsplit.server.admin.sandbox import Sandbox
from fedsplit.server.admin.security import hash_token
from fedsplit.server.admin.storage import FileStore
from fedsplit.server.admin.store import make_engine, make_sessionmaker
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker


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

    @classmethod
    def open(cls, settings: AdminSettings, sandbox: Sandbox | None = None) -> AdminContext:
        """Create directories, the database and (unless one is shared in) the sandbox."""
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        files = FileStore(settings.files_dir)
        files.prepare()
        engine = make_engine(settings.resolved_database_url)
        return cls(
            settings=settings,
            engine=engine,
            sessions=make_sessionmaker(engine),
            files=files,
            sandbox=sandbox or _started_sandbox(settings),
            owns_sandbox=sandbox is None,
            metrics=AdminMetrics(),
            admin_token_hash=hash_token(settings.admin_token.get_secret_value()),
        )

    def close(self) -> None:
        """Stop the sandbox and release the database connections."""
        if self.owns_sandbox:
            self.sandbox.close()
        self.engine.dispose()


def _started_sandbox(settings: AdminSettings) -> Sandbox:
    sandbox = Sandbox(workers=settings.parse_workers, timeout_s=settings.parse_timeout_s)
    sandbox.start()
    return sandbox
