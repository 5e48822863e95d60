"""`make mutants`: plant each bug in tests/mutants/*.patch, one at a time, and check the tests catch it.

Each patch starts with two lines, `Planted bug: ...` and `Tests: <pytest paths>`, then a
unified diff against the repository. For every patch this copies the tracked files into a
temporary directory (models/ and .venv are linked, not copied), applies the patch there, and
runs its tests with that copy first on the import path (tritonservers the tests start import
engine_lib from it too). A mutant is caught when its tests fail; the run fails if any
mutant survives, if a patch no longer applies, or if the tests fail without any patch.

    python tests/mutants/run.py [--show] [name-fragment ...]   (--show: each run's failing test)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).resolve().parent


def read_patch(path: Path) -> tuple[str, list[str]]:
    lines = path.read_text().splitlines()
    why = lines[0].removeprefix("Planted bug: ").strip()
    assert lines[1].startswith("Tests: "), f"{path.name}: the second line must name its tests"
    tests = lines[1].removeprefix("Tests: ").split()
    assert not any(t.startswith("-") for t in tests), \
        f"{path.name}: name tests by path or node id (options such as -k would apply to every patch's tests at once)"
    return why, tests


def copy_tree(target: Path) -> None:
    """The tracked (and not ignored new) files of the repository, with models/ and .venv linked."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for name in files:
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    for name in ("models", ".venv"):
        if (ROOT / name).exists():
            (target / name).symlink_to(ROOT / name)


def run_tests(tree: Path, tests: list[str], show: bool = False) -> int:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line", *tests]
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if show and result.returncode != 0:
        failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
        print("    " + "\n    ".join(failed[-3:]))
    return result.returncode


def main(argv: list[str]) -> int:
    show = "--show" in argv
    argv = [a for a in argv if a != "--show"]
    patches = sorted(p for p in MUTANTS.glob("*.patch") if not argv or any(a in p.name for a in argv))
    plans = [(p, *read_patch(p)) for p in patches]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        clean = Path(tmp) / "clean"
        copy_tree(clean)
        every_test = sorted({t for _, _, tests in plans for t in tests})
        if run_tests(clean, every_test, show=True) != 0:
            print(f"the tests fail without any planted bug: {' '.join(every_test)}")
            return 1
        survivors = []
        for path, why, tests in plans:
            tree = Path(tmp) / path.stem
            copy_tree(tree)
            applied = subprocess.run(["git", "apply", str(path)], cwd=tree, capture_output=True, text=True)
            if applied.returncode != 0:
                print(f"{path.name}: does not apply any more ({applied.stderr.strip()}); update the patch")
                return 1
            began = time.monotonic()
            caught = run_tests(tree, tests, show) != 0
            print(f"{'caught  ' if caught else 'SURVIVED'} {path.stem} ({time.monotonic() - began:.0f} s): {why}")
            if not caught:
                survivors.append(path.name)
            shutil.rmtree(tree, ignore_errors=True)
    print(f"{len(plans) - len(survivors)} of {len(plans)} planted bugs caught in {time.monotonic() - start:.0f} s")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
