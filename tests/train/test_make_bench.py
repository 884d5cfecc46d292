"""`make bench` leaves `git status` as it found it: the table goes to stdout and to results/linear.md, which git
ignores (not to the tracked benchmarks/RESULTS.md)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.skipif(not (shutil.which("make") and shutil.which("git") and (ROOT / ".git").exists()),
                    reason="needs make and a git checkout")
def test_make_bench_leaves_the_tree_clean():
    results = ROOT / "results" / "linear.md"
    before_text = results.read_text() if results.exists() else None
    before = _git_status()
    # -o: take the venv as made (this interpreter is the one to use); one small shape, one recipe, no torch peer
    result = subprocess.run(["make", "-o", ".venv/.installed", "bench", f"PY={sys.executable}",
                             "BENCH_ARGS=--shapes 64x64 --recipes bf16 --reps 1 --warmup 0 --no-peer"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env={"JAX_PLATFORMS": "cpu",
                                                                                        "PATH": "/usr/bin:/bin"})
    try:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert "| bf16 |" in result.stdout and f"appended to {pathlib.Path('results/linear.md')}" in result.stdout
        assert "| bf16 |" in results.read_text().removeprefix(before_text or "")
        assert _git_status() == before
    finally:  # leave results/ as it was
        if before_text is None:
            results.unlink(missing_ok=True)
            if results.parent.exists() and not any(results.parent.iterdir()):
                results.parent.rmdir()
        else:
            results.write_text(before_text)
