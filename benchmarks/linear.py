"""Linear layer forward + backward time per recipe vs bf16: y = x . w^T, then dx and dw from an upstream gradient.

  python benchmarks/linear.py                 # GPU: M=16384, (K, N) in (4096, 4096), (4096, 14336), (14336, 4096)
  python benchmarks/linear.py --small         # CPU-sized shapes (the default when no GPU is present)

Prints a table of milliseconds per step (median over --reps timed runs after warm-up) and speedup vs bf16, and
appends it to benchmarks/RESULTS.md with the device, date and jax version (--no-append to skip).
"""

import argparse
import dataclasses
import datetime
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

import qjax

TN = (((1,), (1,)), ((), ()))
RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")


def bench_recipes():
    """bf16, every named recipe, and the int8 per-GEMM variants (forward only; forward + dgrad)."""
    int8 = qjax.recipe("int8_rowwise")
    variants = [dataclasses.replace(int8, name="int8_rowwise_fwd_only", dgrad=None, wgrad=None),
                dataclasses.replace(int8, name="int8_rowwise_fwd_dgrad", wgrad=None)]
    return list(qjax.RECIPES.values()) + variants


def make_step(recipe):
    """(x, w, g) -> (y, dx, dw): one linear layer's forward and backward, jitted."""

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: qjax.dot_general(x, w, TN, recipe=recipe), x, w)
        return (y, *vjp(g))

    return jax.jit(step)


def time_ms(fn, args, warmup, reps):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(m, shapes, reps, warmup, names=None):
    rows = {}
    for k, n in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
        for recipe in bench_recipes():
            if names and recipe.name not in names and recipe.name != "bf16":
                continue
            ms = time_ms(make_step(recipe), (x, w, g), warmup, reps)
            rows.setdefault(recipe.name, {})[(k, n)] = ms
            print(f"  {recipe.name:24s} K={k:6d} N={n:6d} {ms:9.3f} ms", flush=True)
    return rows


def table(rows, m, shapes):
    header = "| recipe | " + " | ".join(f"{k}→{n} ms | speedup" for k, n in shapes) + " |"
    lines = [header, "|---|" + "---:|---:|" * len(shapes)]
    for name, times in rows.items():
        cells = " | ".join(f"{times[s]:.3f} | {rows['bf16'][s] / times[s]:.2f}x" for s in shapes)
        lines.append(f"| {name} | {cells} |")
    flops = " · ".join(f"{k}→{n}: bf16 {6 * m * k * n / rows['bf16'][(k, n)] / 1e9:.0f} TFLOP/s" for k, n in shapes)
    return "\n".join(lines) + f"\n\nM={m}; x, w, g in bfloat16; y, dx, dw per step. {flops}.\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes (default when no GPU is present)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shapes", nargs="*", help="K x N pairs, e.g. 4096x14336 (default: the three GPU shapes)")
    parser.add_argument("--recipes", nargs="*", help="recipe names to time (default: all; bf16 always runs)")
    parser.add_argument("--no-append", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    small = args.small or jax.default_backend() != "gpu"
    m, shapes = (512, [(256, 256), (256, 1024)]) if small else (16384, [(4096, 4096), (4096, 14336), (14336, 4096)])
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes]
    device = jax.devices()[0].device_kind
    print(f"linear fwd+bwd on {device} ({jax.default_backend()}), jax {jax.__version__}, M={m}", flush=True)
    rows = run(m, shapes, args.reps if not small else min(args.reps, 5), args.warmup, args.recipes)
    report = table(rows, m, shapes)
    print("\n" + report)
    if not args.no_append:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with RESULTS.open("a") as f:
            f.write(f"\n## linear fwd+bwd — {device} — {stamp} — jax {jax.__version__}\n\n{report}")
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
