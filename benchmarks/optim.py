"""Optimizer-state memory and step time of qjax.optim's low-bit AdamW against fp32-state optax.adamw.

  python benchmarks/optim.py            # TinyLlama-shaped 1.1B float32 pytree (GPU); appends to benchmarks/RESULTS.md
  python benchmarks/optim.py --small    # a 2-layer d=256 pytree (auto-on without a GPU); prints only, unless --write
  python benchmarks/optim.py --rows optax fp8_kernel    # some rows only (optax.adamw always runs first: the baseline)

Params and grads are float32 (so optax.adamw's states are float32, the baseline the ratios refer to). One step is
`qjax.optim.apply_gradients` (= `tx.update` + `optax.apply_updates`; for adamw_fp8(use_kernel=True) the fused step
kernel) under one jit with params and state donated. All optimizers are compiled and kept resident, then timed in
--rounds rounds of --iters steps each, round-robin, so that a GPU's clock drift during the run (the same step has
measured 16% apart minutes later) hits every row alike; step ms is the median of a row's timed steps, each ended by
block_until_ready. Achieved GB/s counts the bytes a step must move: params read + written, grads read, every state
array read + written (divided by the step time).
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qjax import optim  # noqa: E402
from qjax.kernels import on_hopper_gpu  # noqa: E402
from qjax.optim import blockwise  # noqa: E402
from common import append_results  # noqa: E402


ROWS = ("optax", "8bit", "4bit", "fp8", "fp8_kernel", "fp8_dre")


def llama_shapes(d=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000):
    """Param shapes of a Llama (TinyLlama 1.1B by default): untied embedding and LM head, RMSNorm scales."""
    head_dim = d // heads
    shapes = {"embed": (vocab, d), "lm_head": (d, vocab), "final_norm": (d,)}
    for i in range(layers):
        shapes.update({f"l{i}.q": (d, d), f"l{i}.k": (d, kv_heads * head_dim), f"l{i}.v": (d, kv_heads * head_dim),
                       f"l{i}.o": (d, d), f"l{i}.gate": (d, ffn), f"l{i}.up": (d, ffn), f"l{i}.down": (ffn, d),
                       f"l{i}.attn_norm": (d,), f"l{i}.mlp_norm": (d,)})
    return shapes


def make_tree(shapes, key, scale):
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.normal(k, shape, jnp.float32) * scale for k, (name, shape) in zip(keys, shapes.items())}


class Prepared:
    """One optimizer's compiled step and its carried (params, state), warmed up; see `prepare`."""

    def __init__(self, tx, params, grads, dump_path=None):
        state = tx.init(params)
        step = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
        self.params = jax.tree.map(jnp.copy, params)
        self.step = step.lower(self.params, state, grads).compile()  # compiled once: the HLO is of what runs
        hlo = self.step.as_text()
        if dump_path:
            os.makedirs(os.path.dirname(dump_path), exist_ok=True)
            with open(dump_path, "w") as f:
                f.write(hlo)
        cost = self.step.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        self.xla_bytes = (cost or {}).get("bytes accessed")
        # Kernel launches: fusions and custom calls (Pallas kernels, cuBLAS) of the entry computation.
        entry = hlo[hlo.find("ENTRY"):]
        self.kernels = sum(entry.count(op) for op in (" fusion(", " custom-call("))
        self.state_bytes = blockwise.nbytes(state)
        self.state = state
        self.times = []
        self.run(grads, 3)

    def run(self, grads, steps: int, timed: bool = False) -> None:
        """`steps` optimizer steps (params and state donated and carried); with `timed`, records each one's time."""
        for _ in range(steps):
            start = time.perf_counter()
            self.params, self.state = self.step(self.params, self.state, grads)
            jax.block_until_ready((self.params, self.state))
            if timed:
                self.times.append(time.perf_counter() - start)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small pytree (auto-on when no GPU is present)")
    parser.add_argument("--iters", type=int, default=2, help="timed steps per optimizer per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds over all optimizers (interleaved, so that clock drift hits every row alike)")
    parser.add_argument("--dump-hlo", help="directory to write each row's optimized HLO to")
    parser.add_argument("--write", action="store_true", help="append to RESULTS.md even with --small / no GPU")
    parser.add_argument("--rows", nargs="+", choices=ROWS, help=f"rows to run (default: all): {' '.join(ROWS)}")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    small = args.small or not on_gpu
    shapes = llama_shapes(d=256, layers=2, heads=4, kv_heads=2, ffn=704, vocab=4000) if small else llama_shapes()
    n_params = sum(int(jnp.prod(jnp.array(s))) for s in shapes.values())
    params = make_tree(shapes, jax.random.key(0), 0.02)
    grads = make_tree(shapes, jax.random.key(1), 1e-3)
    param_bytes = 4 * n_params

    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000)
    selected = set(args.rows or ROWS) | {"optax"}
    configs = [("optax.adamw (fp32 states)", lambda k: optax.adamw(lr, weight_decay=0.01), None)]
    for row, name, make in [
            ("8bit", "adamw_8bit", lambda k: optim.adamw_8bit(lr, weight_decay=0.01)),
            ("4bit", "adamw_4bit", lambda k: optim.adamw_4bit(lr, weight_decay=0.01)),
            ("fp8", "adamw_fp8", lambda k: optim.adamw_fp8(lr, weight_decay=0.01, use_kernel=k)),
            ("fp8_dre", "adamw_fp8 +DRE", lambda k: optim.adamw_fp8(lr, weight_decay=0.01, use_kernel=k,
                                                                    dynamic_range_expansion=True))]:
        if row in selected:
            configs.append((f"{name} (jnp)", make, False))
        # The fused Mosaic GPU step (qjax.optim.fused_adam) covers e4m3 states without expansion; off-GPU it would
        # run under the interpreter, far too slowly to time, so its row needs a Hopper GPU.
        if row == "fp8" and "fp8_kernel" in selected:
            if on_hopper_gpu():
                configs.append((f"{name} (fused step kernel)", make, True))
            else:
                print("fp8_kernel: skipped, the fused step kernel needs a Hopper GPU", flush=True)

    prepared = []
    for name, make, use_kernel in configs:
        dump = None
        if args.dump_hlo:
            dump = os.path.join(args.dump_hlo, name.replace(" ", "_").replace("(", "").replace(")", "") + ".hlo")
        prepared.append(Prepared(make(use_kernel), params, grads, dump))
    for _ in range(args.rounds):
        for bench in prepared:
            bench.run(grads, args.iters, timed=True)

    rows, base_ms, base_bytes = [], prepared[0].median_ms, prepared[0].state_bytes
    for (name, _, use_kernel), bench in zip(configs, prepared):
        ms, state_bytes, kernels = bench.median_ms, bench.state_bytes, bench.kernels
        moved = 3 * param_bytes + 2 * state_bytes  # params read+write, grads read, states read+write
        # XLA's cost analysis does not count custom calls (the fused kernel): no ratio for rows that have them.
        xla_ratio = bench.xla_bytes / moved if bench.xla_bytes and not use_kernel else float("nan")
        rows.append((name, state_bytes, state_bytes / base_bytes, ms, ms / base_ms, moved / ms / 1e6, kernels,
                     xla_ratio))
        print(f"{name:28s} {state_bytes / 2**30:8.3f} GiB  {state_bytes / base_bytes:6.4f}  {ms:9.2f} ms  "
              f"{ms / base_ms:5.2f}x  {moved / ms / 1e6:8.1f} GB/s  {kernels} kernels  XLA bytes {xla_ratio:.2f}x "
              "the minimum", flush=True)

    table = [f"{n_params / 1e9:.3f}B float32 params ({'small' if small else 'TinyLlama 1.1B'} shapes), float32 grads, "
             f"median of {args.rounds} x {args.iters} steps per optimizer after 3 warm-up, the "
             f"optimizers interleaved round by round (all resident at once).\n",
             "| optimizer | state bytes | ratio vs fp32 AdamW state | step ms | ratio vs optax.adamw | achieved GB/s | "
             "kernels | XLA bytes / minimum |",
             "|---|---|---|---|---|---|---|---|"]
    for name, state_bytes, ratio, ms, speed, gbs, kernels, xla_ratio in rows:
        xla = "–" if xla_ratio != xla_ratio else f"{xla_ratio:.2f}"
        table.append(f"| {name} | {state_bytes:,} | {ratio:.4f} | {ms:.2f} | {speed:.2f}x | {gbs:.1f} | {kernels} | "
                     f"{xla} |")
    table.append("\nachieved GB/s = the minimum bytes a step must move (params read + written, grads read, states "
                 "read + written) / step time; kernels = fusions + custom calls XLA launches per step; XLA bytes = "
                 "the compiled step's cost-analysis 'bytes accessed' over that minimum.")
    text = "\n".join(table) + "\n"
    print(text)
    if (on_gpu and not args.small) or args.write:
        append_results("optim: AdamW state bytes and step time" + (" (small pytree)" if small else ""), text)


if __name__ == "__main__":
    main()
