"""What a run says before it trains: which recipe each layer really runs (and a warning when a quantized recipe
quantizes nothing), the memory estimate (a run that cannot fit fails before compiling), the workdir, and "n/a" for
the MFU and memory a CPU cannot report."""

import io
import time

import jax
import pytest
from train_helpers import tiny_llama_config

from qjax import models
from qjax.train import ConfigError, make_mesh, make_task, make_train_step, train
from qjax.train import metrics
from qjax.train import step as step_lib


def test_header_lists_recipes_per_layer_and_warns_when_nothing_is_quantized(token_dir, tmp_path):
    # The tiny model's widths (32, 64) are not multiples of 128: fp8_blockwise keeps every layer in bf16.
    config = tiny_llama_config(token_dir, recipe="fp8_blockwise", steps=2, eval_every=0)
    out = io.StringIO()
    train(config, tmp_path / "run", stream=out)
    lines = out.getvalue().splitlines()
    assert "  recipes: qkv/o/gate_up/down: bf16 x 1 layer; lm_head: bf16" in lines
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "recipe 'fp8_blockwise' quantizes no layer" in warnings[0]
    assert "multiples of 128" in warnings[0] and "--config.model.size=125m" in warnings[0]
    assert f"  workdir: {tmp_path / 'run'}" in lines
    assert any(line.startswith("  memory: ~") and "per device estimated" in line for line in lines)
    progress = [line for line in lines if line.startswith("step 2/2")]
    assert progress and "MFU n/a" in progress[0] and "mem n/a" in progress[0]  # a CPU reports neither


def test_recipe_summary_counts_layers_per_recipe():
    config = models.llama_config("1b", recipe="fp8_blockwise")
    assert metrics.recipe_summary(config) == "qkv/o/gate_up/down: fp8_blockwise x 22 layers; lm_head: bf16"
    assert metrics.quantizes_nothing(config) is None
    mixed = models.llama_config("tiny", recipe="int8_rowwise", keep_high_precision=("layers_0/mlp",))
    assert metrics.recipe_summary(mixed) == ("qkv/o: int8_rowwise x 2 layers; gate_up/down: bf16 x 1 layer, "
                                            "int8_rowwise x 1 layer; lm_head: int8_rowwise")
    assert metrics.quantizes_nothing(models.llama_config("tiny", recipe="bf16")) is None
    everything_kept = models.llama_config("tiny", recipe="int8_rowwise", min_features=10_000)
    assert "config.min_features=10000" in metrics.quantizes_nothing(everything_kept)


def test_warns_when_bfloat16_params_round_to_nearest(token_dir, tmp_path):
    config = tiny_llama_config(token_dir, steps=2, eval_every=0)
    assert metrics.rounds_params_to_nearest(config) is None  # float32 params
    config.model.param_dtype = "bfloat16"
    out = io.StringIO()
    train(config, tmp_path / "run", stream=out)
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "--config.optimizer.stochastic_rounding=True" in warnings[0]
    config.optimizer.stochastic_rounding = True
    assert metrics.rounds_params_to_nearest(config) is None


def test_run_that_cannot_fit_fails_before_compiling(token_dir, tmp_path, monkeypatch):
    # The 1B model's params and Adam states alone (~13 GB) exceed a device of 4 GiB.
    monkeypatch.setattr(step_lib, "device_memory_bytes", lambda device, sharing=1: 4 * step_lib.GiB)
    config = tiny_llama_config(token_dir)
    config.model.size, config.model.n_layers, config.model.dim = "1b", None, None
    config.model.n_heads, config.model.n_kv_heads, config.model.ffn_dim = None, None, None
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^this run needs an estimated [\d.]+ GiB per device \(params \+ "
                                          r"optimizer [\d.]+ GiB, gradients [\d.]+ GiB, activations [\d.]+ MiB\), "
                                          r"more than the 4.0 GiB of a cpu device: use a smaller config.model.size, "
                                          r"a low-bit optimizer"):
        train(config, tmp_path / "run")
    assert time.perf_counter() - start < 60  # XLA took minutes to fail (and had to compile first)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_activations_beyond_the_host_name_batch_seq_len_and_remat():
    # The README's 1B command with 8x its batch, on this host's real memory: ~1.7 TiB of activations.
    config = tiny_llama_config("unused")
    config.model.size, config.model.n_layers, config.model.dim = "1b", None, None
    config.model.n_heads, config.model.n_kv_heads, config.model.ffn_dim = None, None, None
    config.seq_len, config.batch_size = 2048, 64
    task = make_task(config)  # no data needed: the preset's vocabulary
    init_state, _ = make_train_step(config, task)
    with pytest.raises(ConfigError, match=r"more than the [\d.]+ GiB of a cpu device: lower config.batch_size or "
                                          r"config.seq_len, raise config.grad_accum_steps, or set "
                                          r"--config.model.remat=True$"):
        step_lib.check_fits(config, task, jax.eval_shape(init_state), make_mesh())


def test_estimate_counts_state_exactly_and_activations_by_the_formula(token_dir):
    config = tiny_llama_config(token_dir)
    task = make_task(config, vocab_size=256)
    init_state, _ = make_train_step(config, task)
    estimate = step_lib.estimate(config, task, jax.eval_shape(init_state), make_mesh())
    n = models.num_params(jax.eval_shape(init_state).params)
    assert estimate.state >= 4 * n + 8 * n  # float32 params + two float32 Adam moments (+ scalars)
    assert estimate.gradients == 4 * n
    c = task.model_config
    per_layer = 2 * (6 * c.dim + 2 * c.n_kv_heads * c.head_dim + 3 * c.ffn_dim) + 8 * c.n_heads * config.seq_len
    tokens = config.batch_size * config.seq_len
    assert estimate.activations == tokens * (c.n_layers * per_layer + 10 * c.vocab_size)
    assert estimate.available > 0  # the host's memory on a CPU
