"""Helpers shared by the tests (importable as `helpers`: pyproject adds tests/ to the path)."""

import flax.linen as nn
import jax
import numpy as np
import optax

import qjax


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
    """Runs `fn(*args)` -> ({layer name: recipe name} for every qjax.DotGeneral the model really called, output)."""
    used = {}

    def record(next_fun, call_args, kwargs, context):
        if isinstance(context.module, qjax.DotGeneral) and context.method_name == "__call__":
            path = context.module.path
            name = "/".join(path[:-1] if path[-1].startswith("DotGeneral") else path)
            used[name] = context.module.recipe.name
        return next_fun(*call_args, **kwargs)

    with nn.intercept_methods(record):
        out = fn(*args)
    return used, out
