"""The low-bit AdamW step under an FSDP mesh over every visible device: per-device fused kernel against the streamed
jnp step and optax.adamw, bf16 params with stochastic rounding (as the 8B FSDP train step runs it).

  python benchmarks/optim_mesh.py --layers 4       # Llama-3-8B layer shapes, 4 layers, FSDP over all GPUs
  python benchmarks/optim_mesh.py --small          # a toy tree (auto-on without a GPU); prints only, unless --write

The params get the train step's PartitionSpecs (`qjax.train.mesh.param_spec`: column-parallel q/k/v, gate, up
split on dim 0, row-parallel o and down and the LM head on dim 1, the embedding on dim 0) and the states its
`state_specs` (blocks split along dim 0); one step is `qjax.optim.apply_gradients(..., param_specs=)` traced with
the mesh set, params and state donated. Rows: optax.adamw (the baseline; states in the params' bf16), adamw_8bit
through jnp (use_kernel=False) and with the per-device kernel. Timed as benchmarks/optim.py times (`Prepared`: a
`fori_loop` of --iters steps per dispatch, rows alternating with the baseline over --rounds rounds); temp GB per
device is XLA's compiled temp_size_in_bytes of that loop (params and state carried in place).
"""

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qjax import optim  # noqa: E402
from qjax.dispatch import on_hopper_gpu  # noqa: E402
from qjax.train import mesh as train_mesh  # noqa: E402
from qjax.train.mesh import FSDP_AXIS  # noqa: E402
from common import record_results  # noqa: E402
from optim import TimedLoop, llama_shapes  # noqa: E402

# benchmarks/optim.py's names -> the model's param paths, whose names the train step's sharding rules read
_PATHS = {"q": "attn/qkv_proj/kernel", "k": "attn/qkv_proj/kernel", "v": "attn/qkv_proj/kernel",
          "o": "attn/o_proj/kernel", "gate": "mlp/gate_up_proj/kernel", "up": "mlp/gate_up_proj/kernel",
          "down": "mlp/down_proj/kernel"}


def spec_of(name: str, shape, mesh):
    layer, _, part = name.partition(".")
    return train_mesh.param_spec(f"{layer}/{_PATHS.get(part, part)}", shape, mesh)


class Prepared(TimedLoop):
    """One optimizer's compiled loop of `iters` steps over the mesh and its carried (params, state), warmed up."""

    def __init__(self, tx, params, grads, specs, mesh, iters: int):
        state = jax.eval_shape(tx.init, params)
        state_sharding = train_mesh.named(train_mesh.state_specs(state, params, mesh), mesh)
        self.state = jax.jit(tx.init, out_shardings=state_sharding)(params)
        self.params = jax.tree.map(jnp.copy, params)
        self.grads, self.iters, self.times = grads, iters, []
        key = lambda i: jax.random.fold_in(jax.random.key(0), i)  # noqa: E731

        def loop(p, s, g):
            return lax.fori_loop(0, iters, lambda i, c: optim.apply_gradients(tx, g, c[1], c[0], key(i), specs),
                                 (p, s))

        shardings = (jax.tree.map(lambda x: x.sharding, params), state_sharding)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            traced = jax.jit(loop, donate_argnums=(0, 1), out_shardings=shardings).trace(self.params, self.state,
                                                                                         grads)
        self.loop = traced.lower().compile()
        self.temp_bytes = self.loop.memory_analysis().temp_size_in_bytes
        self.run()  # warms up


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="toy tree (auto-on when no GPU is present)")
    parser.add_argument("--layers", type=int, default=8, help="Llama-3-8B-shaped layers (the full model has 32)")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per optimizer per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each row alternating with the baseline")
    parser.add_argument("--write", action="store_true", help="record results even with --small / no GPU")
    args = parser.parse_args()
    small = args.small or not on_hopper_gpu()
    shapes = (llama_shapes(d=256, layers=2, heads=4, kv_heads=2, ffn=1024, vocab=2048) if small else
              llama_shapes(d=4096, layers=args.layers, heads=32, kv_heads=8, ffn=14336, vocab=128256))
    mesh = jax.make_mesh((jax.device_count(),), (FSDP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    specs = {name: spec_of(name, shape, mesh) for name, shape in shapes.items()}
    n = sum(math.prod(s) for s in shapes.values())

    def tree(seed, scale):
        make = lambda name, key: (jax.random.normal(key, shapes[name]) * scale).astype(jnp.bfloat16)  # noqa: E731
        keys = dict(zip(shapes, jax.random.split(jax.random.key(seed), len(shapes))))
        return {name: jax.jit(make, static_argnums=0, out_shardings=NamedSharding(mesh, specs[name]))(name, keys[name])
                for name in shapes}

    params, grads = tree(0, 0.02), tree(1, 1e-3)
    rows = {"optax.adamw (bf16 states)": optax.adamw(1e-4),
            "adamw_8bit, jnp step": optim.adamw_8bit(1e-4),
            "adamw_8bit, per-device kernel": optim.adamw_8bit(1e-4, use_kernel=True)}
    baseline, *others = [(name, Prepared(tx, params, grads, specs, mesh, args.iters)) for name, tx in rows.items()]
    for _ in range(args.rounds):
        for _, prepared in [baseline, *others]:
            prepared.run(timed=True)
    lines = ["| optimizer | step ms | vs optax.adamw | temp GB per device |", "|---|---|---|---|"]
    for name, prepared in [baseline, *others]:
        lines.append(f"| {name} | {prepared.median_ms:.2f} | {prepared.median_ms / baseline[1].median_ms:.2f}x | "
                     f"{prepared.temp_bytes / 2**30:.2f} |")
    tree_name = "a toy tree" if small else f"{args.layers} Llama-3-8B layers, embedding and LM head"
    report = "\n".join(lines) + (f"\n\n{n / 1e6:.0f}M params ({tree_name}), bf16 params and grads, stochastic "
                                 f"rounding; FSDP over {jax.device_count()} devices; median of {args.rounds} rounds "
                                 f"of {args.iters} steps.\n")
    print(report)
    if not small or args.write:
        record_results("AdamW step under an FSDP mesh (benchmarks/optim_mesh.py)", report)


if __name__ == "__main__":
    main()
