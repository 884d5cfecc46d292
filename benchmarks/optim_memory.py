"""Peak memory of one optimizer step on CPU: XLA's compiled memory analysis of a jitted step, params + state donated.

  python benchmarks/optim_memory.py              # Llama 125m's param tree (122M params), float32 and bf16 + SR
  python benchmarks/optim_memory.py --layers 2   # its first 2 layers only (what tests/optim/test_step_memory.py uses)

Per param: state bytes (the optimizer state's arrays) and temp bytes (`memory_analysis().temp_size_in_bytes`, the
buffers XLA allocates inside the step besides arguments and outputs). With params and state donated the outputs
alias the inputs, so state + temp is what the step adds to the params and grads at its peak.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qjax import models, optim  # noqa: E402

OPTIMIZERS = {
    "optax.adamw": lambda: optax.adamw(1e-3, weight_decay=0.01),
    "adamw_8bit": lambda: optim.adamw_8bit(1e-3, weight_decay=0.01),
    "adamw_4bit": lambda: optim.adamw_4bit(1e-3, weight_decay=0.01),
    "adamw_fp8": lambda: optim.adamw_fp8(1e-3, weight_decay=0.01),
    "adamw_fp8_dre": lambda: optim.adamw_fp8(1e-3, weight_decay=0.01, dynamic_range_expansion=True),
}


def llama_param_shapes(size: str = "125m", layers: int | None = None, dtype=jnp.float32):
    """The Llama preset's param tree as ShapeDtypeStructs of `dtype` (jax.eval_shape: nothing is allocated);
    `layers` keeps that many transformer blocks."""
    overrides = {} if layers is None else {"n_layers": layers}
    model = models.Llama(models.llama_config(size, **overrides))
    tokens = jnp.zeros((1, 8), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)


def step_memory(tx, params, stochastic_rounding: bool = False) -> dict:
    """Bytes per param of one jitted step of `tx` on `params` (ShapeDtypeStructs): {"state", "temp", "total"}.

    The step is `optim.apply_gradients` (float32), or `tx.update` + `optim.apply_updates_sr` with
    `stochastic_rounding` (bf16 params, as `qjax.train.Optimizer.step`); params and state are donated."""
    n = sum(p.size for p in jax.tree.leaves(params))
    state = jax.eval_shape(tx.init, params)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

    def step(grads, opt_state, params, key):
        if stochastic_rounding:
            updates, opt_state = tx.update(grads, opt_state, params)
            return optim.apply_updates_sr(params, updates, key), opt_state
        return optim.apply_gradients(tx, grads, opt_state, params)

    key = jax.eval_shape(lambda: jax.random.key(0))
    analysis = jax.jit(step, donate_argnums=(1, 2)).lower(params, state, params, key).compile().memory_analysis()
    temp = analysis.temp_size_in_bytes
    return {"state": state_bytes / n, "temp": temp / n, "total": (state_bytes + temp) / n}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="125m")
    parser.add_argument("--layers", type=int, default=None)
    args = parser.parse_args()
    params = llama_param_shapes(args.size, args.layers)
    print(f"{sum(p.size for p in jax.tree.leaves(params)) / 1e6:.1f}M params; bytes per param")
    print(f"{'optimizer':<24}{'state':>8}{'temp':>8}{'total':>8}")
    rows = [(name, step_memory(make(), params)) for name, make in OPTIMIZERS.items()]
    bf16 = llama_param_shapes(args.size, args.layers, jnp.bfloat16)
    rows.append(("adamw_8bit bf16 + SR", step_memory(OPTIMIZERS["adamw_8bit"](), bf16, stochastic_rounding=True)))
    for name, r in rows:
        print(f"{name:<24}{r['state']:>8.2f}{r['temp']:>8.2f}{r['total']:>8.2f}")


if __name__ == "__main__":
    main()
