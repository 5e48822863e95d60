"""Size limits that keep the code readable as it grows: benchmarks/ (its Python and shell files) within 2,600
lines, and no module of engine_lib/serving (its subpackages included) over 450 lines, and the engine core within 3,500."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MAX_LINES = 2600
SERVING_MODULE_MAX_LINES = 450


def lines(path: Path) -> int:
    """Lines as `wc -l` counts them."""
    return path.read_bytes().count(b"\n")


def sources(folder: str, *suffixes: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in suffixes and "__pycache__" not in p.parts)


def test_benchmarks_stay_within_their_line_budget():
    files = sources("benchmarks", ".py", ".sh")
    total = sum(map(lines, files))
    largest = sorted(files, key=lines, reverse=True)[:3]
    assert total <= BENCHMARKS_MAX_LINES, (
        f"benchmarks/ holds {total} lines of .py and .sh, over {BENCHMARKS_MAX_LINES}; the largest: "
        + ", ".join(f"{p.relative_to(ROOT)} ({lines(p)})" for p in largest))


def test_no_serving_module_is_over_its_line_budget():
    over = {str(p.relative_to(ROOT)): lines(p) for p in sources("engine_lib/serving", ".py")
            if lines(p) > SERVING_MODULE_MAX_LINES}
    assert over == {}, f"engine_lib/serving modules over {SERVING_MODULE_MAX_LINES} lines: {over}"


def test_the_count_is_wc_l_and_sees_every_file(tmp_path):
    """The checks above would pass on an empty or mis-counted tree: the counter and the file lists are checked."""
    (tmp_path / "a.py").write_text("one\ntwo\n")
    (tmp_path / "b.sh").write_text("no newline at the end")
    assert [lines(tmp_path / "a.py"), lines(tmp_path / "b.sh")] == [2, 0]
    assert len(sources("benchmarks", ".py", ".sh")) >= 15
    assert ROOT / "benchmarks" / "gpu.sh" in sources("benchmarks", ".sh")
    assert len(sources("engine_lib/serving", ".py")) >= 15
    assert ROOT / "engine_lib" / "serving" / "tritonserver.py" in sources("engine_lib/serving", ".py")


ENGINE_CORE_MAX_LINES = 3500


def test_the_engine_core_stays_within_its_line_budget():
    """The engine core (engine_lib's own modules and the scheduler; pipelines and serving are outside it)."""
    files = sorted((ROOT / "engine_lib").glob("*.py")) + sources("engine_lib/sched", ".py")
    total = sum(map(lines, files))
    assert len(files) >= 15 and ROOT / "engine_lib" / "engine.py" in files
    assert total <= ENGINE_CORE_MAX_LINES, f"the engine core holds {total} lines, over {ENGINE_CORE_MAX_LINES}"
