"""`python -m qjax.generate`: text from the newest checkpoint of a tiny train.py run, and its errors."""

import numpy as np
import pytest
from train_helpers import tiny_llama_config

from qjax import generate as generate_cli
from qjax import models
from qjax.data import ByteTokenizer
from qjax.train import train


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
