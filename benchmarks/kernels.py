"""Tuning tables for the Mosaic GPU kernels (GPU only): the scaled GEMM against cuBLAS, the quantize kernels'
bandwidth against a copy.

  python benchmarks/kernels.py gemm [--sizes 4096 8192] [--cases int8_row fp8_block] [--sweep]
  python benchmarks/kernels.py quantize [--shapes 16384x2048 16384x11264]
  python benchmarks/kernels.py swiglu [--shapes 16384x5632] [--tiles 2048 4096 8192]
  python benchmarks/kernels.py rmsnorm [--shapes 16384x2048 16384x4096]

Each kernel's output is checked against its reference before it is timed (GEMM: relative error column; quantize:
the kernels' GPU tests in tests/kernels; SwiGLU and RMSNorm: codes and scales against the reference); rmsnorm also
times the norm's backward, which stays XLA's. Prints tables (swiglu and rmsnorm also append theirs to
the results JSON); the end-to-end numbers are benchmarks/matmul.py and linear.py.
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

import common  # benchmarks/: timing helpers and the results JSON
import stochastic_cast_mgpu  # benchmarks/: the standalone SR cast kernel, outside the library
from qjax import dispatch, prologue, stochastic
from qjax.kernels import gemm_config_mgpu as gemm_config
from qjax.kernels import quantize_mgpu, resolve_interpret
from qjax.kernels import rmsnorm_mgpu
from qjax.kernels import scaled_matmul_mgpu as mg
from qjax.kernels import swiglu_mgpu
from qjax.models import ops
from qjax.kernels.scaled_matmul import scaled_matmul
from qjax.quantize import QuantSpec, amax, quantize, quantize_with_seed


def gemm_table(argv):
    """GPU: check, then time the kernel against XLA's unscaled 8-bit GEMM and the reference path (TFLOP/s).

    python benchmarks/kernels.py gemm [--sizes 4096 8192] [--cases int8_row fp8_block] [--sweep]
    """
    # name -> (codes, a granularity, b granularity, precise accumulation: the backward GEMMs of the fp8 recipes;
    # the kernel promotes every 128 of K, the reference runs cuBLAS at Precision.HIGHEST)
    cases = {"int8_row": ("int8", "row", "row", False), "fp8_tensor": ("e4m3", "tensor", "tensor", False),
             "fp8_tensor_precise": ("e4m3", "tensor", "tensor", True), "fp8_row": ("e4m3", "row", "row", False),
             "int8_block": ("int8", "1x128", "128x128", False), "fp8_block": ("e4m3", "1x128", "128x128", False),
             "fp8_block_wgrad": ("e4m3", "1x128", "1x128", False)}
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
    say(f"{'case':34} {'n':>5} {'kernel':>7} {'unscaled XLA':>12} {'reference':>9} {'kernel/XLA':>10} {'rel err':>8}")
    dims = (((1,), (1,)), ((), ()))
    for n in args.sizes:
        kx, kw = jax.random.split(jax.random.key(n))
        x, w = jax.random.normal(kx, (n, n), jnp.float32), jax.random.normal(kw, (n, n), jnp.float32)
        flops = 2.0 * n**3
        for name in args.cases:
            try:
                dtype, a_gran, b_gran, precise = cases[name]
                a = jax.jit(quantize, static_argnums=1)(x, QuantSpec(dtype, a_gran))
                b = jax.jit(quantize, static_argnums=1)(w, QuantSpec(dtype, b_gran))
                acc = jnp.int32 if dtype == "int8" else jnp.bfloat16
                unscaled = jax.jit(lambda p, q, acc=acc: lax.dot_general(p, q, dims, preferred_element_type=acc))
                reference = jax.jit(lambda p, q: scaled_matmul(p, q, jnp.bfloat16, precise))
                configs = [None]
                if args.sweep:
                    base = gemm_config.default_config(a, b, precise)
                    configs += [dataclasses.replace(base, grid_tile_width=w_, grid_minor_dim=d)
                                for w_ in (4, 16) for d in (0, 1)]
                    configs += [dataclasses.replace(base, max_concurrent_steps=base.max_concurrent_steps - 1)]
                    configs += [dataclasses.replace(base, cluster_m=3 - base.cluster_m)]
                    if base.tile_k == 256 and base != gemm_config.ROW_CONFIG:  # one 128-K block per step (block mode)
                        configs += [dataclasses.replace(base, tile_k=128, max_concurrent_steps=5)]
                    # 128 x 256 CTA tiles (wgmma N=256); 4 stages overflow SMEM by ~100 bytes
                    if base == gemm_config.ROW_CONFIG:
                        configs += [dataclasses.replace(base, tile_m=64, tile_n=256, max_concurrent_steps=3)]
                ref_out = reference(a, b)
                t_xla, t_ref = seconds(unscaled, a.data, b.data), seconds(reference, a, b)
                for config in configs:
                    kernel = jax.jit(functools.partial(mg.scaled_matmul_kernel, out_dtype=jnp.bfloat16, config=config,
                                                         precise_accumulation=precise, interpret=args.interpret))
                    out = kernel(a, b).astype(jnp.float32)
                    err = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out.astype(jnp.float32)))
                    t_kernel = seconds(kernel, a, b)
                    label = name if config is None else (
                        f"  {config.tile_m}x{config.tile_n}x{config.tile_k} s{config.max_concurrent_steps} "
                        f"d{config.grid_minor_dim}w{config.grid_tile_width} c{config.cluster_m}")
                    say(f"{label:34} {n:5} {flops / t_kernel / 1e12:7.0f} {flops / t_xla / 1e12:12.0f} "
                        f"{flops / t_ref / 1e12:9.0f} {t_xla / t_kernel:10.2f} {err:8.1e}")
            except Exception as e:  # keep the other cases' numbers
                say(f"{name:34} {n:5} FAILED: {type(e).__name__}: {str(e)[:400]}")


def quantize_table(argv):
    """GPU: device time of the quantize kernels against XLA's copy of the same x, at the shapes of the 1.1B Llama.

    python benchmarks/kernels.py quantize [--shapes 16384x2048 16384x11264] [--interpret]

    Each case runs as one jit of --batch calls on distinct copies of x, dispatched --calls times back to back and
    timed to the last result (median of --rounds), per call: dispatching one call at a time timed the host (~50 us
    per call; a 43 us XLA row max read 50 us that way). GB/s: the bytes the kernels move (x
    read once per pass, so twice for a row-scaled pair; 8-bit outputs written once; XLA rows counted the same) over
    the time; "x copy": the time over XLA's x * 2 (read + write of x) in the same process. Kernel outputs are the GPU
    tests' business (tests/kernels, bit-exact against the reference); here the one- and two-slot tile kernels are
    checked equal to each other before they are timed.
    """
    parser = argparse.ArgumentParser(prog="kernels.py quantize", description=quantize_table.__doc__)
    parser.add_argument("--shapes", nargs="+", default=["16384x2048", "16384x5632", "16384x11264"])
    parser.add_argument("--batch", type=int, default=8, help="calls of the op inside one jit (distinct inputs)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (times meaningless)")
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "gpu" and not args.interpret:
        sys.exit("the benchmark needs a Hopper GPU (or --interpret with small --shapes, e.g. 256x256)")
    interpret = resolve_interpret(args.interpret)  # the private _tile_call takes it resolved

    def seconds(fn, inputs):
        return common.batched_seconds(fn, inputs, args.rounds, args.calls)

    int8_row, e4m3_block = QuantSpec("int8", "row"), QuantSpec("e4m3", "1x128")
    int8_row_sr = QuantSpec("int8", "row", stochastic=True)
    e4m3_tensor = QuantSpec("e4m3", "tensor")
    seed = jnp.uint32(7)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; one jit of {args.batch} calls on distinct "
          f"inputs, {args.calls} back to back, median of {args.rounds}", flush=True)
    print(f"{'x':>13} {'case':46} {'us':>9} {'GB/s':>7} {'x copy':>7}", flush=True)
    for shape in args.shapes:
        m, k = (int(d) for d in shape.split("x"))
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        xs = [x + jnp.bfloat16(i) for i in range(args.batch)]  # distinct: XLA cannot merge the calls
        n = m * k
        pair = lambda spec: jax.jit(lambda x: quantize_mgpu.quantize_pair_kernel(x, spec, spec, seed, seed,
                                                                              interpret=interpret))
        reference = lambda spec: jax.jit(lambda x: (quantize_with_seed(x, spec, seed),
                                                    quantize_with_seed(x.T, spec, seed)))
        inverse_rows, inverse_cols = jnp.full((m,), 10.0), jnp.full((k,), 10.0)
        side = quantize_mgpu._Side.of(int8_row)
        tiles = {slots: jax.jit(lambda x, slots=slots: quantize_mgpu._tile_call(
            x, jnp.zeros((3,), jnp.uint32), inverse_rows, inverse_cols, row=side, col=side, masked=False,
            steps=quantize_mgpu.TILES_PER_PROGRAM, out_slots=slots, interpret=interpret)) for slots in (1, 2)}
        one, two = (jax.tree.leaves(tiles[slots](x)) for slots in (1, 2))
        if not all(bool(jnp.all(a == b)) for a, b in zip(one, two)):
            print(f"{shape:>13} one- and two-slot tile kernels DIFFER: not timed", flush=True)
            continue
        # name -> (function, bytes moved: x (2 B/element) read once per pass, 8-bit outputs written once)
        cases = {"copy: XLA x * 2": (jax.jit(lambda x: x * 2), 4 * n),
                 "read: XLA row max": (jax.jit(lambda x: jnp.max(x, axis=1)), 2 * n),
                 "read: XLA tensor amax (quantize.amax)": (jax.jit(lambda x: amax(x.astype(jnp.float32), "tensor")),
                                                           2 * n),
                 "amax kernel (row + column amax)": (jax.jit(functools.partial(
                     quantize_mgpu.amax_pair, interpret=interpret)), 2 * n),
                 "tile kernel int8 row pair, 1 out slot": (tiles[1], 4 * n),
                 "tile kernel int8 row pair, 2 out slots": (tiles[2], 4 * n),
                 "int8 row pair: amax + tile kernels": (pair(int8_row), 6 * n),
                 "int8 row pair: XLA reference": (reference(int8_row), 6 * n),
                 "int8 row pair, SR: amax + tile kernels": (pair(int8_row_sr), 6 * n),
                 "e4m3 tensor pair: XLA amax + tile kernel": (pair(e4m3_tensor), 6 * n),
                 "e4m3 tensor pair: XLA quantize + code transpose": (jax.jit(lambda x: dispatch.quantize_pair(
                     x, e4m3_tensor, e4m3_tensor, seed, seed, backend="xla")), 7 * n),
                 "e4m3 1x128 + 128x1 pair: tile kernel": (pair(e4m3_block), 4 * n + n // 16),
                 "e4m3 1x128 + 128x1 pair: XLA reference": (reference(e4m3_block), 4 * n + n // 16),
                 "SR cast bf16 -> e5m2: kernel": (jax.jit(lambda x: stochastic_cast_mgpu.stochastic_cast(
                     x, jnp.float8_e5m2, seed, interpret=interpret)), 3 * n),
                 "SR cast bf16 -> e5m2: XLA reference": (jax.jit(lambda x: stochastic.stochastic_round_with_seed(
                     x, jnp.float8_e5m2, seed)), 3 * n)}
        copy = None
        for name, (fn, moved) in cases.items():
            try:
                t = seconds(fn, xs)
                copy = t if name.startswith("copy") else copy
                ratio = f"{t / copy:7.2f}" if copy else f"{'-':>7}"
                print(f"{shape:>13} {name:46} {t * 1e6:9.1f} {moved / t / 1e9:7.0f} {ratio}", flush=True)
            except Exception as e:  # keep measuring the other cases
                print(f"{shape:>13} {name:46} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


def swiglu_table(argv):
    """GPU: the fused SwiGLU kernels of the data-flow recipes (qjax.kernels.swiglu_mgpu) against XLA's composition
    (SwiGLU + prologue.save forward, prologue.restore + SwiGLU's backward) and a copy, at the 1.1B Llama's input.

    python benchmarks/kernels.py swiglu [--shapes 16384x5632] [--tiles 2048 4096 8192] [--interpret] [--no-record]

    Shapes are tokens x F (gate_up is tokens x 2F, bf16). Timed as `kernels.py quantize`: one jit of --batch calls
    on distinct inputs, --calls back to back, median of --rounds, per call. GB/s: the bytes a direction must move
    at least, counted the same for kernel and XLA rows: the forward reads gate_up (4 bytes per token and feature of
    h) and writes h (2), codes (2) and scales (8 / g); the backward reads codes (2), scales (8 / g) and dh (2) and
    writes d(gate_up) (4). "of copy": that rate over XLA's gate_up * 2 (read + write) in the same process (the
    issue's target: >= 0.80). Before timing, each kernel's outputs are compared with the reference's: codes and
    scales must be equal; "differ" counts h / d(gate_up) elements whose bits differ (ulps of exp).
    """
    parser = argparse.ArgumentParser(prog="kernels.py swiglu", description=swiglu_table.__doc__)
    parser.add_argument("--shapes", nargs="+", default=["16384x5632"])
    parser.add_argument("--tiles", type=int, nargs="+", default=[swiglu_mgpu.TILE_ELEMENTS],
                        help="gate elements per program (swiglu_mgpu.TILE_ELEMENTS is the default)")
    parser.add_argument("--batch", type=int, default=4, help="calls of the op inside one jit (distinct inputs)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (times meaningless)")
    parser.add_argument("--no-record", action="store_true", help="print only, do not record results")
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "gpu" and not args.interpret:
        sys.exit("the benchmark needs a Hopper GPU (or --interpret with small --shapes, e.g. 8x256)")

    def seconds(fn, inputs):
        return common.batched_seconds(fn, inputs, args.rounds, args.calls)

    def differ(a, b):
        return int(jnp.sum(lax.bitcast_convert_type(a, jnp.uint16) != lax.bitcast_convert_type(b, jnp.uint16)))

    rows = [f"{jax.devices()[0].device_kind}, jax {jax.__version__}; one jit of {args.batch} calls on distinct inputs, "
            f"{args.calls} back to back, median of {args.rounds}", "",
            "| tokens x F | saved | case | us | GB/s | of copy | differ |", "|---|---|---|---:|---:|---:|---:|"]
    print(rows[0], flush=True)
    interpret = resolve_interpret(args.interpret)
    for shape in args.shapes:
        m, f = (int(d) for d in shape.split("x"))
        x = jax.random.normal(jax.random.key(0), (m, 2 * f), jnp.bfloat16)
        xs = [(x + jnp.bfloat16(i),) for i in range(args.batch)]  # distinct: XLA cannot merge the calls
        copy = seconds(lambda x: x * 2, xs)
        rows.append(f"| {shape} | - | copy: XLA gate_up * 2 | {copy * 1e6:.1f} | {8 * m * f / copy / 1e9:.0f} | 1.00 | |")
        print(rows[-1], flush=True)
        for spec, group in ((QuantSpec("int8", "row"), 32), (QuantSpec("e4m3", "row"), 16)):
            saved_name = f"{spec.dtype} 1x{group}"
            moved = m * f * (8 + 8 / group)  # forward and backward alike (docstring)
            reference_forward = jax.jit(lambda x: (ops.SWIGLU.forward(x)[0], prologue.save(x, spec, group)))
            h_ref, saved_ref = reference_forward(x)
            dh = (h_ref * 0.1).astype(jnp.bfloat16)
            dhs = [(saved_ref, dh + jnp.bfloat16(i)) for i in range(args.batch)]
            x_shape = x.shape
            reference_backward = jax.jit(lambda s, dh: ops.SWIGLU.backward(
                ops.SWIGLU.forward(prologue.restore(s, x_shape, jnp.bfloat16))[1], dh)[0])
            dx_ref = reference_backward(saved_ref, dh)
            cases = [("forward: XLA reference (SwiGLU + save)", reference_forward, xs, moved, ""),
                     ("backward: XLA reference (restore + backward)", reference_backward, dhs, moved, "")]
            for tile in args.tiles:
                try:
                    forward = jax.jit(lambda x, tile=tile: swiglu_mgpu.swiglu_quantize(
                        x, spec, group, interpret=interpret, tile_elements=tile))
                    backward = jax.jit(lambda s, dh, tile=tile: swiglu_mgpu.swiglu_backward(
                        s, dh, interpret=interpret, tile_elements=tile))
                    h, saved = forward(x)
                    if not (bool(jnp.all(saved.data == saved_ref.data)) and bool(jnp.all(saved.scale == saved_ref.scale))):
                        print(f"{shape} {saved_name} tile {tile}: codes or scales DIFFER from the reference: not timed")
                        continue
                    cases += [(f"forward: kernel, tile {tile}", forward, xs, moved, differ(h, h_ref)),
                              (f"backward: kernel, tile {tile}", backward, dhs, moved,
                               differ(backward(saved_ref, dh), dx_ref))]
                except Exception as e:  # keep the other cases' numbers
                    print(f"{shape} {saved_name} tile {tile}: FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
            for name, fn, inputs, moved, mismatches in cases:
                try:
                    t = seconds(fn, inputs)
                    rate = moved / t
                    rows.append(f"| {shape} | {saved_name} | {name} | {t * 1e6:.1f} | {rate / 1e9:.0f} | "
                                f"{rate / (8 * m * f / copy):.2f} | {mismatches} |")
                    print(rows[-1], flush=True)
                except Exception as e:
                    print(f"{shape} {saved_name} {name}: FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
    if not args.interpret and not args.no_record:
        common.record_results("Fused SwiGLU kernels (data flow)", "\n".join(rows[2:]) + "\n\n" + rows[0] + "\n")


def rmsnorm_table(argv):
    """GPU: the fused RMSNorm kernel (norm + the 8-bit save of its input) against its XLA reference and XLA's copy
    of x, and the backward the library runs (XLA: restore from the codes + the norm's backward), bf16 x / y / dy,
    float32 norm scale, at the 1.1B and 8B widths.

    python benchmarks/kernels.py rmsnorm [--shapes 16384x2048 16384x4096] [--rows-per-program 4 32] [--interpret]

    Timed as the quantize table is (one jit of --batch calls on distinct inputs, --calls back to back, median of
    --rounds, per call). Bytes: what the op must move: forward x read (2 B/element), y written (2), codes (1) and
    scales (4/g); backward codes (1), scales (4/g) and dy (2) read, dx written (2). "of copy": those bytes per second
    over XLA's x * 2 (4 B/element in 1 pass) per second. Before a shape is timed, the kernel's outputs are checked
    against the reference (codes and scales equal; the normwise relative error of y: the "check" column).
    """
    parser = argparse.ArgumentParser(prog="kernels.py rmsnorm", description=rmsnorm_table.__doc__)
    parser.add_argument("--shapes", nargs="+", default=["16384x2048", "16384x4096"])
    parser.add_argument("--batch", type=int, default=8, help="calls of the op inside one jit (distinct inputs)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows-per-program", type=int, nargs="+", default=[rmsnorm_mgpu.ROWS_PER_PROGRAM],
                        help="kernel rows for each of these (rmsnorm_mgpu's tuning knob)")
    parser.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (times meaningless)")
    parser.add_argument("--no-record", action="store_true", help="print only, do not record results")
    args = parser.parse_args(argv)
    if jax.devices()[0].platform != "gpu" and not args.interpret:
        sys.exit("the benchmark needs a Hopper GPU (or --interpret with small --shapes, e.g. 64x256)")
    eps, dtype = 1e-5, jnp.bfloat16

    def seconds(fn, inputs):
        return common.batched_seconds(fn, inputs, args.rounds, args.calls)

    lines = [f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; one jit of {args.batch} calls on "
             f"distinct inputs, {args.calls} back to back, median of {args.rounds}", "",
             f"| x | case | us | GB/s | of copy | check |", "|---|---|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    for shape in args.shapes:
        m, d = (int(v) for v in shape.split("x"))
        n = m * d
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (m, d), dtype)
        scale = 1 + 0.1 * jax.random.normal(keys[1], (d,))
        dy = jax.random.normal(keys[2], (m, d), dtype)
        # the backward `prologue.prologue_dot` runs for the norm: restore x from the codes, the norm's backward
        op = ops.rms_norm_prologue(eps, dtype)
        backward = jax.jit(lambda saved, scale, dy: op.backward(op.forward(
            prologue.restore(saved, x.shape, x.dtype), scale)[1], dy))
        rows = [("copy: XLA x * 2", jax.jit(lambda x: x * 2), [(x + i,) for i in range(args.batch)], 4 * n, "")]
        for spec, group in ((QuantSpec("int8"), 32), (QuantSpec("e4m3"), 16)):
            label = f"{spec.dtype} g{group}"
            forwards = {rows: jax.jit(lambda x, scale, spec=spec, group=group, rows=rows: rmsnorm_mgpu.forward_saving(
                x, scale, eps=eps, dtype=dtype, spec=spec, group=group, interpret=args.interpret,
                rows_per_program=rows)) for rows in args.rows_per_program}
            forward = forwards[args.rows_per_program[0]]
            # the composition the model's hook falls back to (ops.rms_norm_prologue)
            forward_ref = jax.jit(lambda x, scale, spec=spec, group=group: ops._rms_norm_saving_reference(
                eps, dtype, x, scale, spec, group))
            (y, saved), (y_ref, saved_ref) = forward(x, scale), forward_ref(x, scale)
            codes_equal = bool(jnp.all(saved.data == saved_ref.data) & jnp.all(saved.scale == saved_ref.scale))
            error = float(jnp.linalg.norm((y.astype(jnp.float32) - y_ref.astype(jnp.float32)).ravel())
                          / jnp.linalg.norm(y_ref.astype(jnp.float32).ravel()))
            check = f"codes {'equal' if codes_equal else 'DIFFER'}; relative error y {error:.1e}"
            moved = 5 * n + 4 * n // group  # forward and backward alike (docstring)
            xs = [(x + i, scale) for i in range(args.batch)]
            saveds = [(forward_ref(x + i, scale)[1], scale, dy + i) for i in range(args.batch)]
            rows += [(f"forward {label}: kernel, {r} rows/program", forwards[r], xs, moved,
                      check if r == args.rows_per_program[0] else "") for r in args.rows_per_program]
            rows += [(f"forward {label}: XLA reference", forward_ref, xs, moved, "")]
            rows += [(f"backward {label}: XLA (restore + norm backward)", backward, saveds, moved, "")]
        copy_rate = None
        for name, fn, inputs, moved, check in rows:
            try:
                t = seconds(fn, inputs)
                copy_rate = moved / t if name.startswith("copy") else copy_rate
                rate = moved / t
                line = f"| {shape} | {name} | {t * 1e6:.1f} | {rate / 1e9:.0f} | {rate / copy_rate:.2f} | {check} |"
            except Exception as e:  # keep measuring the other cases
                line = f"| {shape} | {name} | FAILED: {type(e).__name__}: {str(e)[:300]} | | | |"
            lines.append(line)
            print(line, flush=True)
    if not args.interpret and not args.no_record:  # CPU times are no results
        common.record_results("Fused RMSNorm kernel (norm + 8-bit save; XLA's backward from the codes)",
                              "\n".join(lines) + "\n")


def main():
    commands = {"gemm": gemm_table, "quantize": quantize_table, "swiglu": swiglu_table,
                "rmsnorm": rmsnorm_table}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
