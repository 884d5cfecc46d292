"""Tuning tables for the Mosaic GPU kernels (GPU only): the scaled GEMM against cuBLAS, the quantize kernels'
bandwidth against a copy.

  python benchmarks/kernels.py gemm [--sizes 4096 8192] [--cases int8_row fp8_block] [--sweep]
  python benchmarks/kernels.py quantize

Each kernel's output is checked against its reference before it is timed (GEMM: relative error column; quantize:
the kernels' GPU tests in tests/kernels). Prints tables; the end-to-end numbers are benchmarks/matmul.py and
linear.py.
"""

import argparse
import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from qjax import stochastic
from qjax.kernels import quantize_mgpu, stochastic_cast_mgpu
from qjax.kernels import scaled_matmul_mgpu as mg
from qjax.kernels.scaled_matmul import scaled_matmul
from qjax.quantize import QuantSpec, quantize, quantize_with_seed


def gemm_table(argv):
    """GPU: check, then time the kernel against XLA's unscaled 8-bit GEMM and the reference path (TFLOP/s).

    python benchmarks/kernels.py gemm [--sizes 4096 8192] [--cases int8_row fp8_block] [--sweep]
    """
    cases = {"int8_row": ("int8", "row", "row"), "fp8_tensor": ("e4m3", "tensor", "tensor"),
             "fp8_row": ("e4m3", "row", "row"), "int8_block": ("int8", "1x128", "128x128"),
             "fp8_block": ("e4m3", "1x128", "128x128"), "fp8_block_wgrad": ("e4m3", "1x128", "1x128")}
    parser = argparse.ArgumentParser(prog="kernels.py gemm", description=gemm_table.__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--cases", nargs="+", default=list(cases), choices=list(cases))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time a few tile/grid configs per case")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (times meaningless)")
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "gpu" and not args.interpret:
        sys.exit("the benchmark needs a Hopper GPU (or --interpret with small --sizes)")
    say = functools.partial(print, flush=True)

    def seconds(fn, *xs):
        jax.block_until_ready(fn(*xs))  # compile + warm up
        samples = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready([fn(*xs) for _ in range(5)])
            samples.append((time.perf_counter() - start) / 5)
        return statistics.median(samples)

    say(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; out bf16; TFLOP/s (median of {args.reps} x 5 calls)")
    say(f"{'case':16} {'n':>5} {'kernel':>7} {'unscaled XLA':>12} {'reference':>9} {'kernel/XLA':>10} {'rel err':>8}")
    dims = (((1,), (1,)), ((), ()))
    for n in args.sizes:
        kx, kw = jax.random.split(jax.random.key(n))
        x, w = jax.random.normal(kx, (n, n), jnp.float32), jax.random.normal(kw, (n, n), jnp.float32)
        flops = 2.0 * n**3
        for name in args.cases:
            try:
                dtype, a_gran, b_gran = cases[name]
                a = jax.jit(quantize, static_argnums=1)(x, QuantSpec(dtype, a_gran))
                b = jax.jit(quantize, static_argnums=1)(w, QuantSpec(dtype, b_gran))
                acc = jnp.int32 if dtype == "int8" else jnp.bfloat16
                unscaled = jax.jit(lambda p, q, acc=acc: lax.dot_general(p, q, dims, preferred_element_type=acc))
                reference = jax.jit(lambda p, q: scaled_matmul(p, q, jnp.bfloat16))
                configs = [None]
                if args.sweep:
                    base = mg.default_config(a, b)
                    configs += [dataclasses.replace(base, grid_tile_width=w_, grid_minor_dim=d)
                                for w_ in (4, 16) for d in (0, 1)]
                    configs += [dataclasses.replace(base, max_concurrent_steps=base.max_concurrent_steps - 1)]
                    configs += [dataclasses.replace(base, cluster_m=2)]
                    if base == mg.ROW_CONFIG:  # 128 x 256 CTA tiles (wgmma N=256); 4 stages overflow SMEM by ~100 bytes
                        configs += [dataclasses.replace(base, tile_m=64, tile_n=256, max_concurrent_steps=3)]
                ref_out = reference(a, b)
                t_xla, t_ref = seconds(unscaled, a.data, b.data), seconds(reference, a, b)
                for config in configs:
                    kernel = jax.jit(functools.partial(mg.scaled_matmul_kernel, out_dtype=jnp.bfloat16, config=config,
                                                         interpret=args.interpret))
                    out = kernel(a, b).astype(jnp.float32)
                    err = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out.astype(jnp.float32)))
                    t_kernel = seconds(kernel, a, b)
                    label = name if config is None else (
                        f"  {config.tile_m}x{config.tile_n} s{config.max_concurrent_steps} "
                        f"d{config.grid_minor_dim}w{config.grid_tile_width} c{config.cluster_m}")
                    say(f"{label:16} {n:5} {flops / t_kernel / 1e12:7.0f} {flops / t_xla / 1e12:12.0f} "
                        f"{flops / t_ref / 1e12:9.0f} {t_xla / t_kernel:10.2f} {err:8.1e}")
            except Exception as e:  # keep the other cases' numbers
                say(f"{name:16} {n:5} FAILED: {type(e).__name__}: {str(e)[:400]}")


def quantize_table(m: int = 16384, k: int = 4096, iters: int = 20):
    """Bandwidth table on a GPU: (bytes read + written) / time of the kernels, XLA's fusion of the reference, and a
    plain XLA copy (x * s) as the device's copy bandwidth. Prints as it goes; a failing case prints its error."""
    def timed(fn, *args):
        jax.block_until_ready(fn(*args))  # compile + warm up
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, x ({m}, {k})", flush=True)
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    x32 = x.astype(jnp.float32)
    seed = jnp.uint32(7)
    n = m * k
    int8_row, e4m3_block = QuantSpec("int8", "row"), QuantSpec("e4m3", "1x128")
    reference_pair = lambda spec: jax.jit(lambda x, s: (quantize_with_seed(x, spec, s),
                                                        quantize_with_seed(x.T, spec, s)))
    # name -> (function, args, bytes the function must move at least, bytes our kernels actually move)
    pair = lambda spec, tiles: jax.jit(lambda x, s: quantize_mgpu.quantize_pair(x, spec, spec, s, s,
                                                                               tiles_per_program=tiles))
    sr_cast = lambda x, s: stochastic_cast_mgpu.stochastic_cast(x, jnp.bfloat16, s)
    # name -> (function, args, bytes the function must move at least, bytes our kernels actually move)
    cases = {"copy bf16 (XLA x * s)": (jax.jit(lambda x, s: x * s), (x, jnp.bfloat16(1)), 4 * n, 4 * n)}
    for tiles in (1, 2, 4, 8):
        cases[f"int8 row, both layouts: kernels, {tiles} tiles"] = (pair(int8_row, tiles), (x, seed), 4 * n, 6 * n)
    cases["int8 row, both layouts: XLA reference"] = (reference_pair(int8_row), (x, seed), 4 * n, None)
    for tiles in (1, 2, 4, 8):
        cases[f"e4m3 1x128 + 128x1: kernel, {tiles} tiles"] = (pair(e4m3_block, tiles), (x, seed), 4 * n + n // 16,
                                                                4 * n + n // 16)
    cases["e4m3 1x128 + 128x1: XLA reference"] = (reference_pair(e4m3_block), (x, seed), 4 * n + n // 16, None)
    cases["copy f32 (XLA x * s)"] = (jax.jit(lambda x, s: x * s), (x32, jnp.float32(1)), 8 * n, 8 * n)
    cases["SR cast f32 -> bf16: kernel"] = (jax.jit(sr_cast), (x32, seed), 6 * n, 6 * n)
    cases["SR cast f32 -> bf16: XLA reference"] = (
        jax.jit(lambda x, s: stochastic.stochastic_round_with_seed(x, jnp.bfloat16, s)), (x32, seed), 6 * n, None)
    print(f"{'case':44s} {'time ms':>9s} {'min bytes GB/s':>15s} {'moved GB/s':>11s}", flush=True)
    for name, (fn, args, min_bytes, moved_bytes) in cases.items():
        try:
            t = timed(fn, *args)
            moved = f"{moved_bytes / t / 1e9:11.0f}" if moved_bytes else f"{'':11s}"
            print(f"{name:44s} {t * 1e3:9.3f} {min_bytes / t / 1e9:15.0f} {moved}", flush=True)
        except Exception as e:  # keep measuring the other cases
            print(f"{name:44s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("gemm", "quantize"):
        sys.exit(__doc__)
    if sys.argv[1] == "gemm":
        gemm_table(sys.argv[2:])
    else:
        quantize_table()


if __name__ == "__main__":
    main()
