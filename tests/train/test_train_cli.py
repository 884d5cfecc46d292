"""train.py's command line: a misspelled config field is one line naming the closest field (exit 2), and
--show_config lists every field with its value and doc."""

import pathlib
import subprocess
import sys

import pytest

from qjax.train import fields

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The config files train.py takes (those with a get_config; common.py only adds shared fields to them).
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py") if "def get_config" in p.read_text())


def _train_py(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=cwd,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=120)


@pytest.mark.parametrize("override, suggestion", [("--config.step=30", "steps"),
                                                  ("--config.optimzer.name=adamw_8bit", "optimizer.name")])
def test_misspelled_field_is_one_line_naming_the_closest_field(override, suggestion, tmp_path):
    result = _train_py("--config", "configs/llama_int8.py", override, f"--workdir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    field = override[len("--config."):].split("=")[0]
    assert result.stderr.splitlines() == [
        f"error: unknown config field '{field}'; did you mean '{suggestion}'? (python train.py --config "
        "configs/llama_int8.py --show_config lists the fields)"]
    assert not (tmp_path / "run").exists()


def test_show_config_lists_every_field_with_value_and_doc():
    result = _train_py("--config=configs/llama_int8.py", "--show_config")
    assert result.returncode == 0, result.stderr
    rows = {}  # name: (value, doc)
    for line in result.stdout.splitlines():
        name, rest = line.split(" = ", 1)
        value, doc = rest.split("  # ", 1)
        rows[name] = (value.strip(), doc)
    config = fields.load_config(str(ROOT / "configs/llama_int8.py"))
    assert sorted(rows) == sorted(fields.flatten(config))
    assert rows["recipe"][0] == "'int8_rowwise'" and rows["recipe"][1].startswith("how GEMMs are quantized")
    assert rows["steps"][0] == "300" and rows["steps"][1].startswith("optimizer steps")
    assert rows["optimizer.warmup_steps"] == ("None", "None: min(30, steps // 10)")


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_field_has_a_doc(name):
    path = ROOT / "configs" / name
    docs = fields.field_docs(path)
    undocumented = sorted(set(fields.flatten(fields.load_config(str(path)))) - set(docs))
    assert not undocumented, f"configs/{name}: give these fields a trailing comment: {undocumented}"
