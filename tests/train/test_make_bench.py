"""`make bench` leaves `git status` as it found it: the table goes to stdout and, as JSON, to runs/benchmarks/,
which git ignores; `python -m benchmarks page` rebuilds the results page from the published JSON alone."""

import importlib
import json
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
    results = ROOT / "runs" / "benchmarks" / "linear.json"
    before_text = results.read_text() if results.exists() else None
    before = _git_status()
    # -o: take the venv as made (this interpreter is the one to use); one small shape, one recipe, no torch peer
    result = subprocess.run(["make", "-o", ".venv/.installed", "bench", f"PY={sys.executable}",
                             "BENCH_ARGS=--shapes 64x64 --recipes bf16 --reps 1 --warmup 0 --no-peer"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env={"JAX_PLATFORMS": "cpu",
                                                                                        "PATH": "/usr/bin:/bin"})
    try:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert "| bf16 |" in result.stdout and "recorded in" in result.stdout
        section = json.loads(results.read_text())["sections"][-1]
        assert section["title"] == "linear fwd+bwd" and section["platform"] == "cpu"
        assert [row[0] for row in section["tables"][0]["rows"]] == ["bf16"]
        assert _git_status() == before
    finally:  # leave runs/benchmarks as it was
        if before_text is None:
            results.unlink(missing_ok=True)
        else:
            results.write_text(before_text)


def test_results_page_is_generated_from_the_published_json(tmp_path):
    """The page of the tracked results equals what `page` writes from them: nobody edited it by hand."""
    page = ROOT / "benchmarks" / "README.md"
    committed = page.read_text()
    try:
        subprocess.run([sys.executable, "-m", "benchmarks", "page"], cwd=ROOT, check=True, capture_output=True)
        assert page.read_text() == committed
    finally:
        page.write_text(committed)
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):  # every published row says where and when
        for section in json.loads(path.read_text())["sections"]:
            assert all(section[k] for k in ("device", "date", "jax", "commit")), (path.name, section["title"])


def test_a_run_in_another_tree_is_labelled_apart_and_never_published(tmp_path, monkeypatch):
    runner = importlib.import_module("benchmarks.__main__")
    assert runner.result_label("e2e-ab") == "e2e-ab"
    label = runner.result_label("e2e-ab@.baseline")
    assert "@" not in label and label != "e2e-ab"  # the device tool drops names with '@'
    monkeypatch.setattr(runner, "PUBLISHED", tmp_path / "published")
    monkeypatch.setattr(runner, "PAGE", tmp_path / "README.md")
    monkeypatch.setattr(runner, "REPO", tmp_path)
    for name in ("e2e-ab", label):
        (tmp_path / f"{name}.json").write_text(json.dumps({"suite": name, "sections": []}))
    runner.publish(tmp_path)
    assert [p.name for p in (tmp_path / "published").iterdir()] == ["e2e-ab.json"]


def test_publishing_a_suite_keeps_its_sections_of_other_commands(tmp_path, monkeypatch):
    """A rerun replaces the section of the same title and command; a study recorded under another command stays."""
    runner = importlib.import_module("benchmarks.__main__")
    monkeypatch.setattr(runner, "PUBLISHED", tmp_path / "published")
    monkeypatch.setattr(runner, "PAGE", tmp_path / "README.md")
    monkeypatch.setattr(runner, "REPO", tmp_path)
    def section(title, command, value):
        return {"title": title, "command": command, "value": value, "device": "H200", "date": "2026-11-29",
                "jax": "0.11.2", "commit": "abc1234", "tables": [], "notes": ""}

    (tmp_path / "published").mkdir()
    (tmp_path / "published" / "convergence.json").write_text(json.dumps({"suite": "convergence", "sections": [
        section("convergence", "suite command", 1), section("mixed corpus, 250M tokens", "by hand", 2)]}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "convergence.json").write_text(json.dumps({"suite": "convergence", "sections": [
        section("convergence", "suite command", 3), section("convergence", "another command", 4)]}))
    runner.publish(run)
    published = json.loads((tmp_path / "published" / "convergence.json").read_text())
    assert [s["value"] for s in published["sections"]] == [3, 2, 4]
    (run / "kernels.json").write_text(json.dumps({"suite": "kernels", "sections": [section("k", "c", 5)]}))
    runner.publish(run)  # a suite published for the first time is written as it came
    assert json.loads((tmp_path / "published" / "kernels.json").read_text())["sections"] == [section("k", "c", 5)]
