"""Optimizer-state memory and step time of qjax.optim's low-bit AdamW against fp32-state optax.adamw.

  python benchmarks/optim.py            # TinyLlama-shaped 1.1B float32 pytree (GPU); records its results
  python benchmarks/optim.py --small    # a 2-layer d=256 pytree (auto-on without a GPU); prints only, unless --write
  python benchmarks/optim.py --rows optax fp8_kernel    # some rows only (optax.adamw always runs first: the baseline)

Params and grads are float32 (so optax.adamw's states are float32, the baseline the ratios refer to). One step is
`qjax.optim.apply_gradients` (= `tx.update` + `optax.apply_updates`; for adamw_8bit / adamw_4bit /
adamw_fp8(use_kernel=True) the fused step kernel) with params and state donated. Each row is timed alternately with
optax.adamw (--rounds rounds of --iters steps), so that a GPU's clock drift during the run hits both alike, and its
ratio is against the baseline's median in those same rounds; only the row and the baseline are resident. A round is
one jitted `fori_loop` of --iters steps, one dispatch: the GPU's time (steps dispatched one by one measured the
host, see `Prepared`). Step ms is the median over rounds of the mean step time. Achieved GB/s counts the bytes a
step must move: params read + written, grads read, every state array read + written (divided by the step time).
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from qjax import optim  # noqa: E402
from qjax.dispatch import on_hopper_gpu  # noqa: E402
from qjax.optim import blockwise  # noqa: E402
from common import record_results  # noqa: E402


ROWS = ("optax", "8bit", "8bit_kernel", "4bit", "4bit_kernel", "fp8", "fp8_kernel", "fp8_dre", "fp8_dre_kernel",
        "8bit_sr", "8bit_sr_kernel", "fp8_sr", "fp8_sr_kernel", "fp8_dre_sr", "fp8_dre_sr_kernel")


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


def step_memory(tx, params, stochastic_rounding: bool = False) -> dict:
    """Bytes per param of one jitted `optim.apply_gradients` step of `tx` on `params` (ShapeDtypeStructs), params
    and state donated, from XLA's compiled memory analysis: {"state", "temp", "total"}. temp is
    `temp_size_in_bytes` (what XLA allocates inside the step besides arguments and outputs; with the donated
    outputs aliasing the inputs, state + temp is what the step adds to params and grads at its peak).
    stochastic_rounding: the step gets a key (bfloat16 params rounded stochastically)."""
    n = sum(p.size for p in jax.tree.leaves(params))
    state = jax.eval_shape(tx.init, params)
    key = jax.eval_shape(lambda: jax.random.key(0)) if stochastic_rounding else None
    step = jax.jit(lambda g, s, p, k: optim.apply_gradients(tx, g, s, p, k), donate_argnums=(1, 2))
    analysis = step.lower(params, state, params, key).compile().memory_analysis()
    state_bytes = blockwise.nbytes(state)
    return {"state": state_bytes / n, "temp": analysis.temp_size_in_bytes / n,
            "total": (state_bytes + analysis.temp_size_in_bytes) / n}


class TimedLoop:
    """A compiled `loop(params, state, grads)` of `iters` optimizer steps with its carried (params, state): set
    loop, params, state, grads, iters and times (a list) before `run`."""

    def run(self, timed: bool = False) -> None:
        """`iters` optimizer steps (params and state donated and carried) in one dispatch, then one wait; with
        `timed`, records their mean time."""
        start = time.perf_counter()
        self.params, self.state = self.loop(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))
        if timed:
            self.times.append((time.perf_counter() - start) / self.iters)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times) * 1e3


class Prepared(TimedLoop):
    """One optimizer's compiled steps and its carried (params, state), warmed up.

    `step` (one optimizer step) gives the optimized HLO's statistics; `loop` runs `iters` steps in one `fori_loop`,
    one dispatch, which is what is timed: dispatching a step of ~1000 arrays from the host took 4-6 ms for
    optax.adamw and 6-26 ms for the fused-kernel steps (H100, 2026-11-24), as long as or longer than their GPU time,
    so steps dispatched one by one timed the host. In training the optimizer runs inside the train step's single
    dispatch, which overlaps the model's GPU work."""

    def __init__(self, tx, params, grads, iters: int, dump_path=None, stochastic_rounding: bool = False):
        state = tx.init(params)
        # bf16 params + stochastic rounding: apply_gradients gets a fresh key per step
        key_of = (lambda i: jax.random.fold_in(jax.random.key(0), i)) if stochastic_rounding else (lambda i: None)
        step = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p, key_of(0)), donate_argnums=(0, 1))
        self.params = jax.tree.map(jnp.copy, params)
        compiled = step.lower(self.params, state, grads).compile()
        self.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
        hlo = compiled.as_text()
        if dump_path:
            os.makedirs(os.path.dirname(dump_path), exist_ok=True)
            with open(dump_path, "w") as f:
                f.write(hlo)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        self.xla_bytes = (cost or {}).get("bytes accessed")
        # Kernel launches: fusions and custom calls (Pallas kernels, cuBLAS) of the entry computation.
        entry = hlo[hlo.find("ENTRY"):]
        self.kernels = sum(entry.count(op) for op in (" fusion(", " custom-call("))
        self.state_bytes = blockwise.nbytes(state)
        self.iters = iters

        def loop(p, s, g):
            return lax.fori_loop(0, iters, lambda i, carry: optim.apply_gradients(tx, g, carry[1], carry[0], key_of(i)),
                                 (p, s))

        self.loop = jax.jit(loop, donate_argnums=(0, 1))
        self.state = state
        self.times = []
        self.grads = grads
        self.run()  # compiles and warms up


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small pytree (auto-on when no GPU is present)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per optimizer per round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of each row alternated with optax.adamw (so that clock drift hits both alike)")
    parser.add_argument("--dump-hlo", help="directory to write each row's optimized HLO to")
    parser.add_argument("--write", action="store_true", help="record results even with --small / no GPU")
    parser.add_argument("--rows", nargs="+", choices=ROWS, help=f"rows to run (default: all): {' '.join(ROWS)}")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    small = args.small or not on_gpu
    shapes = llama_shapes(d=256, layers=2, heads=4, kv_heads=2, ffn=704, vocab=4000) if small else llama_shapes()
    n_params = sum(int(jnp.prod(jnp.array(s))) for s in shapes.values())
    params = make_tree(shapes, jax.random.key(0), 0.02)
    grads = make_tree(shapes, jax.random.key(1), 1e-3)
    param_bytes = 4 * n_params
    bf16 = [jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree) for tree in (params, grads)]

    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000)
    selected = set(args.rows or ROWS) | {"optax"}
    configs = [("optax.adamw (fp32 states)", lambda k: optax.adamw(lr, weight_decay=0.01), None)]
    # Rows ending in _sr: bfloat16 params and grads, updated with stochastic rounding (no float32 master copy).
    for row, name, make in [
            ("8bit", "adamw_8bit", lambda k: optim.adamw_8bit(lr, weight_decay=0.01, use_kernel=k)),
            ("4bit", "adamw_4bit", lambda k: optim.adamw_4bit(lr, weight_decay=0.01, use_kernel=k)),
            ("fp8", "adamw_fp8", lambda k: optim.adamw_fp8(lr, weight_decay=0.01, use_kernel=k)),
            ("fp8_dre", "adamw_fp8 +DRE", lambda k: optim.adamw_fp8(lr, weight_decay=0.01, use_kernel=k,
                                                                    dynamic_range_expansion=True)),
            ("8bit_sr", "adamw_8bit bf16+SR", lambda k: optim.adamw_8bit(lr, weight_decay=0.01, use_kernel=k)),
            ("fp8_sr", "adamw_fp8 bf16+SR", lambda k: optim.adamw_fp8(lr, weight_decay=0.01, use_kernel=k)),
            ("fp8_dre_sr", "adamw_fp8 +DRE bf16+SR", lambda k: optim.adamw_fp8(lr, weight_decay=0.01, use_kernel=k,
                                                                               dynamic_range_expansion=True))]:
        if row in selected:
            configs.append((f"{name} (jnp)", make, False))
        # The fused Mosaic GPU step (qjax.optim.fused_adam) covers 8-bit, 4-bit and e4m3 states, with or without
        # range expansion; off-GPU it would run under the interpreter, far too slowly to time, so its rows need a
        # Hopper GPU.
        if f"{row}_kernel" in selected:
            if on_hopper_gpu():
                configs.append((f"{name} (fused step kernel)", make, True))
            else:
                print(f"{row}_kernel: skipped, the fused step kernel needs a Hopper GPU", flush=True)

    def prepare(name, make, use_kernel):
        dump = None
        if args.dump_hlo:
            dump = os.path.join(args.dump_hlo, name.replace(" ", "_").replace("(", "").replace(")", "") + ".hlo")
        if "bf16+SR" in name:
            return Prepared(make(use_kernel), *bf16, args.iters, dump, stochastic_rounding=True)
        return Prepared(make(use_kernel), params, grads, args.iters, dump)

    # Each row is timed against optax.adamw in its own rounds, with only the two resident: every row keeps its own
    # params (4.4 GB for 1.1B float32) and states (up to 8.8 GB) on the GPU.
    baseline = prepare(*configs[0])
    rows, base_bytes = [], baseline.state_bytes
    for name, make, use_kernel in configs:
        bench = baseline if use_kernel is None else prepare(name, make, use_kernel)
        first = len(baseline.times)
        for _ in range(args.rounds):
            baseline.run(timed=True)
            if bench is not baseline:
                bench.run(timed=True)
        ms, base_ms = bench.median_ms, statistics.median(baseline.times[first:]) * 1e3
        state_bytes, kernels = bench.state_bytes, bench.kernels
        # params read+write, grads read (bf16 rows: half the bytes), states read+write
        moved = 3 * param_bytes // (2 if "bf16" in name else 1) + 2 * state_bytes
        # XLA's cost analysis does not count custom calls (the fused kernel): no ratio for rows that have them.
        xla_ratio = bench.xla_bytes / moved if bench.xla_bytes and not use_kernel else float("nan")
        rows.append((name, state_bytes, state_bytes / base_bytes, ms, base_ms, ms / base_ms, moved / ms / 1e6,
                     kernels, xla_ratio, bench.temp_bytes / n_params))
        print(f"{name:28s} {state_bytes / 2**30:8.3f} GiB  {state_bytes / base_bytes:6.4f}  {ms:9.2f} ms  "
              f"(optax.adamw {base_ms:.2f} ms)  {ms / base_ms:5.2f}x  {moved / ms / 1e6:8.1f} GB/s  {kernels} kernels"
              f"  XLA bytes {xla_ratio:.2f}x the minimum  temp {bench.temp_bytes / n_params:.2f} B/param", flush=True)
        del bench  # frees this row's params and state before the next row

    table = [f"{n_params / 1e9:.3f}B float32 params and grads ({'small' if small else 'TinyLlama 1.1B'} shapes; "
             "bfloat16 in the bf16+SR rows). "
             f"Each row is timed alternately with optax.adamw ({args.rounds} rounds of {args.iters} steps in one "
             "jitted fori_loop each, after one warm-up round; only the two optimizers resident); step ms is the "
             "median over rounds of the mean step time, the ratio is against optax.adamw's median in the same "
             "rounds.\n",
             "| optimizer | state bytes | ratio vs fp32 AdamW state | step ms | optax.adamw ms (same rounds) | "
             "ratio vs optax.adamw | achieved GB/s | kernels | XLA bytes / minimum | temp B/param |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, state_bytes, ratio, ms, base_ms, speed, gbs, kernels, xla_ratio, temp in rows:
        xla = "–" if xla_ratio != xla_ratio else f"{xla_ratio:.2f}"
        table.append(f"| {name} | {state_bytes:,} | {ratio:.4f} | {ms:.2f} | {base_ms:.2f} | {speed:.2f}x | "
                     f"{gbs:.1f} | {kernels} | {xla} | {temp:.2f} |")
    table.append("\nachieved GB/s = the minimum bytes a step must move (params read + written, grads read, states "
                 "read + written) / step time; kernels = fusions + custom calls XLA launches per step; XLA bytes = "
                 "the compiled step's cost-analysis 'bytes accessed' over that minimum; temp = the compiled step's "
                 "memory_analysis temp_size_in_bytes per param (params and state donated); bf16+SR rows: bfloat16 "
                 "params and grads, stochastic rounding.")
    text = "\n".join(table) + "\n"
    print(text)
    if (on_gpu and not args.small) or args.write:
        record_results("optim: AdamW state bytes and step time" + (" (small pytree)" if small else ""), text)


if __name__ == "__main__":
    main()
