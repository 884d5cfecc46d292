"""Helpers shared by the tests (importable as `helpers`: pyproject adds tests/ to the path)."""

import json
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import safetensors.numpy

import qjax
from qjax.data import text
from qjax.models.layers import PrologueDense

# Jetfire's int8 data flow: int8_dataflow with its gradients rounded stochastically (no named recipe rounds so).
INT8_DATAFLOW_SR = qjax.with_stochastic_gradients(qjax.recipe("int8_dataflow"))


def mosaic_gpu_kernel_texts(lowered) -> list[str]:
    """The MLIR text of every Mosaic GPU kernel in a computation lowered for "cuda" (on any host): each kernel's
    module travels as bytecode in its custom call's backend config."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax.experimental.mosaic.gpu import dialect as mgpu_dialect
    from jaxlib.mlir import ir

    modules = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.name == "stablehlo.custom_call" and "mhlo.backend_config" in inner.attributes:
                        config = inner.attributes["mhlo.backend_config"]
                        if "module" in config:
                            modules.append(config["module"].value_bytes)
                    walk(inner)

    for op in lowered.compiler_ir("stablehlo").body.operations:
        walk(op)
    context = jax_mlir.make_ir_context()
    mgpu_dialect.register_dialect(context)
    context.allow_unregistered_dialects = True
    with context:
        return [str(ir.Module.parse(module)) for module in modules]


def cpu_devices_env(devices: int) -> dict[str, str]:
    """This process's environment for a subprocess on `devices` CPU devices: the XLA flags set here (tests/conftest.py's
    -O0) kept, the device count added."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")


def run_on_cpu_devices(script: str, devices: int) -> str:
    """Runs a Python script in a subprocess with `devices` CPU devices (XLA_FLAGS must be set before jax starts),
    this checkout on the path; asserts it exits 0 and returns its stdout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(cpu_devices_env(devices), PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    return out.stdout


def snr_db(reference, output) -> float:
    """Signal-to-noise ratio 20 log10(|ref| / |ref - out|) in float64; inf when equal."""
    reference = np.asarray(reference, np.float64)
    error = np.linalg.norm(reference - np.asarray(output, np.float64))
    return float("inf") if error == 0 else float(20 * np.log10(np.linalg.norm(reference) / error))


def adamw_losses(value_and_grad, params, steps, learning_rate):
    """Losses over `steps` optax AdamW steps; value_and_grad(params, key) -> (loss, grads) is the test's compiled
    function, called with key(i) at step i."""
    tx = optax.adamw(learning_rate)
    update = jax.jit(lambda grads, state, params: tx.update(grads, state, params))
    opt_state, losses = jax.jit(tx.init)(params), []
    for i in range(steps):
        loss, grads = value_and_grad(params, jax.random.key(i))
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses


def flat(tree) -> np.ndarray:
    """All leaves of a pytree as one float64 vector."""
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def used_recipes(fn, *args):
    """Runs `fn(*args)` -> ({layer name: recipe name} for every qjax.DotGeneral or fused PrologueDense the model
    really called, output)."""
    used = {}

    def record(next_fun, call_args, kwargs, context):
        if isinstance(context.module, (qjax.DotGeneral, PrologueDense)) and context.method_name == "__call__":
            path = context.module.path
            name = "/".join(path[:-1] if path[-1].startswith("DotGeneral") else path)
            used[name] = context.module.recipe.name
        return next_fun(*call_args, **kwargs)

    with nn.intercept_methods(record):
        out = fn(*args)
    return used, out


# A tiny deterministic corpus, for tests that need token data without a download.
_WORDS = ("the king queen lord lady love night day sword crown speak hear heart blood fair foul sweet death life "
          "what why thou thee thy art hath doth shall will not and but or to of in my your his her").split()


def write_tiny_corpus(directory, *, num_files: int = 2, words_per_file: int = 800, seed: int = 0,
                      val_fraction: float = 0.1) -> pathlib.Path:
    """Writes `num_files` small text files (a few KB each, one line per ~10 words, a non-ASCII character or two)
    under directory/texts and byte-level shards under directory/shards; returns the shard directory."""
    directory = pathlib.Path(directory)
    rng = np.random.default_rng(seed)
    (directory / "texts").mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(num_files):
        words = rng.choice(_WORDS, size=words_per_file)
        lines = [" ".join(words[j:j + 10]) for j in range(0, words_per_file, 10)]
        path = directory / "texts" / f"doc{i}.txt"
        path.write_text(f"Act {i} — “scene”\n" + "\n".join(lines) + "\n", encoding="utf-8")
        files.append(path)
    text.prepare_text(files, directory / "shards", val_fraction=val_fraction)
    return directory / "shards"


def save_hf_dir(path, hf: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Hugging Face model directory (config.json + model.safetensors) holding `tensors`; returns them."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return tensors
