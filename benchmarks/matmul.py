"""Square GEMM throughput (TFLOP/s) per operand format and layout: the seed's matmul table.

  python benchmarks/matmul.py                       # GPU: sizes 1024..8192, every row, three layouts
  python benchmarks/matmul.py --small --no-record   # CPU smoke test (sizes 128, 256)
  python benchmarks/matmul.py --rows int8 int8_row_kernel --sizes 8192 --layouts TN

Rows (ids for --rows):
  bf16, int8, fp8             XLA dot_general: bf16 -> bf16, int8 -> int32, e4m3 -> bf16, in three layouts
  int8_row, fp8_row           qjax.kernels.scaled_matmul.scaled_matmul on row-scaled QTensors -> bf16
  int8_block, fp8_block       the same on block-scaled operands (A 1x128, B 128x128) -> bf16
  *_kernel                    qjax.kernels.scaled_matmul_mgpu.scaled_matmul_kernel (Mosaic GPU) on the same
                              operands, when that module exists and its `supports` accepts the case
Layouts: TN = A.B^T (A (M,K), B (N,K): both operands K-major), NN = A.B (B (K,N)), TT = A^T.B (A (K,M), B (K,N)).
The qjax and kernel rows exist only as A.B^T: QTensors keep the contracting dim last by construction.

Before timing, every cell is checked against its reference on the same inputs: XLA rows against a float32 GEMM of
the same (upcast) operands, qjax and kernel rows against `scaled_matmul`, run separately under jit. A cell below
--min-snr dB is reported as failed and not timed. Time = median over --reps samples after warm-up, each several
calls dispatched back to back (at least 4; more for small sizes; common.time_ms). "% of peak": against the best
number measured in this run for the same operand dtype (bf16, int8 or fp8), any row, layout or size.
"""

import argparse
import functools
import importlib
import time

import jax
import jax.numpy as jnp
from jax import lax

from common import record_results, device_kind, snr_db, time_ms
from qjax.kernels.scaled_matmul import scaled_matmul
from qjax.quantize import QuantSpec, quantize

LAYOUTS = {  # id -> (name, dot_general dimension numbers for (n, n) x (n, n) operands)
    "TN": ("A.B^T", (((1,), (1,)), ((), ()))),
    "NN": ("A.B", (((1,), (0,)), ((), ()))),
    "TT": ("A^T.B", (((0,), (0,)), ((), ()))),
}
XLA_ROWS = {"bf16": ("bf16", jnp.bfloat16, jnp.bfloat16), "int8": ("int8", jnp.int8, jnp.int32),
            "fp8": ("fp8 e4m3", jnp.float8_e4m3fn, jnp.bfloat16)}  # id -> (label, operand dtype, output dtype)
QJAX_ROWS = {"int8_row": ("int8", "row", "row"), "fp8_row": ("e4m3", "row", "row"),
             "int8_block": ("int8", "1x128", "128x128"), "fp8_block": ("e4m3", "1x128", "128x128")}
KERNEL_ROWS = {f"{name}_kernel": spec for name, spec in QJAX_ROWS.items()}
ROWS = [*XLA_ROWS, *QJAX_ROWS, *KERNEL_ROWS]
KERNEL_MODULE = "qjax.kernels.scaled_matmul_mgpu"


def label(row):
    if row in XLA_ROWS:
        return XLA_ROWS[row][0]
    dtype, a_gran, _ = QJAX_ROWS[row.removesuffix("_kernel")]
    kind = "row-scaled" if a_gran == "row" else "block-scaled"
    return f"{kind} {'int8' if dtype == 'int8' else 'fp8'} ({'kernel' if row in KERNEL_ROWS else 'qjax'})"


def fmt(tflops):
    """Whole TFLOP/s on a GPU; three significant digits for the tiny CPU numbers of --small."""
    return f"{tflops:.0f}" if tflops >= 100 else f"{tflops:.3g}"


def dtype_group(row):
    """Which measured peak a row is compared with."""
    return "bf16" if row == "bf16" else "int8" if row.startswith("int8") else "fp8"


def load_kernel():
    """The Mosaic GPU scaled-GEMM module, or None with the reason printed."""
    try:
        return importlib.import_module(KERNEL_MODULE)
    except ImportError as e:
        print(f"kernel rows: {KERNEL_MODULE} unavailable ({e})", flush=True)
        return None


def xla_case(row, layout, n, key):
    """(jitted fn, args, jitted reference) for an XLA row: random operands in the layout's shapes."""
    _, dtype, out_dtype = XLA_ROWS[row]
    dims = LAYOUTS[layout][1]
    a_shape = (n, n)  # square: every layout has the same operand shapes, only the contracting dims differ
    ka, kb = jax.random.split(key)
    if dtype == jnp.int8:
        a, b = (jax.random.randint(k, a_shape, -127, 128, jnp.int32).astype(jnp.int8) for k in (ka, kb))
    else:
        a, b = (jax.random.normal(k, a_shape, jnp.float32).astype(dtype) for k in (ka, kb))
    fn = jax.jit(functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=out_dtype))
    ref = jax.jit(lambda a, b: lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                                               precision=lax.Precision.HIGHEST))
    return fn, (a, b), ref


def quantized_case(row, n, key, kernel_module, interpret):
    """(jitted fn, (a, b) QTensors, jitted scaled_matmul reference), or a string saying why the case is skipped."""
    dtype, a_gran, b_gran = QJAX_ROWS[row.removesuffix("_kernel")]
    ka, kb = jax.random.split(key)
    a = quantize(jax.random.normal(ka, (n, n), jnp.bfloat16), QuantSpec(dtype, a_gran))
    b = quantize(jax.random.normal(kb, (n, n), jnp.bfloat16), QuantSpec(dtype, b_gran))
    reference = jax.jit(functools.partial(scaled_matmul, out_dtype=jnp.bfloat16))
    if row in QJAX_ROWS:
        return reference, (a, b), reference
    if kernel_module is None:
        return "kernel module unavailable"
    reason = kernel_module.supports(a, b, jnp.bfloat16)
    if reason:
        return f"not supported: {reason}"
    fn = jax.jit(functools.partial(kernel_module.scaled_matmul_kernel, out_dtype=jnp.bfloat16, interpret=interpret))
    return fn, (a, b), reference


def run(rows, layouts, sizes, reps, warmup, min_snr, interpret):
    """{(row, layout): {n: TFLOP/s or a string why not}}, {(row, layout): min SNR dB}."""
    kernel_module = load_kernel() if any(r in KERNEL_ROWS for r in rows) else None
    tflops, snrs = {}, {}
    start = time.perf_counter()
    for n in sizes:
        # At least 4 calls per sample: one ~1 ms 8192^3 GEMM waited for at a time also timed the host's dispatch
        # and wake-up (H200: fp8 1150 TFLOP/s that way, 1363 with 5 calls per sample in kernels.py gemm).
        inner = min(64, max(4, (4096 // n) ** 3))
        for layout in layouts:
            for row in rows:
                if row not in XLA_ROWS and layout != "TN":
                    continue  # quantized operands are K-major by construction: A.B^T only
                key = jax.random.key(n)
                case = (xla_case(row, layout, n, key) if row in XLA_ROWS
                        else quantized_case(row, n, key, kernel_module, interpret))
                cell = tflops.setdefault((row, layout), {})
                if isinstance(case, str):
                    cell[n] = case
                    print(f"  {label(row):28s} {layout} {n:5d}  skipped: {case}", flush=True)
                    continue
                fn, args, ref = case
                try:
                    snr = snr_db(ref(*args), fn(*args))
                except Exception as e:  # a failing kernel must not lose the other rows' numbers
                    cell[n] = f"error: {type(e).__name__}"
                    print(f"  {label(row):28s} {layout} {n:5d}  ERROR: {type(e).__name__}: {e}", flush=True)
                    continue
                snrs[(row, layout)] = min(snrs.get((row, layout), float("inf")), snr)
                if not snr >= min_snr:  # also catches NaN
                    cell[n] = f"check failed: {snr:.1f} dB"
                    print(f"  {label(row):28s} {layout} {n:5d}  CHECK FAILED: SNR {snr:.1f} dB < {min_snr}",
                          flush=True)
                    continue
                if interpret and row in KERNEL_ROWS:
                    cell[n] = f"ok, {snr:.0f} dB (interpreted, not timed)"
                    print(f"  {label(row):28s} {layout} {n:5d}  check {snr:6.1f} dB (interpreted: not timed)",
                          flush=True)
                    continue
                ms = time_ms(fn, args, warmup, reps, inner)
                cell[n] = 2 * n**3 / ms / 1e9
                print(f"  {label(row):28s} {layout} {n:5d}  {fmt(cell[n]):>8s} TFLOP/s  {ms:8.4f} ms  "
                      f"check {snr:6.1f} dB  [{time.perf_counter() - start:5.0f} s]", flush=True)
    return tflops, snrs


def table(tflops, snrs, sizes):
    peaks = {}
    for (row, _), cells in tflops.items():
        for value in cells.values():
            if not isinstance(value, str):
                peaks[dtype_group(row)] = max(peaks.get(dtype_group(row), 0.0), value)
    lines = ["| row | layout | " + " | ".join(f"{n}" for n in sizes) + " | check (min SNR) |",
             "|---|---|" + "---:|" * len(sizes) + "---:|"]
    for (row, layout), cells in tflops.items():
        out = []
        for n in sizes:
            value = cells.get(n, "—")
            peak = peaks.get(dtype_group(row))
            out.append(value if isinstance(value, str) else f"{fmt(value)} ({100 * value / peak:.0f}%)")
        snr = snrs.get((row, layout))
        lines.append(f"| {label(row)} | {LAYOUTS[layout][0]} | " + " | ".join(out)
                     + f" | {'—' if snr is None else f'{snr:.1f} dB'} |")
    peak_text = ", ".join(f"{group} {fmt(value)}" for group, value in peaks.items()) or "none timed"
    return ("\n".join(lines) + f"\n\nSquare n×n×n GEMMs, TFLOP/s = 2n³/time (percent of the best measured number of "
            f"the same operand dtype in this run: {peak_text} TFLOP/s). XLA rows: bf16→bf16, int8→int32, "
            "e4m3→bf16. qjax/kernel rows: scaled operands → bf16, A.B^T only (QTensors are K-major by "
            "construction); quantization is not timed. Checks: XLA rows vs a float32 GEMM of the same operands, "
            "qjax/kernel rows vs `scaled_matmul`.\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="sizes 128 and 256 (default when no GPU is present)")
    parser.add_argument("--sizes", nargs="*", type=int, help="square sizes (default 1024 2048 4096 8192)")
    parser.add_argument("--rows", nargs="*", choices=ROWS, metavar="ROW",
                        help=f"rows to run (default: all; off the GPU all but the kernel rows): {' '.join(ROWS)}")
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=list(LAYOUTS),
                        help="XLA layouts: TN = A.B^T, NN = A.B, TT = A^T.B (default all)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-snr", type=float, default=30.0, help="dB a cell must reach against its reference")
    parser.add_argument("--no-record", action="store_true", help="do not record results")
    args = parser.parse_args()
    gpu = jax.default_backend() == "gpu"
    small = args.small or not gpu
    rows = args.rows
    if rows is None:
        # Off the GPU a Mosaic GPU kernel runs only under its interpreter (~1 s a call at n=128): name the kernel
        # rows in --rows to check them there; they are checked, not timed.
        rows = ROWS if gpu else [r for r in ROWS if r not in KERNEL_ROWS]
        if not gpu:
            print("kernel rows: not run off the GPU unless named in --rows (interpreted there: checked, not timed)")
    sizes = args.sizes or ([128, 256] if small else [1024, 2048, 4096, 8192])
    if any(n % 128 for n in sizes) and any("block" in r for r in rows):
        parser.error("block-scaled rows need sizes that are multiples of 128")
    reps = min(args.reps, 3) if small else args.reps
    print(f"matmul on {device_kind()} ({jax.default_backend()}), jax {jax.__version__}, sizes {sizes}", flush=True)
    tflops, snrs = run(rows, args.layouts, sizes, reps, args.warmup, args.min_snr, interpret=not gpu)
    report = table(tflops, snrs, sizes)
    print("\n" + report)
    if not args.no_record:
        record_results("matmul TFLOP/s", report)


if __name__ == "__main__":
    main()
