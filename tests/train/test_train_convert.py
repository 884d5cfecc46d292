"""train() with your own model (`config.model.convert`): a plain Flax Llama converted by `qjax.quantize_model` trains
with int8 GEMMs, resumes bit-identically from a checkpoint, and splits over FSDP like qjax's own Llama.

The model is tests/test_convert_llama.py's `PlainLlama` (nn.Dense layers, no qjax layer; importable as
`test_convert_llama` through pytest's pythonpath).
"""

import io
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import tiny_llama_config

import qjax
from qjax.train import ConfigError, make_task, train

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLAIN = "test_convert_llama:PlainLlama"
PROJECTIONS = {"layers_0/attn/qkv_proj", "layers_0/attn/o_proj", "layers_0/mlp/gate_up_proj",
               "layers_0/mlp/down_proj"}


def _config(token_dir, **top):
    config = tiny_llama_config(token_dir, recipe="int8_rowwise", eval_every=0, **top)
    config.model.convert = PLAIN
    return config


def _losses(workdir):
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def test_converted_model_trains_in_int8_and_resumes_bit_identically(token_dir, tmp_path):
    config = _config(token_dir, steps=6, checkpoint_every=2)
    task = make_task(config, vocab_size=256)
    assert type(task.model).__name__ == "QuantizedPlainLlama"
    # The model the run trains: every projection's GEMMs in int8 (read from the traced step), the head in bf16.
    tokens = jnp.zeros((2, config.seq_len), jnp.int32)
    params = jax.eval_shape(task.init, jax.random.key(0))
    rows = qjax.report(task.model, {"params": params}, tokens, return_hidden=True, rngs={"quant": jax.random.key(0)})
    assert {row.path for row in rows if row.quantized} == PROJECTIONS, rows

    whole = train(config, tmp_path / "whole", stream=io.StringIO())
    losses = _losses(tmp_path / "whole")
    assert sorted(losses) == [2, 4, 6] and losses[6] < losses[2], losses

    pieces = tmp_path / "pieces"
    train(config, pieces, stop_at=3, stream=io.StringIO())
    out = io.StringIO()
    resumed = train(config, pieces, stream=out)  # a restart: the task converts the model again from the config
    assert "resumed at step 3" in out.getvalue()
    assert int(resumed.state.step) == config.steps
    for a, b in zip(_bits(resumed.state), _bits(whole.state), strict=True):  # params, optimizer state, step, key
        np.testing.assert_array_equal(a, b)
    assert _losses(pieces)[6] == losses[6]  # the mean of steps 5 and 6 (step 4's row covers other steps)


def test_bad_convert_configs_say_the_fix(token_dir):
    cases = {"no_colon_here": "package.module:factory",
             "no_such_module_xyz:Model": "cannot import 'no_such_module_xyz'",
             "test_convert_llama:NoSuchModel": "has no 'NoSuchModel'",
             "builtins:str": "returned str, not a flax.linen Module"}
    for path, message in cases.items():
        config = _config(token_dir)
        config.model.convert = path
        with pytest.raises(ConfigError, match=message):
            make_task(config, vocab_size=256)
    with pytest.raises(ConfigError, match="health_every=0"):
        make_task(_config(token_dir, health_every=2), vocab_size=256)
    config = _config(token_dir)
    config.model.param_dtype = "int8"
    with pytest.raises(ConfigError, match="needs float params"):
        make_task(config, vocab_size=256)


_FSDP = textwrap.dedent("""
    import jax, numpy as np
    from configs import llama_base
    from qjax.train import make_mesh, make_task, make_train_step
    assert len(jax.devices()) == 2, jax.devices()

    def config(convert):
        c = llama_base.get_config()
        c.model.update(size="tiny", n_layers=1, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                       compute_dtype="float32", convert=convert)
        c.batch_size, c.seq_len, c.steps, c.recipe = 8, 16, 3, "int8_rowwise"
        c.optimizer.warmup_steps = 1
        return c

    rng = np.random.RandomState(0)
    batches = [{"inputs": rng.randint(0, 256, (8, 16)).astype(np.int32),
                "targets": rng.randint(0, 256, (8, 16)).astype(np.int32)} for _ in range(3)]

    def run(mesh, convert="test_convert_llama:PlainLlama"):
        task = make_task(config(convert))
        init_state, train_step = make_train_step(config(convert), task, mesh)
        state, losses = init_state(), []
        for batch in batches:
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
        return state, losses

    one, one_losses = run(make_mesh(jax.devices()[:1]))
    fsdp, fsdp_losses = run(make_mesh(data=1, fsdp=2))
    # the FSDP rules split the plain model's params by their paths, as qjax's Llama's
    assert tuple(fsdp.params["layers_0"]["attn"]["qkv_proj"]["kernel"].sharding.spec) == ("fsdp", None)
    assert tuple(fsdp.params["layers_0"]["mlp"]["down_proj"]["kernel"].sharding.spec) == (None, "fsdp")
    assert tuple(fsdp.params["embed"]["embedding"].sharding.spec) == ("fsdp", None)
    # test_fsdp.py's tolerance for 8-bit recipes (a code may round the other way after a float32 ulp)
    np.testing.assert_allclose(fsdp_losses, one_losses, rtol=1e-3)
    # qjax's explicit Llama on the same mesh (same init: PlainLlama initializes as it does) trains to the same
    # losses, bit for bit: the converted model is that model
    explicit_losses = run(make_mesh(data=1, fsdp=2), convert=None)[1]
    assert fsdp_losses == explicit_losses, (fsdp_losses, explicit_losses)
    print("losses", one_losses, fsdp_losses)
""")


def test_converted_model_under_fsdp_on_two_cpu_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", _FSDP], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
