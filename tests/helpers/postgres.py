"""A throwaway PostgreSQL server for the store's tests: `initdb` in a temporary folder, `pg_ctl` on a free
loopback port, stopped and removed after. Debian keeps the binaries in /usr/lib/postgresql/<version>/bin
(scripts/setup.sh installs the `postgresql` package where it is missing)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from engine_lib.serving.processes import free_port


def postgres_bin() -> Optional[Path]:
    """The folder holding initdb and pg_ctl (PATH first, then Debian's newest version), None if absent."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def server_user() -> Optional[str]:
    """PostgreSQL refuses to run as root: then it runs as Debian's `postgres` user (or `nobody`)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name).pw_name
    raise RuntimeError("running as root, and there is no postgres or nobody user to run PostgreSQL as")


@contextlib.contextmanager
def throwaway_cluster(bin_dir: Path) -> Iterator[str]:
    """A running server with an empty database; yields its postgresql:// URL."""
    root = Path(tempfile.mkdtemp(prefix="pg-"))
    user = server_user()
    if user:
        shutil.chown(root, user)
    port, data = free_port(), root / "data"

    def run(*args: str) -> None:
        subprocess.run([str(bin_dir / args[0]), *args[1:]], check=True, capture_output=True, user=user, timeout=120)

    try:
        run("initdb", "-D", str(data), "-A", "trust", "-U", "store", "--no-sync", "-E", "UTF8")
        run("pg_ctl", "-D", str(data), "-l", str(root / "log"), "-w", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        try:
            yield f"postgresql://store@127.0.0.1:{port}/postgres"
        finally:
            run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
