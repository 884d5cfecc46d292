"""Config files load, command-line overrides reach the model, and bad configs fail early with the fix in the message."""

import io
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags
from train_helpers import tiny_llama_config, tiny_vit_config

import qjax
from qjax.models import LLAMA_SIZES
from qjax.train import ConfigError, check_config, make_task, train

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE_OF = {"llama_bf16": "bf16", "llama_int8": "int8_rowwise", "llama_fp8": "fp8_tensorwise",
             "llama_fp8_blockwise": "fp8_blockwise", "llama_bitnet": "bitnet_b158", "vit_bf16": "bf16",
             "vit_int8": "int8_rowwise"}


def _load(*args):
    """Parses `args` like train.py does and returns the config."""
    argv = ["train.py", *args]
    flag_values = flags.FlagValues()
    # sys_argv: config_flags finds the --config.* overrides there (by default in sys.argv, pytest's here).
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


@pytest.mark.parametrize("name", sorted(RECIPE_OF))
def test_config_files_load_and_pass_the_checks(name, token_dir):
    config = _load(f"--config={ROOT / 'configs' / name}.py")
    assert config.recipe == RECIPE_OF[name]
    assert config.task == ("lm" if name.startswith("llama") else "image")
    if config.task == "lm":
        assert (config.data.kind, config.data.path) == ("tokens", "data/shakespeare")
        config.data.path = token_dir  # CI has no prepared Shakespeare
    check_config(config)


def test_command_line_overrides_give_the_1b_model():
    config = _load(f"--config={ROOT / 'configs/llama_int8.py'}", "--config.model.size=1b", "--config.seq_len=2048",
                   "--config.steps=7", "--config.optimizer.name=adamw_8bit",
                   "--config.keep_high_precision=('lm_head', 'embed')")
    assert (config.steps, config.optimizer.name) == (7, "adamw_8bit")
    task = make_task(config)  # no data: the preset's vocabulary
    preset = LLAMA_SIZES["1b"]
    c = task.model_config
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size) == (
        preset.dim, preset.n_layers, preset.n_heads, preset.n_kv_heads, preset.ffn_dim, preset.vocab_size)
    assert (c.recipe, c.keep_high_precision, c.max_seq_len) == ("int8_rowwise", ("lm_head", "embed"), 2048)
    assert task.flops_per_unit > 6 * 1.0e9  # > 6 FLOPs x ~1.1B weights per token


def test_model_field_override_changes_only_that_field(token_dir):
    config = _load(f"--config={ROOT / 'configs/llama_bf16.py'}", "--config.model.n_layers=3")
    task = make_task(config, vocab_size=256)
    tiny = LLAMA_SIZES["tiny"]
    assert task.model_config.n_layers == 3 and task.model_config.dim == tiny.dim
    assert task.model_config.keep_high_precision == tiny.keep_high_precision  # None keeps the model default


@pytest.mark.parametrize("change, match", [
    (dict(recipe="int4"), "unknown recipe 'int4'"),
    (dict(optimizer_name="sgd"), "unknown optimizer 'sgd'.*adamw_8bit"),
    (dict(steps=0), r"config.steps must be an int >= 1"),
    (dict(batch_size=-8), r"config.batch_size must be an int >= 1"),
    (dict(warmup_steps=6), r"warmup_steps must be an int in \[0, steps=6\)"),
    (dict(model_size="7b"), "config.model.size '7b'.*valid sizes: tiny, 125m, 350m, 1b"),
    (dict(data_path="/nonexistent/shakespeare"),
     "python -m qjax.data.prepare shakespeare --out /nonexistent/shakespeare"),
    (dict(task="speech"), "config.task must be one of"),
    (dict(optimizer_stochastic_rounding=True), "set --config.model.param_dtype=bfloat16"),
    (dict(optimizer_lr=float("inf")), r"config.optimizer.lr must be a positive number, got inf"),
    (dict(optimizer_grad_clip=float("inf")), r"config.optimizer.grad_clip must be a finite number"),
    (dict(optimizer_weight_decay=float("nan")), r"config.optimizer.weight_decay must be a finite number >= 0"),
    (dict(recipe="fp8_blockwise", batch_size=4, grad_accum_steps=2, seq_len=96),
     r"batch_size / grad_accum_steps \* seq_len = 192, which must be a multiple of 128"),
])
def test_bad_config_fields_are_named(token_dir, change, match):
    config = tiny_llama_config(token_dir)
    for key, value in change.items():
        if key == "optimizer_name":
            config.optimizer.name = value
        elif key == "optimizer_stochastic_rounding":
            config.optimizer.stochastic_rounding = value
        elif key.startswith("optimizer_"):
            setattr(config.optimizer, key.removeprefix("optimizer_"), value)
        elif key == "warmup_steps":
            config.optimizer.warmup_steps = value
        elif key == "model_size":
            config.model.size = value
        elif key == "data_path":
            config.data.path = value
        else:
            setattr(config, key, value)
    with pytest.raises(ConfigError, match=match):
        check_config(config)


def test_vit_data_fields_are_set_from_the_command_line(tmp_path):
    """The locked ViT config carries every image kind's fields, so --config.data.* reaches npz and tfds data."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", train_images=rng.integers(0, 256, (24, 8, 8, 3), dtype=np.uint8),
             train_labels=rng.integers(0, 3, 24), test_images=rng.integers(0, 256, (8, 8, 8, 3), dtype=np.uint8),
             test_labels=rng.integers(0, 3, 8))
    vit = f"--config={ROOT / 'configs/vit_int8.py'}"
    config = _load(vit, "--config.data.kind=npz", f"--config.data.path={tmp_path / 'images.npz'}",
                   "--config.data.image_size=16")
    check_config(config)
    dataset = qjax.data.make_dataset(config.data, batch_size=4, seed=0)
    assert dataset.image_shape == (16, 16, 3) and dataset.num_classes == 3
    assert dataset.batch(0)["images"].shape == (4, 16, 16, 3)

    tfds_config = _load(vit, "--config.data.kind=tfds", "--config.data.name=cifar10")
    assert tfds_config.data.name == "cifar10"
    with pytest.raises(ConfigError, match=r"config.data.kind='tfds' needs config.data.data_dir"):
        check_config(tfds_config)
    with pytest.raises(ConfigError, match=r"config.data.path is not used by config.data.kind='digits'"):
        check_config(_load(vit, f"--config.data.path={tmp_path / 'images.npz'}"))


@pytest.mark.parametrize("change, match", [
    (dict(batch_size=10, grad_accum_steps=4), "batch_size=10 must be a positive multiple of grad_accum_steps"),
    (dict(model_dim=33), r"bad model config.*dim \(33\) must be a multiple of n_heads \(2\)"),
])
def test_bad_sizes_fail_before_training(token_dir, tmp_path, change, match):
    config = tiny_llama_config(token_dir)
    for key, value in change.items():
        if key == "model_dim":
            config.model.dim = value
        else:
            setattr(config, key, value)
    with pytest.raises(ConfigError, match=match):
        train(config, tmp_path)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_task_and_data_must_agree(tmp_path):
    config = tiny_vit_config()
    config.task = "lm"
    config.model.size = "tiny"
    config.seq_len = 16
    with pytest.raises(ConfigError, match="needs token data"):
        train(config, tmp_path)


def test_cli_prints_the_fix_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), f"--config={ROOT / 'configs/llama_int8.py'}",
         f"--workdir={tmp_path / 'run'}", f"--config.data.path={tmp_path / 'nowhere'}"],
        capture_output=True, text=True, cwd=ROOT, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"python -m qjax.data.prepare shakespeare --out {tmp_path / 'nowhere'}" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_runs_each_check_once(tmp_path, monkeypatch):
    """train() checks up front and its builders take the checked config: no check runs twice (resume included)."""
    import qjax.train as train_package  # noqa: PLC0415
    from qjax.train import config as config_lib, step as step_lib  # noqa: PLC0415

    checks = {name: getattr(config_lib, name) for name in (
        "check_config", "check_data_config", "check_mesh_config", "check_optimizer_config", "check_batch_size",
        "check_train_step", "check_resume")}
    checks["check_fits"] = step_lib.check_fits
    calls = dict.fromkeys(checks, 0)

    def counting(name, check):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return check(*args, **kwargs)
        return wrapper

    spies = {check: counting(name, check) for name, check in checks.items()}
    for module in [train_package, *(m for n, m in vars(train_package).items() if type(m) is type(config_lib))]:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in spies:  # every module's binding of a check, however it was imported
                monkeypatch.setattr(module, attr, spies[value])
    config = tiny_vit_config(steps=2, eval_every=0, checkpoint_every=0)
    train(config, tmp_path, stop_at=1, stream=io.StringIO())
    assert calls == {**dict.fromkeys(checks, 1), "check_train_step": 0, "check_resume": 0}, calls
    calls.update(dict.fromkeys(calls, 0))
    train(config, tmp_path, stream=io.StringIO())  # resumes at step 1
    assert calls == {**dict.fromkeys(checks, 1), "check_train_step": 0}, calls
