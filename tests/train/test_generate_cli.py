"""`python -m qjax.generate`: text from the newest checkpoint of a tiny train.py run, and its errors."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from train_helpers import tiny_llama_config

from qjax import generate as generate_cli
from qjax import models
from qjax.data import ByteTokenizer
from qjax.train import train

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(token_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run") / "llama"
    train(tiny_llama_config(token_dir, steps=4), str(workdir), stream=open("/dev/null", "w"))
    return str(workdir)


def test_generates_from_the_newest_checkpoint(run_dir, capsys):
    assert generate_cli.main(["--workdir", run_dir, "--prompt", "the cat", "--max_new_tokens", "12",
                              "--eos_token", "-1"]) == 0
    out, err = capsys.readouterr()
    assert f"{run_dir} step 4" in err
    config, params, step, _ = generate_cli.restore_workdir(run_dir)
    prompt = ByteTokenizer().encode("the cat").astype(np.int32)[None]
    expected = np.asarray(models.generate(config, params, prompt, 12))[0]
    assert step == 4 and out == "the cat" + ByteTokenizer().decode(expected, errors="replace") + "\n"


def test_sampling_several_continuations(run_dir, capsys):
    assert generate_cli.main(["--workdir", run_dir, "--prompt", "a dog", "--max_new_tokens", "8",
                              "--temperature", "1.0", "--top_k", "5", "--num_samples", "2", "--int8_weights"]) == 0
    samples = capsys.readouterr().out.split("-" * 40 + "\n")
    assert len(samples) == 3 and all(s.startswith("a dog") for s in samples[:2])


def test_errors_are_one_line(tmp_path, capsys):
    assert generate_cli.main(["--workdir", str(tmp_path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path} has no config.json: is it a train.py workdir?"


def test_max_new_tokens_fits_the_context_by_default_and_is_cut_with_a_note(run_dir, capsys):
    """The tiny run's context is 32 tokens (seq_len); "the cat" takes 7."""
    assert generate_cli.main(["--workdir", run_dir, "--prompt", "the cat", "--eos_token", "-1"]) == 0
    out, err = capsys.readouterr()
    assert len(out) == len("the cat") + 25 + 1 and "note" not in err  # bytes: one character per token
    assert generate_cli.main(["--workdir", run_dir, "--prompt", "the cat", "--max_new_tokens", "200",
                              "--eos_token", "-1"]) == 0
    again, err = capsys.readouterr()
    assert again == out and err.splitlines()[0] == ("note: --max_new_tokens 200 cut to 25: the model's context is 32 "
                                                    "tokens (max_seq_len) and the prompt takes 7")
    assert generate_cli.main(["--workdir", run_dir, "--prompt", "x" * 32]) == 2
    assert "shorten --prompt" in capsys.readouterr().err


def test_workdir_without_a_checkpoint_is_one_line(run_dir, tmp_path):
    """In a process of its own: orbax threads left running would print at interpreter shutdown."""
    (tmp_path / "config.json").write_text((pathlib.Path(run_dir) / "config.json").read_text())
    result = subprocess.run([sys.executable, "-m", "qjax.generate", "--workdir", str(tmp_path), "--prompt", "x"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"error: {tmp_path} holds no checkpoint yet: train it first (python train.py --config ... --workdir "
        f"{tmp_path}); a run saves at every config.checkpoint_every steps and at its end"], result.stderr[-3000:]


def test_hf_dir_with_its_tokenizer(tmp_path, capsys):
    """--hf_dir alone: weights and tokenizer.json of a Hugging Face directory (needs `tokenizers`; the GPU image has
    it, CI may not)."""
    pytest.importorskip("tokenizers")
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from qjax.data.text import train_bpe  # noqa: PLC0415

    (tmp_path / "text.txt").write_text("the cat sat on the mat. " * 200)
    tokenizer = train_bpe([tmp_path / "text.txt"], 300, tmp_path / "tokenizer.json")
    config = models.llama_config("tiny", n_layers=1, vocab_size=tokenizer.vocab_size)
    params = jax.jit(models.Llama(config).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    models.save_hf_llama(config, params, str(tmp_path))
    assert generate_cli.main(["--hf_dir", str(tmp_path), "--prompt", "the cat", "--max_new_tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
