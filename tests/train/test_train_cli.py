"""train.py's command line: a misspelled config field, a bad value, a missing config file, an unknown flag, a file as
the corpus, a vocab_size below the data's, a read-only workdir and a diverged loss are each one line naming the fix
(exit 2), and --show_config lists every field with its value and doc."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from qjax.train import config as config_lib

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
    config = config_lib.load_config(str(ROOT / "configs/llama_int8.py"))
    assert sorted(rows) == sorted(config_lib.flatten(config))
    assert rows["recipe"][0] == "'int8_rowwise'" and rows["recipe"][1].startswith("how GEMMs are quantized")
    assert rows["steps"][0] == "300" and rows["steps"][1].startswith("optimizer steps")
    assert rows["optimizer.warmup_steps"] == ("None", "None: min(30, steps // 10)")


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_field_has_a_doc(name):
    path = ROOT / "configs" / name
    docs = config_lib.field_docs(path)
    undocumented = sorted(set(config_lib.flatten(config_lib.load_config(str(path)))) - set(docs))
    assert not undocumented, f"configs/{name}: give these fields a trailing comment: {undocumented}"


def _one_error_line(result) -> str:
    """The stderr of a run that must stop with one error line and exit 2 (no traceback, no warnings)."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("args, fix", [
    (["--config", "configs/llama_int8.py", "--config.steps=abc"],
     "error: --config.steps=abc: invalid literal for int() with base 10: 'abc'; config.steps takes an int, e.g. "
     "--config.steps=300"),
    (["--config", "configs/llama_int9.py"],
     "error: config file configs/llama_int9.py does not exist: did you mean configs/llama_int8.py?"),
    (["--config", "configs/llama_int8.py", "--stpes=10"],
     "error: unknown flag --stpes; did you mean --config.steps=10? (python train.py --help lists the flags, "
     "--show_config the config fields)"),
    (["--config", "configs/vit_int8.py", "--workdr=runs/x"], "did you mean --workdir=runs/x?"),
    ([], "error: --config is required, e.g. python train.py --config configs/llama_int8.py"),
])
def test_command_line_mistakes_are_one_line_naming_the_fix(args, fix, tmp_path):
    line = _one_error_line(_train_py(*args, f"--workdir={tmp_path / 'run'}"))
    assert line == fix or (not fix.startswith("error:") and fix in line), line
    assert not (tmp_path / "run").exists()


def _tiny(token_dir, *args):
    return ["--config", "configs/llama_int8.py", f"--config.data.path={token_dir}", "--config.batch_size=4",
            "--config.seq_len=32", "--config.model.n_layers=1", "--config.model.dim=32", "--config.model.n_heads=2",
            "--config.model.n_kv_heads=1", "--config.model.ffn_dim=64", *args]


def test_data_path_that_is_a_file_says_so_and_how_to_make_a_corpus(tmp_path):
    line = _one_error_line(_train_py("--config", "configs/llama_int8.py", "--config.data.path=README.md",
                                     f"--workdir={tmp_path / 'run'}"))
    assert line == ("error: config.data.path 'README.md' is a file, not a token directory (train.bin, val.bin, "
                    "meta.json): make one from it with `python -m qjax.data.prepare text --out data/README README.md` "
                    "and pass --config.data.path=data/README")


def test_vocab_size_below_the_data_is_refused_naming_the_source(token_dir, tmp_path):
    line = _one_error_line(_train_py(*_tiny(token_dir, "--config.model.vocab_size=100",
                                            f"--workdir={tmp_path / 'run'}")))
    assert ("config.model.vocab_size=100 is smaller than the 256 tokens of the data's tokenizer, which decides the "
            "vocabulary: unset config.model.vocab_size") in line
    assert not (tmp_path / "run").exists()


def test_read_only_workdir_is_one_line(token_dir, tmp_path):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    # root writes through a 555 directory; /sys refuses everyone a new directory
    workdir = readonly / "run" if os.geteuid() != 0 else pathlib.Path("/sys/qjax_test_run")
    line = _one_error_line(_train_py(*_tiny(token_dir, f"--workdir={workdir}")))
    assert line.startswith(f"error: cannot write to the workdir {workdir} (") and line.endswith(
        "): pass --workdir=<a directory you can write>"), line


def test_divergence_is_one_line_and_keeps_the_last_good_checkpoint(token_dir, tmp_path):
    workdir = tmp_path / "run"
    result = _train_py(*_tiny(token_dir, "--config.optimizer.lr=1e9", "--config.steps=60", "--config.log_every=1",
                              "--config.checkpoint_every=1", "--config.eval_every=0", f"--workdir={workdir}"))
    line = _one_error_line(result)  # no traceback, no TensorBoard "NaN or Inf found" warnings
    match = re.fullmatch(r"error: (?:loss|grad_norm|params) (?:is nan|is inf|are not finite) (?:at|after) step (\d+): "
                         r"training diverged\. .* The newest checkpoint, step (\d+), is kept in (.*)\.", line)
    assert match, line
    bad, kept = int(match.group(1)), int(match.group(2))
    assert kept == bad - 1 and match.group(3) == str(workdir / "checkpoints")
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == kept
