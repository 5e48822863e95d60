"""`make mutants`: plant each bug of tests/mutants/*.mutant, one at a time, and check the tests catch it.

A mutant file is plain text that names its bug, its tests and the file it plants into, then
one or more search/replace blocks (whole lines, copied verbatim, indentation included):

    Planted bug: A final output leaves the request's sink registered (a second final can follow).
    Tests: tests/engine/test_engine.py
    File: engine_lib/engine.py

    <<<< SEARCH
                sink = self._sinks.pop(output.request_id, None) if output.is_final else self._sinks.get(output.request_id)
    ==== REPLACE
                sink = self._sinks.get(output.request_id)
    >>>> END

`Tests:` lists pytest paths or node ids (no options: the baseline joins every selected
mutant's tests into one pytest command). The blocks apply in order to the file named by the
`File:` line above them (a mutant may name several files, each with its own `File:` line);
each search text must occur exactly once in that file (as the blocks before it left it),
starting at a line start, or the run stops with "search text of <mutant> found N times in
<file>: update the mutant". An empty REPLACE deletes the searched lines. Blank lines outside
blocks are ignored. Keep a search text small: the lines the bug changes, plus just enough
neighbouring lines to be unique.

For every selected mutant the runner copies the tracked (and not ignored new) files into a
temporary directory (models/ and .venv are linked, not copied), plants the bug there and runs
its tests with that copy first on the import path (tritonservers the tests start import
engine_lib from it too). A mutant is caught when its tests fail. Before the mutants, the
selected mutants' tests run once on the unchanged copy (the baseline): a planted bug only
counts as caught if its tests pass without it. Each mutant prints `caught` or `SURVIVED`
with its seconds, and the run ends with the total; it fails if any mutant survives, if one no
longer applies, if pytest cannot find one's tests (a renamed test is an error, never a catch),
or if the baseline fails.

    python tests/mutants/run.py [options] [name-fragment ...]

Selection (without any of these: every mutant; with several: their union):
    name-fragment         mutants whose file name contains the fragment (e.g. 09 or sender)
    --core                the core set (CORE below): one final response per request in the
                          engine and the sender, the step scheduler's compatibility keys,
                          a failing batched forward failing only its own requests, close and
                          shutdown ending open streams, request parameters never standing in
                          for inputs, the priority key
    --changed-since REV   mutants whose target file, whose mutant file, or one of whose test
                          files differs between commit REV and the working tree
    --changed-recently    --changed-since the commit in $MUTANTS_BASE if set, else the newest
                          commit at least 6 hours older than HEAD's commit date
                          (`git rev-list -1 --before=<HEAD's date - 6 h> HEAD`); where there is
                          no such commit (a young history), every mutant
Running:
    --check               only plant each selected mutant into the repository's text (in
                          memory; nothing is written, no tests run) and report every one that
                          does not apply or names a test file that does not exist; after a
                          refactor this lists the mutants to re-anchor
    --list                print the selection (and why each is in it) without running anything
    --no-baseline         skip the baseline (when the same tree's full test suite just passed,
                          as in CI)
    --budget SECONDS      run the selected mutants in priority order (the core set, then those
                          of changed files in CORE_FILES, then those whose target file
                          changed, then the rest) and leave out the ones that would start
                          once SECONDS have passed since the first mutant started; the core
                          set always runs. Left-out mutants are listed; they do not fail
                          the run
    --show                print each caught mutant's failing test
    --no-fork             run each pytest in a fresh interpreter instead of a child forked from
                          the runner after it imported torch, diffusers and transformers once
                          (WARM_PACKAGES; much faster for the engine's and pipelines' tests)
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).resolve().parent
RECENT_HOURS = 6

# The core set: fast mutants on the central guarantees, run by CI on every change.
CORE = (
    "01-engine-final-keeps-its-sink",             # one final response per request (engine)
    "07-sender-failed-send-ends-nothing",         # one final response per request (sender)
    "09-step-scheduler-ignores-keys",             # only compatible requests share a step batch
    "02-runner-denoise-failure-fails-the-batch",  # a failing batched forward fails only its requests
    "03-runner-decode-failure-fails-the-batch",   # so does a failing batched decode
    "11-scheduler-error-fails-everyone",          # an error for one request fails only that request
    "04-engine-close-forgets-open-streams",       # the engine's close ends every open stream
    "05-sender-drain-forgets-open-streams",       # the sender's shutdown ends every open stream
    "87-parameters-stand-in-for-inputs",          # a request parameter never stands in for an input
    "89-priority-key-not-checked",                # only key holders pass the default priority level
)

# The engine's core files: under --budget, the mutants of these files run first when they changed.
CORE_FILES = (
    "engine_lib/engine.py",
    "engine_lib/runner.py",
    "engine_lib/config.py",
    "engine_lib/request.py",
    "engine_lib/interface.py",
    "engine_lib/serving/sender.py",
    "engine_lib/sched/",
)

SEARCH, REPLACE, END = "<<<< SEARCH", "==== REPLACE", ">>>> END"


class MutantError(Exception):
    """A mutant file that cannot be read, or that no longer applies to the repository."""


@dataclass
class Block:
    path: str
    search: str
    replace: str


@dataclass
class Mutant:
    file: Path
    why: str
    tests: list[str]
    blocks: list[Block] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why it is selected
    core: bool = False
    changed_targets: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        """Run order: 0 always runs (the core set), then 1 (a changed core file), 2 (a changed target), 3."""
        if self.core:
            return 0
        if any(is_core_file(path) for path in self.changed_targets):
            return 1
        return 2 if self.changed_targets else 3

    @property
    def name(self) -> str:
        return self.file.stem

    @property
    def targets(self) -> list[str]:
        return sorted({b.path for b in self.blocks})

    @property
    def test_files(self) -> list[str]:
        return sorted({t.split("::")[0] for t in self.tests})


def read_mutant(path: Path) -> Mutant:
    """Parse one mutant file (the format is in this module's docstring)."""
    lines = path.read_text().splitlines(keepends=True)
    where = lambda n: f"{path.name}:{n + 1}"  # noqa: E731
    why = tests = target = None
    blocks: list[Block] = []
    n = 0
    while n < len(lines):
        line = lines[n].rstrip("\n")
        if line.startswith("Planted bug:"):
            why = line.removeprefix("Planted bug:").strip()
        elif line.startswith("Tests:"):
            tests = line.removeprefix("Tests:").split()
            if not tests or any(t.startswith("-") for t in tests):
                raise MutantError(f"{where(n)}: name tests by path or node id (options such as -k would "
                                  "apply to every mutant's tests in the baseline)")
        elif line.startswith("File:"):
            target = line.removeprefix("File:").strip()
        elif line.rstrip() == SEARCH:
            if target is None:
                raise MutantError(f"{where(n)}: a {SEARCH} block before any File: line")
            parts: dict[str, list[str]] = {SEARCH: [], REPLACE: []}
            part, start = SEARCH, n
            n += 1
            while n < len(lines) and lines[n].rstrip() != END:
                if lines[n].rstrip() == REPLACE and part == SEARCH:
                    part = REPLACE
                elif lines[n].rstrip() in (SEARCH, REPLACE):
                    raise MutantError(f"{where(n)}: {lines[n].rstrip()} out of place")
                else:
                    text = lines[n] if lines[n].endswith("\n") else lines[n] + "\n"
                    parts[part].append(text)
                n += 1
            if n == len(lines) or part != REPLACE:
                raise MutantError(f"{where(start)}: a block needs {SEARCH}, {REPLACE} and {END} lines")
            if not "".join(parts[SEARCH]).strip():
                raise MutantError(f"{where(start)}: empty search text")
            blocks.append(Block(target, "".join(parts[SEARCH]), "".join(parts[REPLACE])))
        elif line.strip():
            raise MutantError(f"{where(n)}: expected Planted bug:, Tests:, File: or a {SEARCH} block")
        n += 1
    if why is None or tests is None or not blocks:
        raise MutantError(f"{path.name}: needs a Planted bug: line, a Tests: line and at least one block")
    return Mutant(path, why, tests, blocks)


def line_start_matches(text: str, search: str) -> list[int]:
    """Offsets where `search` occurs in `text` starting at a line start."""
    found, start = [], 0
    while (at := text.find(search, start)) >= 0:
        if at == 0 or text[at - 1] == "\n":
            found.append(at)
        start = at + 1
    return found


def planted(mutant: Mutant, read) -> dict[str, str]:
    """The mutated text of each target file; `read(path)` gives a file's current text."""
    texts: dict[str, str] = {}
    for block in mutant.blocks:
        if block.path not in texts:
            try:
                texts[block.path] = read(block.path)
            except FileNotFoundError:
                raise MutantError(f"{mutant.file.name}: {block.path} does not exist: update the mutant") from None
        text = texts[block.path]
        found = line_start_matches(text, block.search)
        if len(found) != 1:
            raise MutantError(f"search text of {mutant.file.name} found {len(found)} times in {block.path}: "
                              "update the mutant")
        at = found[0]
        texts[block.path] = text[:at] + block.replace + text[at + len(block.search):]
    return texts


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


# Third-party packages whose modules (those engine_lib imports) the runner imports once, before it forks
# each test run from its own process: their import is most of a small test's time (tiny pipelines load in
# seconds, diffusers and transformers take longer to import). engine_lib itself is never imported here.
WARM_PACKAGES = ("torch", "numpy", "PIL", "safetensors", "transformers", "diffusers", "peft")


def warm_imports() -> None:
    """Import the WARM_PACKAGES modules that engine_lib's files name (what `import`s they hold, also inside functions)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as tests/conftest.py sets it before torch is imported
    wanted: set[tuple[str, str]] = set()
    for path in sorted((ROOT / "engine_lib").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted.update((alias.name, "") for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                wanted.update((node.module, alias.name) for alias in node.names)
    for module, name in sorted(wanted):
        if module.split(".")[0] in WARM_PACKAGES:
            try:
                getattr(importlib.import_module(module), name) if name else importlib.import_module(module)
            except Exception:  # a name this version lacks: the tests will say so themselves
                pass


def pytest_in_child(tree: Path, args: list[str], output: Path) -> int:
    """pytest.main(args) in a child forked from this process, with `tree` first on the import path; its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        atexit._clear()  # this process's own exit handlers (its temporary directory's removal) are not the child's
        try:
            fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(tree)
            os.environ.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")  # for the processes tests start
            sys.path.insert(0, str(tree))
            sys.dont_write_bytecode = True
            import pytest

            code = int(pytest.main(args))
            atexit._run_exitfuncs()  # those the tests registered, as a fresh interpreter would run them
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def run_tests(tree: Path, tests: list[str], show: bool = False, fork: bool = True) -> bool:
    """Whether the tests pass in `tree`. A test that pytest cannot find is an error, not a failure.

    With `fork`, pytest runs in a child of this process (after warm_imports), else in a fresh interpreter."""
    args = ["-x", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line", *tests]
    if fork:
        output = tree.parent / f"{tree.name}.out"
        returncode = pytest_in_child(tree, args, output)
        text = output.read_text(errors="replace")
    else:
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
        result = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=tree, env=env,
                                capture_output=True, text=True)
        returncode, text = result.returncode, result.stdout + result.stderr
    if returncode in (3, 4, 5):  # internal error, usage error (a test not found), no tests collected
        lines = text.strip().splitlines()
        raise MutantError(f"pytest could not run {' '.join(tests)} (exit {returncode}): " + " / ".join(lines[-3:]))
    if show and returncode != 0:
        failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
        print("    " + "\n    ".join(failed[-3:]), flush=True)
    return returncode == 0


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def recent_base() -> str | None:
    """$MUTANTS_BASE, else the newest commit at least RECENT_HOURS older than HEAD's commit date."""
    if os.environ.get("MUTANTS_BASE"):
        return os.environ["MUTANTS_BASE"]
    head_time = int(git("log", "-1", "--format=%ct", "HEAD"))
    return git("rev-list", "-1", f"--before={head_time - RECENT_HOURS * 3600}", "HEAD") or None


def changed_files(base: str) -> set[str]:
    """Files that differ between commit `base` and the working tree (committed or not)."""
    return set(git("diff", "--name-only", base).splitlines())


def is_core_file(path: str) -> bool:
    return any(path == f or (f.endswith("/") and path.startswith(f)) for f in CORE_FILES)


def select(mutants: list[Mutant], args: argparse.Namespace) -> list[Mutant]:
    """The selected mutants (each with its reasons), in run order: core, changed target, the rest."""
    every = not (args.fragments or args.core or args.changed_since or args.changed_recently)
    base = args.changed_since
    if args.changed_recently:
        base = recent_base()
        if base is None:
            print(f"no commit {RECENT_HOURS} h older than HEAD: every mutant")
            every = True
    changed: set[str] = set()
    if base is not None:
        changed = changed_files(base)
        print(f"changed since {git('rev-parse', '--short', base)} ({git('log', '-1', '--format=%ci', base)}): "
              f"{len(changed)} files", flush=True)
    core_names = set(CORE)
    unknown = core_names - {m.name for m in mutants}
    if unknown:
        raise MutantError(f"the core set names missing mutants: {', '.join(sorted(unknown))}")
    for m in mutants:
        if every:
            m.reasons.append("all")
        if any(f in m.file.name for f in args.fragments):
            m.reasons.append("named")
        if args.core and m.name in core_names:
            m.core = True
            m.reasons.append("core")
        if changed:
            m.changed_targets = [t for t in m.targets if t in changed]
            if m.changed_targets:
                m.reasons.append("changed " + " ".join(m.changed_targets))
            if str(m.file.relative_to(ROOT)) in changed:
                m.reasons.append("mutant changed")
            tests = [t for t in m.test_files if t in changed]
            if tests:
                m.reasons.append("changed " + " ".join(tests))
    chosen = [m for m in mutants if m.reasons]
    return sorted(chosen, key=lambda m: (m.rank, m.name))


def defined(node: str) -> bool:
    """Whether the test a node id names (`path::[Class::]test[params]`) is defined in its file or, for a test class
    that inherits its tests, in tests/helpers: a renamed test leaves the mutant naming nothing pytest can run."""
    path, _, name = node.partition("::")
    if not name:
        return True
    pattern = re.compile(rf"^\s*(async\s+)?def {re.escape(name.split('[')[0].split('::')[-1])}\(", re.M)
    sources = [ROOT / path, *sorted((ROOT / "tests" / "helpers").glob("*.py"))]
    return any(pattern.search(source.read_text()) for source in sources)


def check(mutants: list[Mutant], quiet: bool = False) -> int:
    """Plant each mutant into the repository's text in memory; report those that do not apply (1 if any)."""
    bad = 0
    for m in mutants:
        try:
            planted(m, lambda path: (ROOT / path).read_text())
            missing = [t for t in m.test_files if not (ROOT / t).exists()] or [t for t in m.tests if not defined(t)]
            if missing:
                raise MutantError(f"{m.file.name}: its tests {' '.join(missing)} do not exist: update the mutant")
        except MutantError as error:
            print(error)
            bad += 1
    if bad or not quiet:
        print(f"{len(mutants) - bad} of {len(mutants)} mutants apply" + ("" if not bad else ": update the others"))
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fragments", nargs="*", help="mutants whose file name contains one of these")
    parser.add_argument("--core", action="store_true")
    parser.add_argument("--changed-since", metavar="REV")
    parser.add_argument("--changed-recently", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--budget", type=float, metavar="SECONDS")
    parser.add_argument("--show", action="store_true")
    parser.add_argument("--no-fork", action="store_true")
    args = parser.parse_args(argv)
    try:
        mutants = [read_mutant(p) for p in sorted(MUTANTS.glob("*.mutant"))]
        chosen = select(mutants, args)
    except MutantError as error:
        print(error)
        return 1
    if args.check:
        return check(chosen)
    if args.list:
        for m in chosen:
            print(f"{m.name}: {', '.join(m.reasons)}")
        print(f"{len(chosen)} of {len(mutants)} mutants selected")
        return 0
    try:
        return run(chosen, args)
    except MutantError as error:
        print(error)
        return 1


def run(chosen: list[Mutant], args: argparse.Namespace) -> int:
    start = time.monotonic()
    print(f"{len(chosen)} mutants selected", flush=True)
    if check(chosen, quiet=True):  # every one must apply before any test runs
        return 1
    if not args.no_fork:
        warm_imports()
        print(f"imported {', '.join(WARM_PACKAGES)} for the test runs ({time.monotonic() - start:.0f} s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        if not args.no_baseline:
            clean = Path(tmp) / "clean"
            copy_tree(clean)
            every_test = sorted({t for m in chosen for t in m.tests})
            began = time.monotonic()
            if not run_tests(clean, every_test, show=True, fork=not args.no_fork):
                print(f"the tests fail without any planted bug: {' '.join(every_test)}")
                return 1
            print(f"baseline: the selected mutants' tests pass without them ({time.monotonic() - began:.0f} s)",
                  flush=True)
            shutil.rmtree(clean, ignore_errors=True)
        survivors, left_out = [], []
        first = time.monotonic()
        for m in chosen:
            if args.budget is not None and m.rank > 0 and time.monotonic() - first > args.budget:
                left_out.append(m.name)
                continue
            tree = Path(tmp) / m.name
            copy_tree(tree)
            began = time.monotonic()
            try:
                for path, text in planted(m, lambda path: (tree / path).read_text()).items():
                    (tree / path).write_text(text)
                caught = not run_tests(tree, m.tests, args.show, fork=not args.no_fork)
            except MutantError as error:
                print(f"{m.name}: {error}")
                return 1
            print(f"{'caught  ' if caught else 'SURVIVED'} {m.name} ({time.monotonic() - began:.0f} s): {m.why}",
                  flush=True)
            if not caught:
                survivors.append(m.name)
            shutil.rmtree(tree, ignore_errors=True)
    ran = len(chosen) - len(left_out)
    if left_out:
        print(f"left out past the {args.budget:.0f} s budget ({len(left_out)}): {' '.join(left_out)}")
    print(f"{ran - len(survivors)} of {ran} planted bugs caught in {time.monotonic() - start:.0f} s"
          + (f"; SURVIVED: {' '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
