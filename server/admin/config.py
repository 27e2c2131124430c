"""`AdminSettings`: the admin service's configuration, built once where its process starts
(``fedsplit admin serve``: `AdminSettings.from_environ` with the command's options and
``os.environ``) and passed to the app factory (`server.admin.app.create_app`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedsplit.aggregation.settings import DEFAULT_SETTINGS, BackendSettings
from fedsplit.protocol.errors import ConfigError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    InstanceOf,
    SecretStr,
    ValidationError,
    field_validator,
)

ADMIN_TOKEN_ENV = "FEDSPLIT_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "FEDSPLIT_ADMIN_TOKEN_FILE"
_PLACEHOLDERS = {"changethis", "changeme", "admin", "password", "secret", "token"}
MIN_TOKEN_CHARS = 16


class AdminSettings(BaseModel):
    """Configuration of one admin API process.

    Parameters
    ----------
    data_dir : Path
        Holds the SQLite database (unless ``database_url`` is set) and every stored file;
        resolved to an absolute path once, here. Made mode 0700 when the app starts.
    admin_token : SecretStr
        The admin's bearer token (``FEDSPLIT_ADMIN_TOKEN`` or the file ``FEDSPLIT_ADMIN_TOKEN_FILE``
        names). At least 16 characters; placeholders such as "changethis" are refused.
    database_url : str | None (default: None)
        SQLAlchemy URL of the metadata store; None means ``sqlite:///DATA_DIR/fedsplit-admin.db``.
    max_upload_mb : float (default: 1088)
        Largest accepted weight file, enforced while the body streams in (HTTP 413 past it).
    max_model_mb : float (default: 1024)
        Largest model, decompressed, a round's first upload (or template) may declare; later
        uploads may declare no more than the round's model. Checked from the shapes before any
        value is read (a gzip file is small; its values need not be).
    site_quota_mb : float (default: 4096)
        Bytes one hospital may hold in rounds still open (its uploads' files, one per upload);
        an upload past it is refused (``quota``).
    site_concurrent_uploads : int (default: 2)
        Uploads one hospital may have in progress at once; more get 429 before their body is read.
    site_requests_per_minute : int (default: 600)
        Requests one hospital's token may make a minute (bursts of up to a fifth of that); more
        get 429.
    parse_timeout_s : float (default: 120)
        Wall-clock limit of the sandboxed process that parses one upload.
    parse_memory_mb : int (default: 4096)
        Address-space limit added on top of the sandbox process's start size.
    parse_workers : int (default: 2)
        Uploads parsed at the same time; further uploads wait their turn.
    max_group_depth : int (default: 12)
        Deepest group tree a Keras file may have.
    aggregation_memory_mb : int (default: 512)
        Working memory a strategy may use beyond its output (``aggregate_updates``'s budget).
    runs : tuple[Path, ...] (default: ())
        Folders the web view (``/ui``) searches for Flower runs' ``history.json`` (``--runs``).
    allowed_hosts : tuple[str, ...] (default: localhost, 127.0.0.1, ::1)
        ``Host`` header values answered (``--allowed-hosts``); others get 400 (DNS rebinding).
        ``*.example.org`` allows its subdomains; ``*`` turns the check off.
    min_model_sites : int (default: 2)
        A hospital may download an aggregate (or a start model that is one) only when at least
        this many hospitals' updates went into it; below it the model is one hospital's weights,
        or close to them. The admin may always download.
    max_site_share : float (default: 0.6)
        ... and only when no other single hospital holds more than this share of the aggregate's
        weight (the (n, k) dominance rule of statistical disclosure control, n = 1).
    min_own_share : float (default: 0.1)
        ... and (``/model``) only when the hospital's own share is at least this fraction of an
        equal share (1/N of N hospitals).
    audit_key_file : Path | None (default: None)
        The audit log's HMAC key (``--audit-key-file``, ``FEDSPLIT_AUDIT_KEY_FILE``); None:
        ``DATA_DIR/audit.key``. Created with mode 0600 on first start; keep a copy elsewhere.
    docs : bool (default: True)
        Serve the API's interactive docs at ``/docs`` (from local files; ``--no-docs`` turns
        them off).
    backend : BackendSettings (default: the library's defaults)
        How the service's aggregations run (``FEDSPLIT_AGG_BACKEND``, ``FEDSPLIT_AGG_THREADS``,
        ``FEDSPLIT_MMAP``; `aggregation.BackendSettings`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path
    admin_token: SecretStr
    database_url: str | None = None
    max_upload_mb: float = Field(default=1088.0, gt=0)  # a 1 GiB model's file (issue 43)
    max_model_mb: float = Field(default=1024.0, gt=0)
    site_quota_mb: float = Field(default=4096.0, gt=0)
    site_concurrent_uploads: int = Field(default=2, ge=1)
    site_requests_per_minute: int = Field(default=600, ge=1)
    parse_timeout_s: float = Field(default=120.0, gt=0)
    parse_memory_mb: int = Field(default=4096, ge=256)
    parse_workers: int = Field(default=2, ge=1)
    max_group_depth: int = Field(default=12, ge=2, le=64)
    aggregation_memory_mb: int = Field(default=512, ge=16)
    runs: tuple[Path, ...] = ()
    allowed_hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
    min_model_sites: int = Field(default=2, ge=1)
    max_site_share: float = Field(default=0.6, gt=0, le=1)
    min_own_share: float = Field(default=0.1, ge=0, le=1)
    audit_key_file: Path | None = None
    docs: bool = True
    backend: InstanceOf[BackendSettings] = DEFAULT_SETTINGS

    @field_validator("data_dir", "audit_key_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        # resolved once: the upload sandbox runs in another working directory, so a relative
        # --data-dir made every upload's path wrong there (refused as parser_crash)
        return None if value is None else Path(value).expanduser().resolve()

    @field_validator("admin_token")
    @classmethod
    def _refuse_weak_token(cls, value: SecretStr) -> SecretStr:
        token = value.get_secret_value().strip()
        if len(token) < MIN_TOKEN_CHARS or token.lower() in _PLACEHOLDERS:
            raise ValueError(
                f"the admin token must be a random secret of at least {MIN_TOKEN_CHARS} characters "
                f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`). "
                f"Received: {len(token)} characters"
            )
        return SecretStr(token)

    @property
    def max_upload_bytes(self) -> int:
        """The upload limit in bytes."""
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def max_model_bytes(self) -> int:
        """The first upload's decompressed-size cap in bytes."""
        return int(self.max_model_mb * 1024 * 1024)

    @property
    def site_quota_bytes(self) -> int:
        """The per-hospital quota in bytes."""
        return int(self.site_quota_mb * 1024 * 1024)

    @property
    def files_dir(self) -> Path:
        """Where uploads, templates and models live."""
        return self.data_dir / "files"

    @property
    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite inside ``data_dir``."""
        return self.database_url or default_database_url(self.data_dir)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], **values: Any) -> AdminSettings:
        """Build settings from keyword values (the command's options) plus what ``environ``
        (the process's environment, read where it starts) names: the admin token and how
        aggregations run."""
        values.setdefault("admin_token", read_admin_token(environ))
        values.setdefault("backend", BackendSettings.from_environ(environ))
        try:
            return cls(**values)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
            )
            raise ConfigError(f"Invalid admin API settings: {problems}") from e


def default_database_url(data_dir: Path) -> str:
    """Return the SQLite URL used when none is configured."""
    return f"sqlite:///{(Path(data_dir) / 'fedsplit-admin.db').resolve()}"


def read_admin_token(environ: Mapping[str, str]) -> str:
    """Return the admin token from ``FEDSPLIT_ADMIN_TOKEN`` or the file ``FEDSPLIT_ADMIN_TOKEN_FILE``
    named in ``environ``."""
    token = environ.get(ADMIN_TOKEN_ENV)
    if token:
        return token
    token_file = environ.get(ADMIN_TOKEN_FILE_ENV)
    if token_file:
        try:
            return Path(token_file).read_text().strip()
        except OSError as e:
            raise ConfigError(
                f"{ADMIN_TOKEN_FILE_ENV} names a file that cannot be read ({e.strerror}). Point it "
                f"at a readable file holding the admin token. Received: {token_file}"
            ) from e
    raise ConfigError(
        f"The admin API needs an admin token: set {ADMIN_TOKEN_ENV} to a random secret of at least "
        f"{MIN_TOKEN_CHARS} characters, or {ADMIN_TOKEN_FILE_ENV} to a file holding it. "
        f"Received: neither is set"
    )
