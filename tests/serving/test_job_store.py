"""The front door's store (engine_lib/serving/openai_api/store.py) on SQLite and on a real, throwaway PostgreSQL
server: jobs and artifacts outlive the store that wrote them, a failed write leaves nothing behind, each key's
cap counts its own jobs, expiry removes exactly what is due, and a job whose runner died ends `failed`."""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import subprocess
import sys
import time

import psycopg
import pytest

from engine_lib.serving.openai_api.store import (ORPHAN_AGE_S, RESTARTED, STALE_S, PostgresStore, SQLiteStore,
                                                 StoreFull, open_store)
from tests.helpers.postgres import postgres_bin, throwaway_cluster

VIDEO = bytes(range(256)) * 9  # not a multiple of any block size
databases = itertools.count()  # the tests' stores on one PostgreSQL server


@pytest.fixture(scope="module")
def postgres_server():
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl): scripts/setup.sh installs Debian's postgresql")
    with throwaway_cluster(bin_dir) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def environment(request, tmp_path):
    """The environment of a front door on a fresh store: SQLite in the data dir, or a new PostgreSQL database."""
    env = {"DIFFUSION_DATA_DIR": str(tmp_path / "data")}
    if request.param == "postgres":
        env["JOB_STORE_URL"] = new_database(request.getfixturevalue("postgres_server"))
    return env


def new_database(server_url: str) -> str:
    """A URL of an empty store on the server: a schema of its own (a new database takes a second to copy)."""
    name = f"store_{next(databases)}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {name}")
    return f"{server_url}?options=-csearch_path%3D{name}"


@pytest.fixture
def stores(environment):
    """Opens stores on the same data (as front doors on one data dir, or replicas on one database)."""
    opened = []

    def store(**options):
        opened.append(open_store(environment, **options))
        return opened[-1]
    yield store
    for each in opened:
        each.close()


def artifacts(store) -> list[str]:
    return sorted(path.name for path in store.artifacts_dir.iterdir())


def test_open_store_picks_the_database_from_the_environment(tmp_path):
    store = open_store({"DIFFUSION_DATA_DIR": str(tmp_path), "DIFFUSION_DATA_MAX_BYTES": "4096"})
    assert isinstance(store, SQLiteStore) and store.max_bytes == 4096
    mode, = store._connection.execute("PRAGMA journal_mode").fetchone()
    assert mode == "wal" and (tmp_path / "jobs.sqlite3-wal").exists()
    store.close()
    for bad in ({"DIFFUSION_DATA_MAX_BYTES": "1e9"}, {"JOB_STORE_URL": "mysql://x"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            open_store({"DIFFUSION_DATA_DIR": str(tmp_path), **bad})


@pytest.mark.parametrize("url, says", [("mysql://x", "must be a postgresql:// URL"),
                                       ("postgresql://jobs:hunter2@127.0.0.1:1/jobs", "Connection refused")])
def test_a_store_that_cannot_open_stops_the_front_door_in_one_line(tmp_path, url, says):
    """A wrong scheme or a database it cannot reach: exit 2 and one line naming the store, no traceback, and
    never the URL's password."""
    env = {"PATH": "/usr/bin:/bin", "DIFFUSION_DATA_DIR": str(tmp_path), "JOB_STORE_URL": url}
    done = subprocess.run([sys.executable, "-m", "engine_lib.serving.openai_api", "--port", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "the job store cannot open" in done.stderr and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "hunter2" not in done.stdout + done.stderr


def test_a_completed_job_outlives_its_store_and_deleting_it_removes_row_and_file(stores, environment):
    first = stores()
    assert isinstance(first, PostgresStore) == ("JOB_STORE_URL" in environment)
    job = first.add_job("alice", {"model": "ltx2", "prompt": "rain"}, max_jobs=2)
    first.progress(job.id, 40)
    assert first.job("alice", job.id).status == "in_progress" and first.job("alice", job.id).progress == 40
    first.complete(job.id, VIDEO, "video/mp4")
    second = stores()  # another front door (a restart, or a replica)
    done = second.job("alice", job.id)
    assert (done.status, done.progress, done.request["prompt"]) == ("completed", 100, "rain")
    assert second.path(done.artifact).read_bytes() == VIDEO and artifacts(second) == [done.artifact]
    assert second.artifact("alice", done.artifact).size == len(VIDEO) and second.artifact("bob", done.artifact) is None
    assert second.job("bob", job.id) is None and second.jobs("bob") == []
    assert not second.delete_job("bob", job.id) and second.delete_job("alice", job.id)
    assert first.job("alice", job.id) is None and artifacts(first) == [] and first.used_bytes() == 0


def run_store(code: str, environment: dict) -> str:
    """Run `code` in a new Python process with `store`, the store `environment` names; its output."""
    prelude = "import json, os, sys\nfrom engine_lib.serving.openai_api.store import open_store\n" \
              "store = open_store(json.loads(sys.argv[1]))\n"
    return subprocess.run([sys.executable, "-c", prelude + code, json.dumps(environment)], capture_output=True,
                          text=True, check=True).stdout


# In a process of its own: a file size limit would hold for every child this one starts meanwhile.
FULL_DISK = """
import errno, resource, signal
job = store.add_job("alice", {"model": "ltx2"}, max_jobs=2)
big = bytes(range(256)) * 4608  # 1.2 MB: past the limit, which the database's own small writes stay within
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (len(big) // 4, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
store.complete(job.id, big, "video/mp4")
try:
    store.put_artifact("alice", big, "image/png", 60)
except OSError as exc:
    print(job.id, errno.errorcode[exc.errno])
"""


def test_a_result_that_cannot_be_written_fails_its_job_and_leaves_nothing(stores, environment):
    job_id, error = run_store(FULL_DISK, environment).split()
    assert error == "EFBIG"  # the image URL's write raised (507 at the front door); the process went on
    store = stores()
    failed = store.job("alice", job_id)
    assert failed.status == "failed" and failed.artifact is None and failed.error["code"] == "storage_full"
    assert "DIFFUSION_DATA_DIR" in failed.error["message"] and "File too large" in failed.error["message"]
    assert artifacts(store) == [] and store.used_bytes() == 0  # no file, no temporary, no row naming one


def test_the_job_cap_counts_only_the_keys_own_jobs(stores):
    store = stores()
    mine = [store.add_job("alice", {"n": i}, max_jobs=3) for i in range(3)]
    assert store.add_job("alice", {"n": 3}, max_jobs=3) is None
    for _ in range(4):  # bob's jobs do not count against alice's cap, nor hers against his
        assert store.add_job("bob", {}, max_jobs=4) is not None
    store.delete_job("alice", mine[0].id)
    assert store.add_job("alice", {"n": 4}, max_jobs=3) is not None
    assert [job.request["n"] for job in stores().jobs("alice")] == [1, 2, 4]  # creation order


def test_expiry_removes_what_is_due_rows_and_files_and_nothing_else(stores):
    now = [1000.0]
    store = stores(clock=lambda: now[0])
    store.result_ttl_s = 100
    job = store.add_job("alice", {}, max_jobs=5)
    store.complete(job.id, VIDEO, "video/mp4")  # expires at 1100
    short = store.put_artifact("alice", b"png", "image/png", ttl_s=30)  # at 1030
    long = store.put_artifact("alice", b"png", "image/png", ttl_s=300)  # at 1300
    now[0] = 1050.0
    store.sweep()
    assert store.artifact("alice", short.id) is None and store.artifact("alice", long.id) is not None
    assert short.id not in artifacts(store) and store.job("alice", job.id).artifact in artifacts(store)
    now[0] = 1100.0
    store.sweep()
    assert store.job("alice", job.id) is None and artifacts(store) == [long.id] and store.used_bytes() == 3


def test_a_full_store_expires_first_then_refuses(stores):
    now = [1000.0]
    store = stores(clock=lambda: now[0], max_bytes=2 * len(VIDEO))
    old = store.put_artifact("alice", VIDEO, "image/png", ttl_s=10)
    store.put_artifact("alice", VIDEO, "image/png", ttl_s=100)
    with pytest.raises(StoreFull, match="DIFFUSION_DATA_MAX_BYTES"):
        store.check_room()
    now[0] = 1010.0
    store.check_room()  # the expired one made room
    assert old.id not in artifacts(store) and store.used_bytes() == len(VIDEO)
    with pytest.raises(StoreFull):
        store.put_artifact("alice", VIDEO + b"!", "image/png", ttl_s=100)


def test_a_job_whose_front_door_died_fails_as_server_restarted_at_the_next_start(stores, environment):
    """The job's runner is a real process that exits (as a SIGKILLed front door) while its job runs."""
    job_id = run_store("job = store.add_job('alice', {}, 5); store.progress(job.id, 30); print(job.id, flush=True); "
                       "os._exit(0)", environment).strip()
    job = stores().job("alice", job_id)
    assert (job.status, job.error["message"], job.error["code"]) == ("failed", RESTARTED, "server_restarted")
    assert job.expires_at is not None


def test_another_hosts_job_fails_only_once_its_heartbeat_is_stale(stores):
    now = [1000.0]
    elsewhere = stores(clock=lambda: now[0])
    elsewhere.runner = "another-host/1"  # its pid cannot be checked from here
    job = elsewhere.add_job("alice", {}, max_jobs=5)
    here = stores(clock=lambda: now[0])
    orphan = here.add_job("alice", {}, max_jobs=5)  # this process's own, whose task ended without a word
    now[0] += STALE_S - 1
    elsewhere.heartbeat([job.id])
    now[0] += STALE_S - 1
    here.sweep()
    assert here.job("alice", job.id).status == "queued" and here.job("alice", orphan.id).status == "failed"
    now[0] += 2
    here.sweep()
    assert here.job("alice", job.id).status == "failed"


def test_sqlite_commits_every_change_in_a_transaction(tmp_path):
    """A second connection (another process's view) sees each change whole, never a job without its file."""
    store = SQLiteStore(tmp_path)
    job = store.add_job("alice", {}, max_jobs=5)
    store.complete(job.id, VIDEO, "video/mp4")
    reader = sqlite3.connect(tmp_path / "jobs.sqlite3")
    (status, artifact), = reader.execute("SELECT status, artifact FROM jobs WHERE id = ?", (job.id,)).fetchall()
    assert status == "completed" and (tmp_path / "artifacts" / artifact).read_bytes() == VIDEO
    assert not reader.in_transaction and not store._connection.in_transaction
    reader.close()
    store.close()


def test_a_result_file_no_row_names_is_removed_once_old(stores):
    """A process killed between writing a result and committing it leaves a file (or a temporary) no row names:
    the next start removes it once it is old enough not to be another replica's write in flight."""
    store = stores()
    kept = store.put_artifact("alice", b"png", "image/png", ttl_s=60)
    old, old_temporary, fresh = (store.artifacts_dir / name for name in ("file_old", ".file_gone.tmp", "file_new"))
    for path in (old, old_temporary, fresh):
        path.write_bytes(b"partial")
    for path in (old, old_temporary):
        os.utime(path, (time.time() - 2 * ORPHAN_AGE_S,) * 2)
    stores()
    assert artifacts(store) == sorted([kept.id, "file_new"])


def test_a_postgresql_connection_lost_fails_one_call_and_the_next_reconnects(postgres_server, tmp_path):
    url = new_database(postgres_server)
    store = PostgresStore(url, tmp_path)
    job = store.add_job("alice", {}, max_jobs=5)
    with psycopg.connect(url, autocommit=True) as admin:
        (killed,), = admin.execute("SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE "
                                   "datname = current_database() AND pid <> pg_backend_pid()").fetchall()
    assert killed >= 1
    with pytest.raises(psycopg.OperationalError):
        store.job("alice", job.id)
    assert store.job("alice", job.id).status == "queued"
    store.close()
