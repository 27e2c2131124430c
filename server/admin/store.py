"""The metadata store: engine, sessions and the few writes the CLI also needs (add a site)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedsplit.protocol.errors import ConfigError
from fedsplit.server.admin import audit
from fedsplit.server.admin.auditkey import AuditKey, key_path
from fedsplit.server.admin.config import default_database_url
from fedsplit.server.admin.security import hash_token, new_site_token
from fedsplit.server.admin.tables import Base, Site, utcnow
from sqlalchemy import Engine, create_engine, event, func, inspect, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    """Create the engine and the tables (SQLite: WAL journal, foreign keys, 30 s busy wait)."""
    is_sqlite = url.startswith("sqlite")
    kwargs: dict[str, Any] = {}
    if is_sqlite:
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    engine = create_engine(url, **kwargs)
    if is_sqlite:

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")  # an acknowledged upload survives power loss
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

    Base.metadata.create_all(engine)
    _add_missing_columns(engine)
    return engine


#: Columns added after the first release: (table, column, SQL type). `create_all` makes new
#: databases whole; an existing database gets them with ALTER TABLE ADD COLUMN (nullable, so rows
#: stored before read as NULL). Nothing is ever dropped or rewritten.
ADDED_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("uploads", "client_filename", "VARCHAR(255)"),
    ("sites", "removed_at", "DATETIME"),
    ("audit_log", "mac", "VARCHAR(64)"),
    ("uploads", "site_seq", "INTEGER"),
    ("ui_refused_uploads", "site_id", "INTEGER"),
)


def _add_missing_columns(engine: Engine) -> None:
    present = {table: {c["name"] for c in inspect(engine).get_columns(table)}
               for table in {t for t, _, _ in ADDED_COLUMNS}}
    with engine.begin() as conn:
        for table, column, sql_type in ADDED_COLUMNS:
            if column not in present[table]:
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}"))
        # uploads stored before site_seq existed: numbered per site in the order they came
        conn.execute(text(
            "UPDATE uploads SET site_seq = (SELECT COUNT(*) FROM uploads AS earlier WHERE "
            "earlier.site_id = uploads.site_id AND earlier.id <= uploads.id) WHERE site_seq IS NULL"))


def make_private(engine: Engine) -> None:
    """Make a SQLite database file (and its -wal/-shm files) readable by this user only: SQLite
    creates them under the umask (0644 under the usual 022), and SQLite gives -wal and -shm files
    it creates later the database file's mode."""
    database = engine.url.database if engine.url.get_backend_name() == "sqlite" else None
    if not database or database == ":memory:":
        return
    for suffix in ("", "-wal", "-shm"):
        path = Path(database + suffix)
        if path.exists():
            path.chmod(0o600)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Return the session factory (objects stay readable after commit)."""
    return sessionmaker(engine, expire_on_commit=False)


#: The actor of audit records written by the `fedsplit admin` commands.
CLI_ACTOR = "admin (cli)"

#: Names no hospital may take: they name the admin or a kind of caller in logs and pages.
RESERVED_NAMES = frozenset({
    "admin", "administrator", "root", "system", "server", "coordinator", "template", "anonymous",
    "unknown", "nobody", "everyone", "all", "no-token", "unknown-token", "fedsplit",
    "unauthenticated",  # the audit log's actor of requests without a valid token
})


def check_site_name(name: str) -> None:
    """Refuse a malformed or reserved site name (`ConfigError`)."""
    if not name or len(name) > 128 or not name.replace("-", "").replace("_", "").replace(".", "").isalnum() \
            or not name.isascii():
        raise ConfigError(
            "A site name is 1-128 letters, digits, '-', '_' or '.', e.g. 'hospital-a'. "
            f"Received: {name!r}"
        )
    if name.lower() in RESERVED_NAMES:
        raise ConfigError(
            f"{name!r} is reserved (it names the admin or a kind of caller in pages and logs); "
            f"pick a hospital's own name, e.g. 'hospital-a'. Reserved: {', '.join(sorted(RESERVED_NAMES))}. "
            f"Received: {name!r}"
        )


def _key(data_dir: Path, configured: Path | None) -> AuditKey:
    """The audit key the CLI's records are MAC'd with (created, 0600, if this is the first)."""
    return AuditKey.open(key_path(data_dir, configured), create=True)


def open_engine(*, data_dir: Path, database_url: str | None = None) -> Engine:
    """The store's engine (tables created); the caller disposes of it."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return make_engine(database_url or default_database_url(data_dir))


def site_ids_named(engine: Engine, name: str) -> list[int]:
    """Row ids of the site called ``name`` (removed or not); `ConfigError` if there is none."""
    with Session(engine) as session:
        ids = list(session.scalars(select(Site.id).where(Site.name == name)))
        if not ids:
            known = list(session.scalars(select(Site.name).order_by(Site.name)))
            raise ConfigError(f"There is no site {name!r} in this store. Sites: "
                              f"{', '.join(known) or 'none'}. Received: {name!r}")
    return ids


def add_site(
    *, data_dir: Path, name: str, cohort_size: int | None = None, database_url: str | None = None,
    audit_key_file: Path | None = None,
) -> str:
    """Register a site and return its new bearer token (only its hash is stored)."""
    check_site_name(name)
    if cohort_size is not None and cohort_size < 1:
        raise ConfigError(
            f"--cohort-size is the site's number of patients/rows and must be >= 1. "
            f"Received: {cohort_size}"
        )
    engine = open_engine(data_dir=data_dir, database_url=database_url)
    token = new_site_token()
    try:
        with Session(engine) as session:
            # names are compared case-folded: "HOSP-A" beside "hosp-a" would read as one hospital
            existing = session.scalar(select(Site).where(func.lower(Site.name) == name.lower()))
            if existing is not None and existing.name != name:
                raise ConfigError(
                    f"A site called {existing.name!r} already exists; names that differ only in "
                    f"case would read as one hospital in pages and logs. Pick another name. "
                    f"Received: {name!r}"
                )
            if existing is not None and existing.removed_at is not None:
                raise ConfigError(
                    f"A site called {name!r} was removed; a removed site keeps its name so its past "
                    f"uploads keep their owner. Register the hospital under a new name. "
                    f"Received: {name!r}"
                )
            if existing is not None:
                raise ConfigError(
                    f"A site called {name!r} already exists in this store; pick another name, or "
                    f"give it a new token with `fedsplit admin rotate-token`. Received: {name!r}"
                )
            site = Site(name=name, token_hash=hash_token(token), cohort_size=cohort_size)
            session.add(site)
            try:
                session.commit()
            except IntegrityError as e:
                raise ConfigError(f"Could not add site {name!r}: {e.orig}. Received: {name!r}") from e
            site_id = site.id
        audit.append(engine, _key(data_dir, audit_key_file), "site_added", actor=CLI_ACTOR,
                     site_id=site_id, site=name,
                     cohort_size=cohort_size)
    finally:
        engine.dispose()
    return token


def _live_site(session: Session, name: str) -> Site:
    site = session.scalar(select(Site).where(Site.name == name))
    if site is None or site.removed_at is not None:
        known = session.scalars(select(Site.name).where(Site.removed_at.is_(None)).order_by(Site.name))
        raise ConfigError(
            f"There is no registered site {name!r}"
            f"{' (it was removed)' if site is not None else ''}. Registered sites: "
            f"{', '.join(known) or 'none'}. Received: {name!r}"
        )
    return site


def remove_site(*, data_dir: Path, name: str, database_url: str | None = None,
                audit_key_file: Path | None = None) -> None:
    """Remove a site: its token matches nothing from now on, so its API access and its web-view
    sessions end at their next request; its uploads stay (attributed to it)."""

    def remove(site: Site) -> None:
        site.removed_at = utcnow()
        site.token_hash = secrets.token_hex(32)  # a hash no token was ever issued for

    _change_live_site(data_dir, name, database_url, audit_key_file, "site_removed", remove)


def rotate_token(*, data_dir: Path, name: str, database_url: str | None = None,
                 audit_key_file: Path | None = None) -> str:
    """Give a site a new token and return it; the old token (API and sessions) stops at once."""
    token = new_site_token()

    def rotate(site: Site) -> None:
        site.token_hash = hash_token(token)

    _change_live_site(data_dir, name, database_url, audit_key_file, "token_rotated", rotate)
    return token


def _change_live_site(data_dir: Path, name: str, database_url: str | None,
                      audit_key_file: Path | None, audit_event: str,
                      change: Callable[[Site], None]) -> None:
    """``change`` the registered (not removed) site ``name``, commit, then append ``audit_event`` to
    the audit log as the CLI."""
    engine = open_engine(data_dir=data_dir, database_url=database_url)
    try:
        with Session(engine) as session:
            site = _live_site(session, name)
            change(site)
            session.commit()
            site_id = site.id
        audit.append(engine, _key(data_dir, audit_key_file), audit_event, actor=CLI_ACTOR,
                     site_id=site_id, site=name)
    finally:
        engine.dispose()
