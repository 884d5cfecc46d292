"""Grouped GEMM (mixture-of-experts) forward + backward per recipe vs bf16 grouped GEMMs: y = ragged_dot(x, w,
group_sizes), then dx and dw from an upstream gradient, at DeepSeek-V3-like expert shapes.

  python benchmarks/ragged.py             # GPU: 16384 tokens x top-8 of 64 experts = 131072 rows; dim 2048, expert
                                          # FFN 1408: gate_up 2048 -> 2816 and down 1408 -> 2048 per expert
  python benchmarks/ragged.py --with-xla  # also XLA's bf16 lax.ragged_dot (slow on GPUs: minutes at this size)
  python benchmarks/ragged.py --small     # CPU-sized (the default when no GPU is present)
  python benchmarks/ragged.py --warpgroups 2 1   # also rows "<recipe> 1wg": the grouped kernels (forward, dgrad,
                                          # wgrad) with one compute warpgroup (GroupedConfig.compute_warpgroups)
  python benchmarks/ragged.py --profile 15   # also each GPU row's device time by category and its 15 largest ops

The rows are the (token, expert) pairs of a random top-k routing, sorted by expert (group sizes: the routing's
counts, uneven as real routing is). Rows: "dense bf16" (one lax.dot_general of the same rows and FLOPs: what a
grouped GEMM at full efficiency would cost, the roofline), "bf16 (XLA)" (lax.ragged_dot, with --with-xla), "bf16"
(qjax.ragged_dot recipe "bf16": JAX's Mosaic GPU grouped kernels on a Hopper GPU, the baseline; lax.ragged_dot
elsewhere), and qjax.ragged_dot per recipe ("<recipe> 1wg": its grouped kernels with one compute warpgroup, not the
default two).
Prints milliseconds per step and the speedup over "bf16", and appends the table to the results JSON
(--no-record to skip). A step's time is the median over --reps samples after warm-up, each --inner steps queued
back to back.
"""

import argparse
import dataclasses
import importlib
import pathlib
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from jax import lax

import qjax
from common import record_results, device_kind, time_ms
from profile_train import device_events, print_report
from qjax.kernels import grouped_config_mgpu, grouped_matmul_mgpu

RECIPES = ["int8_rowwise", "fp8_rowwise"]


def make_step(recipe):
    """(x, w, g, group_sizes) -> (y, dx, dw), jitted; recipe None: lax.ragged_dot; "dense": one dense GEMM; else
    qjax.ragged_dot (recipe "bf16": on JAX's grouped kernels where they run)."""

    def gemm(x, w, sizes):
        if recipe == "dense":
            return x @ w[0]
        if recipe is None:
            return lax.ragged_dot(x, w, sizes)
        return qjax.ragged_dot(x, w, sizes, recipe=recipe)

    def step(x, w, g, sizes):
        y, vjp = jax.vjp(lambda x, w: gemm(x, w, sizes), x, w)
        return (y, *vjp(g))

    return jax.jit(step)


def profile(step, data, steps: int, top: int, label: str) -> None:
    """Prints the device time per step of `steps` calls of the (compiled) step by category and its `top` ops."""
    trace_dir = tempfile.mkdtemp(prefix="qjax_ragged_profile_")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready([step(*data) for _ in range(steps)])
    print(f"\nprofile of {label}, per step:")
    print_report(device_events(pathlib.Path(trace_dir)), steps, top)


def operands(rows, tokens, experts, top_k, k, n):
    keys = jax.random.split(jax.random.key(0), 4)
    routed = jax.random.choice(keys[0], experts, (tokens, top_k), replace=True)  # collisions: a little uneven
    sizes = jnp.bincount(routed.reshape(-1), length=experts).astype(jnp.int32)
    x = jax.random.normal(keys[1], (rows, k), jnp.bfloat16)
    w = (jax.random.normal(keys[2], (experts, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    g = jax.random.normal(keys[3], (rows, n), jnp.bfloat16)
    return x, w, g, sizes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes (default when no GPU is present)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--shapes", nargs="*", help="K x N per expert (default 2048x2816 1408x2048)")
    parser.add_argument("--recipes", nargs="*", default=RECIPES, help="quantized recipes (others: fp8_tensorwise, "
                        "fp8_blockwise, mxfp8)")
    parser.add_argument("--warpgroups", type=int, nargs="*", default=[2], choices=[1, 2],
                        help="compute warpgroups of the grouped kernels; each other than the default 2 adds rows "
                             "'<recipe> <n>wg'")
    parser.add_argument("--with-xla", action="store_true", help="also time XLA's bf16 lax.ragged_dot (slow on GPUs)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--inner", type=int, default=2, help="steps queued back to back per timed sample")
    parser.add_argument("--no-record", action="store_true", help="do not record results")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="also profile --inner steps of each row on a GPU: time by category and the TOP ops")
    args = parser.parse_args()
    small = args.small or jax.default_backend() != "gpu"
    tokens, experts, top_k = (256, 8, 2) if small else (args.tokens, args.experts, args.top_k)
    shapes = [(256, 384), (128, 256)] if small else [(2048, 2816), (1408, 2048)]
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes]
    reps, inner = (min(args.reps, 3), 1) if small else (args.reps, args.inner)
    rows = tokens * top_k
    print(f"ragged fwd+bwd on {device_kind()} ({jax.default_backend()}), jax {jax.__version__}: {tokens} tokens x "
          f"top-{top_k} of {experts} experts = {rows} rows", flush=True)
    names = ["dense bf16"] + ["bf16 (XLA)"] * (args.with_xla or small) + ["bf16"]
    names += [f"{r} {w}wg" if w != 2 else r for r in args.recipes if r != "bf16" for w in args.warpgroups]
    ragged_dot_lib = importlib.import_module("qjax.ragged_dot")  # the module (qjax.ragged_dot is the function)
    times, failures = {}, {}
    for k, n in shapes:
        data = operands(rows, tokens, experts, top_k, k, n)
        bf16_kernels = ragged_dot_lib._use_bf16_kernels(qjax.recipe("bf16"), data[0], data[1], None)
        for name in names:
            recipe, _, wgs = name.partition(" ")
            recipe = {"dense bf16": "dense", "bf16 (XLA)": None}.get(name, recipe)
            warpgroups = int(wgs[:-2]) if wgs.endswith("wg") else 2
            # the grouped kernels' config is read when the step is traced (its first, warm-up call)
            # (promoting fp8 GEMMs, the dgrad and wgrad, on two warpgroups take 64-row halves: registers)
            configs = dict(DEFAULT_CONFIG=dataclasses.replace(grouped_config_mgpu.DEFAULT_CONFIG,
                                                              compute_warpgroups=warpgroups),
                           PROMOTE_CONFIG=dataclasses.replace(grouped_config_mgpu.PROMOTE_CONFIG,
                                                              compute_warpgroups=warpgroups,
                                                              tile_m=64 if warpgroups == 2 else 128))
            try:  # XLA may not lower an 8-bit ragged_dot on this GPU: record that and go on
                with mock.patch.multiple(grouped_config_mgpu, **configs):
                    step = make_step(recipe)
                    ms = time_ms(step, data, args.warmup, reps, inner)
            except Exception as e:  # noqa: BLE001
                ms, failures[name] = float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if args.profile and not small and name not in failures:
                try:  # the profile is extra: its failure leaves the timing standing
                    profile(step, data, inner, args.profile, f"{name} K={k} N={n}")
                except Exception as e:  # noqa: BLE001
                    print(f"  profile of {name} failed: {type(e).__name__}: {e}", flush=True)
            times.setdefault(name, {})[(k, n)] = ms
            print(f"  {name:16s} K={k:5d} N={n:5d} {ms:9.3f} ms", flush=True)

    lines = ["| recipe | " + " | ".join(f"{k}→{n} ms | speedup" for k, n in shapes) + " |",
             "|---|" + "---:|---:|" * len(shapes)]
    for name, by_shape in times.items():
        cells = " | ".join(f"{by_shape[s]:.3f} | {times['bf16'][s] / by_shape[s]:.2f}x" for s in shapes)
        lines.append(f"| {name} | {cells} |")
    flops = " · ".join(f"{k}→{n}: bf16 {6 * rows * k * n / times['bf16'][(k, n)] / 1e9:.0f} TFLOP/s"
                       for k, n in shapes)
    baseline = "JAX's Mosaic GPU grouped kernels" if bf16_kernels else "lax.ragged_dot (JAX's kernels do not run here)"
    report = ("\n".join(lines) + f"\n\n{tokens} tokens x top-{top_k} of {experts} experts = {rows} rows (random "
              f"routing); x, w, g in bfloat16; y, dx, dw per step; median of {reps} samples of {inner} steps queued "
              f"back to back; speedup vs bf16 on {baseline}; row/tensor-scaled recipes on "
              f"{'qjax.kernels.grouped_matmul_mgpu' if qjax.dispatch.kernel_mode()[0] else 'XLA'}. {flops}.\n")
    report += "".join(f"\n{name} failed: {why}\n" for name, why in failures.items())
    print("\n" + report)
    if not args.no_record:
        record_results("ragged_dot (MoE grouped GEMM) fwd+bwd", report)


if __name__ == "__main__":
    main()
