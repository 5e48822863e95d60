"""The nvidia-pytriton wheel's tritonserver, laid out to run.

The wheel ships the server binary, the Python backend and one backend stub per Python version, but not in
the layout `tritonserver` expects: `prepare_backend_dir` lays out python/ (libtriton_python.so, the utils
module and the stub matching this interpreter) and `server_env` gives the server the wheel's libraries and
this interpreter. With $TRITONSERVER (NGC images) the system's binary and backends are used instead.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Mapping, Optional

from engine_lib.serving.processes import REPO_ROOT, TritonServerError


def system_tritonserver() -> Optional[Path]:
    """$TRITONSERVER, a tritonserver binary with its backends in ../backends (NGC images); None: use the wheel."""
    value = os.environ.get("TRITONSERVER", "").strip()
    return Path(value) if value else None


def find_pytriton_dist() -> Path:
    """The `pytriton/tritonserver` directory of the installed nvidia-pytriton wheel."""
    try:
        import pytriton  # noqa: PLC0415 (optional dependency, only the launcher needs it)
    except ImportError as exc:
        raise TritonServerError("nvidia-pytriton is not installed; run `bash scripts/setup.sh`") from exc
    dist = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise TritonServerError(f"no tritonserver binary under {dist}")
    return dist


def prepare_backend_dir(target: Path, dist: Optional[Path] = None) -> Path:
    """Lay out `target/python/` as the Python backend for this interpreter's version; returns target."""
    dist = dist or find_pytriton_dist()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonServerError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(dist / "backends" / "python" / name, python_dir / name)
    shutil.copy2(stub, python_dir / "triton_python_backend_stub")
    return target


def python_shared_libdir() -> Optional[str]:
    """The directory of this interpreter's shared libpython, if it was built with one."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    return libdir if soname and (Path(libdir) / soname).exists() else None


def server_env(dist: Path, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Environment for tritonserver: the wheel's libraries, this venv's Python first on PATH."""
    env = dict(os.environ if base is None else base)
    libs = [str(dist.parent.parent / "nvidia_pytriton.libs")]
    # The stub links libpython<maj.min>.so; it must be this interpreter's, not a system one of another
    # patch level, or compiled stdlib modules (_ssl, ...) fail with undefined symbols.
    libpython_dir = python_shared_libdir()
    if libpython_dir:
        libs.insert(0, libpython_dir)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*libs, env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub embeds Python and takes its prefix from the first `python3` on PATH.
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.prefix) / "bin"), env.get("PATH", "")) if p)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env

