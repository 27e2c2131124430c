"""The metadata store: engine, sessions and the few writes the CLI also needs (add a site)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsplit.protocol.errors import ConfigError
from fedsplit.server.admin.config import default_database_url
from fedsplit.server.admin.security import hash_token, new_site_token
from fedsplit.server.admin.tables import Base, Site
from sqlalchemy import Engine, create_engine, event, inspect, select, text
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
)


def _add_missing_columns(engine: Engine) -> None:
    present = {table: {c["name"] for c in inspect(engine).get_columns(table)}
               for table in {t for t, _, _ in ADDED_COLUMNS}}
    with engine.begin() as conn:
        for table, column, sql_type in ADDED_COLUMNS:
            if column not in present[table]:
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}"))


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Return the session factory (objects stay readable after commit)."""
    return sessionmaker(engine, expire_on_commit=False)


def add_site(
    *, data_dir: Path, name: str, cohort_size: int | None = None, database_url: str | None = None
) -> str:
    """Register a site and return its new bearer token (only its hash is stored)."""
    if not name or len(name) > 128 or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(
            "A site name is 1-128 letters, digits, '-', '_' or '.', e.g. 'hospital-a'. "
            f"Received: {name!r}"
        )
    if cohort_size is not None and cohort_size < 1:
        raise ConfigError(
            f"--cohort-size is the site's number of patients/rows and must be >= 1. "
            f"Received: {cohort_size}"
        )
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    engine = make_engine(database_url or default_database_url(data_dir))
    token = new_site_token()
    try:
        with Session(engine) as session:
            if session.scalar(select(Site).where(Site.name == name)) is not None:
                raise ConfigError(
                    f"A site called {name!r} already exists in this store; pick another name. "
                    f"Received: {name!r}"
                )
            session.add(Site(name=name, token_hash=hash_token(token), cohort_size=cohort_size))
            try:
                session.commit()
            except IntegrityError as e:
                raise ConfigError(f"Could not add site {name!r}: {e.orig}. Received: {name!r}") from e
    finally:
        engine.dispose()
    return token
