"""What the front door keeps beyond its process: video jobs, and artifacts (a job's mp4, the PNG behind an image
URL) with their expiry.

Rows live in a database, artifacts as files under `<data dir>/artifacts/`:
- `SQLiteStore` (the default): `<data dir>/jobs.sqlite3` in WAL mode, so readers never wait for a writer and a
  crash never leaves a half-written transaction.
- `PostgresStore` (JOB_STORE_URL=postgresql://...): one database for replicas that share the data dir on a
  volume, so any replica answers for any job. psycopg 3 (not SQLAlchemy): the store is a dozen plain SQL
  statements, the same for both databases but for the placeholder, and psycopg is one small dependency.

Every state change is one transaction. An artifact is written to a temporary file, flushed and renamed before
the transaction that names it commits: a row never points at a partial file, and a file without a row is never
served. A write that fails (a full disk) fails the job with a clear error instead of raising.

A running job records its runner (host and pid) and a heartbeat its front door renews every HEARTBEAT_S. Any
front door's sweep (at its start, then at every read) marks `failed` with "server restarted" a running job whose
runner is gone: its pid is dead on this host, or its heartbeat is older than STALE_S (another host's replica, or
a task of this process that died). Resubmitting instead would run a request twice that a client may already have
given up on. A start also removes the result files no row names (a process killed between a write and its
commit) once they are ORPHAN_AGE_S old.

Expiry deletes the row and the file. `max_bytes` (DIFFUSION_DATA_MAX_BYTES) bounds the artifacts' bytes: when
they are at it, expired ones are removed first, then new work is refused (StoreFull, an HTTP 507).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from engine_lib.serving.processes import REPO_ROOT

HEARTBEAT_S = 5.0
STALE_S = 20.0
RESTARTED = "server restarted"
RUNNING = ("queued", "in_progress")
DEFAULT_MAX_BYTES = 10 << 30
RESULT_TTL_S = 3600.0  # how long a finished job (and its video) is kept
ORPHAN_AGE_S = 3600.0
CONNECT_TIMEOUT_S = 5
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,"
    " request TEXT NOT NULL, status TEXT NOT NULL, progress INTEGER NOT NULL, completed_at DOUBLE PRECISION,"
    " expires_at DOUBLE PRECISION, error TEXT, artifact TEXT, runner TEXT, heartbeat_at DOUBLE PRECISION,"
    " seq BIGINT NOT NULL)",  # the owner's jobs in creation order
    "CREATE TABLE IF NOT EXISTS artifacts (id TEXT PRIMARY KEY, owner TEXT NOT NULL, media_type TEXT NOT NULL,"
    " size BIGINT NOT NULL, expires_at DOUBLE PRECISION NOT NULL)",
)
JOB_COLUMNS = "id, owner, created_at, request, status, progress, completed_at, expires_at, error, artifact"


class StoreFull(Exception):
    """The artifacts hold max_bytes even after expiry: new work is refused."""


@dataclass
class Job:
    """A video job's row. `request` is what its body echoes (model, prompt, size, seconds); `error` is OpenAI's
    error object."""

    id: str
    owner: str
    created_at: float
    request: dict
    status: str = "queued"
    progress: int = 0
    completed_at: Optional[float] = None
    expires_at: Optional[float] = None
    error: Optional[dict] = None
    artifact: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.status not in RUNNING


@dataclass
class Artifact:
    id: str
    owner: str
    media_type: str
    size: int
    expires_at: float


def this_runner() -> str:
    return f"{socket.gethostname()}/{os.getpid()}"


def runner_gone(runner: Optional[str]) -> bool:
    """Whether the process that ran a job is known dead: only a pid on this host can be checked."""
    host, _, pid = (runner or "").rpartition("/")
    if host != socket.gethostname() or not pid.isdecimal():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Store:
    """The jobs and artifacts of every caller (module docstring). Safe to share between threads: one connection,
    used under a lock. Subclasses open the connection and run a transaction."""

    placeholder = "?"

    def __init__(self, data_dir: os.PathLike | str, max_bytes: int = DEFAULT_MAX_BYTES,
                 result_ttl_s: float = RESULT_TTL_S, clock: Callable[[], float] = time.time):
        self.artifacts_dir = Path(data_dir) / "artifacts"
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.result_ttl_s, self.clock = max_bytes, result_ttl_s, clock
        self.runner = this_runner()
        self._lock = threading.Lock()
        with self._transaction() as run:
            self._create_schema(run)
        self.sweep()
        self.remove_orphans()

    # -- the database: subclasses ------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[Callable[..., list]]:
        raise NotImplementedError

    def _create_schema(self, run) -> None:
        for statement in SCHEMA:
            run(statement)

    def _lock_owner(self, run, owner: str) -> None:
        """Serialize one owner's job count and insert across replicas (SQLite's write lock already does)."""

    def _sql(self, statement: str) -> str:
        return statement.replace("?", self.placeholder)

    # -- jobs --------------------------------------------------------------------------------------------------

    def add_job(self, owner: str, request: Mapping[str, Any], max_jobs: int) -> Optional[Job]:
        """A new queued job run by this process; None when `owner` already holds `max_jobs` (its own only)."""
        job = Job(f"video_{secrets.token_hex(16)}", owner, self.clock(), dict(request))
        with self._transaction() as run:
            self._lock_owner(run, owner)
            (held,), = run("SELECT COUNT(*) FROM jobs WHERE owner = ?", owner)
            if held >= max_jobs:
                return None
            run("INSERT INTO jobs (id, owner, created_at, request, status, progress, runner, heartbeat_at, seq) "
                "VALUES (?, ?, ?, ?, ?, 0, ?, ?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs WHERE owner = ?))",
                job.id, owner, job.created_at, json.dumps(job.request), job.status, self.runner, job.created_at, owner)
        return job

    def job(self, owner: str, job_id: str) -> Optional[Job]:
        rows = self._read(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = ? AND owner = ?", job_id, owner)
        return job_of(rows[0]) if rows else None

    def jobs(self, owner: str) -> list[Job]:
        """The owner's jobs, oldest first."""
        return [job_of(row) for row in
                self._read(f"SELECT {JOB_COLUMNS} FROM jobs WHERE owner = ? ORDER BY seq", owner)]

    def progress(self, job_id: str, progress: int) -> None:
        with self._transaction() as run:
            run("UPDATE jobs SET status = 'in_progress', progress = ?, heartbeat_at = ? WHERE id = ? AND status IN "
                "('queued', 'in_progress')", progress, self.clock(), job_id)

    def heartbeat(self, job_ids: list[str]) -> None:
        """This front door still runs these jobs."""
        with self._transaction() as run:
            for job_id in job_ids:
                run("UPDATE jobs SET heartbeat_at = ? WHERE id = ?", self.clock(), job_id)

    def complete(self, job_id: str, data: bytes, media_type: str) -> None:
        """The job's result as an artifact, then the job completed; a failed write fails the job instead."""
        try:
            artifact = self._write_artifact(data)
        except OSError as exc:
            return self.fail(job_id, storage_error(exc))
        now, ttl_s = self.clock(), self.result_ttl_s
        with self._transaction() as run:
            owner = run("SELECT owner FROM jobs WHERE id = ?", job_id)
            if owner:  # else deleted meanwhile: the file goes with it, below
                run("INSERT INTO artifacts (id, owner, media_type, size, expires_at) VALUES (?, ?, ?, ?, ?)",
                    artifact, owner[0][0], media_type, len(data), now + ttl_s)
                run("UPDATE jobs SET status = 'completed', progress = 100, completed_at = ?, expires_at = ?, "
                    "artifact = ? WHERE id = ?", now, now + ttl_s, artifact, job_id)
        if not owner:
            self._remove_files([artifact])

    def fail(self, job_id: str, error: dict) -> None:
        with self._transaction() as run:
            self._fail(run, job_id, error)

    def _fail(self, run, job_id: str, error: dict) -> None:
        now = self.clock()
        run("UPDATE jobs SET status = 'failed', completed_at = ?, expires_at = ?, error = ? WHERE id = ?",
            now, now + self.result_ttl_s, json.dumps(error), job_id)

    def delete_job(self, owner: str, job_id: str) -> bool:
        """Forget the job and its artifact (row and file); False if the owner has no such job."""
        with self._transaction() as run:
            rows = run("SELECT artifact FROM jobs WHERE id = ? AND owner = ?", job_id, owner)
            if rows:
                run("DELETE FROM jobs WHERE id = ?", job_id)
                run("DELETE FROM artifacts WHERE id = ?", rows[0][0])
        self._remove_files([rows[0][0]] if rows and rows[0][0] else [])
        return bool(rows)

    # -- artifacts ---------------------------------------------------------------------------------------------

    def put_artifact(self, owner: str, data: bytes, media_type: str, ttl_s: float) -> Artifact:
        """Keep `data` for `ttl_s` (an image URL's file); StoreFull or OSError (a full disk) when it cannot."""
        self.check_room(len(data))
        artifact = Artifact(self._write_artifact(data), owner, media_type, len(data), self.clock() + ttl_s)
        with self._transaction() as run:
            run("INSERT INTO artifacts (id, owner, media_type, size, expires_at) VALUES (?, ?, ?, ?, ?)",
                artifact.id, owner, media_type, artifact.size, artifact.expires_at)
        return artifact

    def artifact(self, owner: str, artifact_id: str) -> Optional[Artifact]:
        """The owner's unexpired artifact."""
        rows = self._read("SELECT id, owner, media_type, size, expires_at FROM artifacts WHERE id = ? AND owner = ? "
                          "AND expires_at > ?", artifact_id, owner, self.clock())
        return Artifact(*rows[0]) if rows else None

    def path(self, artifact_id: str) -> Path:
        return self.artifacts_dir / artifact_id

    def used_bytes(self) -> int:
        (used,), = self._read("SELECT COALESCE(SUM(size), 0) FROM artifacts")
        return int(used)

    def check_room(self, more: int = 0) -> None:
        """Raise StoreFull when the artifacts are at max_bytes (or `more` bytes would pass it) even after expiry."""
        def full(used: int) -> bool:
            return used >= self.max_bytes or used + more > self.max_bytes

        if full(self.used_bytes()):
            self.expire()
            used = self.used_bytes()
            if full(used):
                raise StoreFull(f"the data store holds {used} bytes of results, at its limit of {self.max_bytes} "
                                f"(DIFFUSION_DATA_MAX_BYTES): delete finished video jobs or wait for results to expire")

    # -- sweeps ------------------------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Expire what is due and fail the running jobs whose runner is gone."""
        self.expire()
        now = self.clock()
        with self._transaction() as run:
            for job_id, runner, heartbeat_at in run("SELECT id, runner, heartbeat_at FROM jobs WHERE status IN "
                                                    "('queued', 'in_progress')"):
                if runner_gone(runner) or heartbeat_at < now - STALE_S:  # this process's own: if its task died
                    self._fail(run, job_id, restarted_error())

    def remove_orphans(self) -> None:
        """Remove the files no row names that are over ORPHAN_AGE_S old: left by a process killed between
        writing a result and committing it (younger ones may be another replica's, about to be committed)."""
        named = {row[0] for row in self._read("SELECT id FROM artifacts")}
        for path in self.artifacts_dir.iterdir():
            artifact_id = path.name.removeprefix(".").removesuffix(".tmp")
            with suppress(FileNotFoundError):
                if artifact_id not in named and path.stat().st_mtime < time.time() - ORPHAN_AGE_S:
                    path.unlink()

    def expire(self) -> None:
        """Delete the expired jobs and artifacts: rows, then files."""
        now = self.clock()
        with self._transaction() as run:
            files = [row[0] for row in run("SELECT id FROM artifacts WHERE expires_at <= ?", now)]
            run("DELETE FROM artifacts WHERE expires_at <= ?", now)
            run("DELETE FROM jobs WHERE expires_at <= ?", now)
        self._remove_files(files)

    # -- files -------------------------------------------------------------------------------------------------

    def _write_artifact(self, data: bytes) -> str:
        """A new artifact file, whole: written to a temporary name, flushed to disk, then renamed."""
        artifact_id = f"file_{secrets.token_hex(16)}"
        temporary = self.artifacts_dir / f".{artifact_id}.tmp"
        try:
            with open(temporary, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path(artifact_id))
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        return artifact_id

    def _remove_files(self, artifact_ids: list[str]) -> None:
        for artifact_id in artifact_ids:
            self.path(artifact_id).unlink(missing_ok=True)

    def _read(self, statement: str, *args) -> list:
        with self._transaction() as run:
            return run(statement, *args)

    def close(self) -> None:
        with self._lock:
            self._connection.close()


def restarted_error() -> dict:
    return {"code": "server_restarted", "message": RESTARTED, "param": None, "type": "server_error"}


def storage_error(exc: OSError) -> dict:
    return {"code": "storage_full", "message": f"the result could not be stored in the data directory "
                                               f"(DIFFUSION_DATA_DIR): {exc.strerror or exc}", "param": None,
            "type": "server_error"}


def job_of(row) -> Job:
    job = Job(*row)
    job.request = json.loads(job.request)
    job.error = json.loads(job.error) if job.error else None
    return job


class SQLiteStore(Store):
    """The default: `<data dir>/jobs.sqlite3`, in WAL mode."""

    def __init__(self, data_dir: os.PathLike | str, **options):
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; each change is in an explicit BEGIN IMMEDIATE.
        self._connection = sqlite3.connect(Path(data_dir) / "jobs.sqlite3", isolation_level=None,
                                           check_same_thread=False, timeout=30)
        self._connection.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit survives a killed process (WAL); a power loss may take the last few back, never corrupt.
        self._connection.execute("PRAGMA synchronous=NORMAL")
        super().__init__(data_dir, **options)

    @contextmanager
    def _transaction(self):
        with self._lock:
            cursor = self._connection.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            try:
                yield lambda statement, *args: cursor.execute(self._sql(statement), args).fetchall()
                cursor.execute("COMMIT")
            except BaseException:
                if self._connection.in_transaction:  # a failed COMMIT may have rolled back already
                    cursor.execute("ROLLBACK")
                raise


class PostgresStore(Store):
    """JOB_STORE_URL=postgresql://...: the rows in PostgreSQL, shared by replicas (the data dir on a shared
    volume)."""

    placeholder = "%s"

    def __init__(self, url: str, data_dir: os.PathLike | str, **options):
        import psycopg  # noqa: PLC0415 (only a shared store needs it)

        # A bounded connect: the store is called from the front door's event loop.
        self._connect = lambda: psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        self._connection = self._connect()
        super().__init__(data_dir, **options)

    @contextmanager
    def _transaction(self):
        with self._lock:
            if self._connection.closed:  # lost (the server restarted, a network cut): the call that saw it failed
                self._connection = self._connect()
            with self._connection.transaction():
                cursor = self._connection.cursor()

                def run(statement, *args):
                    cursor.execute(self._sql(statement), args)
                    return cursor.fetchall() if cursor.description else []
                yield run

    def _create_schema(self, run) -> None:
        run("SELECT pg_advisory_xact_lock(1953723757)")  # replicas starting together create the tables once
        super()._create_schema(run)

    def _lock_owner(self, run, owner: str) -> None:
        run("SELECT pg_advisory_xact_lock(hashtext(?))", owner)


def open_store(environ: Mapping[str, str], **options) -> Store:
    """The store the environment names: DIFFUSION_DATA_DIR (default `data/` in the repository), JOB_STORE_URL
    (postgresql://...; default: SQLite in the data dir), DIFFUSION_DATA_MAX_BYTES (default 10 GiB). `options`
    (max_bytes, result_ttl_s, clock) override."""
    data_dir = environ.get("DIFFUSION_DATA_DIR", "").strip() or str(REPO_ROOT / "data")
    text = environ.get("DIFFUSION_DATA_MAX_BYTES", "").strip()
    if text and not text.isdecimal():
        raise ValueError(f"DIFFUSION_DATA_MAX_BYTES {text!r} is not a number of bytes")
    options = {"max_bytes": int(text) if text else DEFAULT_MAX_BYTES, **options}
    url = environ.get("JOB_STORE_URL", "").strip()
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise ValueError("JOB_STORE_URL must be a postgresql:// URL (unset: SQLite in DIFFUSION_DATA_DIR)")
    return PostgresStore(url, data_dir, **options) if url else SQLiteStore(data_dir, **options)
