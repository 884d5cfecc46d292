"""Where the stochastic-rounding time of the fused quantize kernel goes (a diagnosis, not a library path).

    python benchmarks/sr_cost.py [--shapes 16384x2048 16384x5632]    # GPU; appends a table to the results JSON
    python benchmarks/sr_cost.py --interpret --shapes 256x256        # CPU smoke test (times meaningless)

The int8 row pair (`quantize_mgpu.quantize_pair_kernel`, amax + tile kernels, both sides stochastic, as
int8_dataflow_sr quantizes the gradients) is timed with rounding to nearest, with the library's stochastic rounding
(`stochastic.paired_bits`: one hash per two elements), and with the kernel's bits swapped at trace time for
variants that exist only to be timed: one hash per element (the library's bits before issue 28), and paired bits
with the hash replaced by index ^ seed (no mixing: what any cheaper hash could at most save). The differences
between rows attribute SR's cost to the hash, the element index and the rounding.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

import common
from qjax import stochastic
from qjax.kernels import quantize_mgpu, resolve_interpret
from qjax.qtensor import QuantSpec

_LIBRARY_BITS, _LIBRARY_HASH = quantize_mgpu._paired_bits, stochastic.hash_uint32


def _element_bits(seed, row0, col0, n_cols, shape):
    """One hash per element, of its row-major index (the kernel's bits before issue 28)."""
    n_rows, n_chunk_cols = shape
    row_starts = (plgpu.broadcasted_iota(jnp.uint32, (n_rows,), 0, layout=quantize_mgpu._ROWS) + row0) * jnp.uint32(
        n_cols)
    cols = plgpu.broadcasted_iota(jnp.uint32, (n_chunk_cols,), 0, layout=quantize_mgpu._COLS) + col0
    index = quantize_mgpu._broadcast_rows(row_starts, shape) + plgpu.layout_cast(
        lax.broadcast_in_dim(cols, shape, (1,)), quantize_mgpu._LAYOUT)
    return stochastic.hash_uint32(seed, index)


def _no_mix(seed, index):
    return jnp.asarray(index, jnp.uint32) ^ jnp.asarray(seed, jnp.uint32)


# name -> (row spec stochastic, col spec stochastic, the kernel's bits function, the hash it calls)
CASES = {
    "round to nearest": (False, False, _LIBRARY_BITS, _LIBRARY_HASH),
    "SR, paired bits (library: 1 hash / 2 elements)": (True, True, _LIBRARY_BITS, _LIBRARY_HASH),
    "SR, 1 hash / element (before issue 28)": (True, True, _element_bits, _LIBRARY_HASH),
    "SR, paired bits, index ^ seed (no mixing)": (True, True, _LIBRARY_BITS, _no_mix),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["16384x2048", "16384x5632"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args()
    if jax.devices()[0].platform != "gpu" and not args.interpret:
        sys.exit("the benchmark needs a Hopper GPU (or --interpret with small --shapes, e.g. 256x256)")
    interpret = resolve_interpret(args.interpret)

    seed = jnp.uint32(7)
    lines = ["| x | int8 row pair (amax + tile kernels) | us | vs nearest | vs 1 hash / element |",
             "|---|---|---:|---:|---:|"]
    for shape in args.shapes:
        m, k = (int(d) for d in shape.split("x"))
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        xs = [x + jnp.bfloat16(i) for i in range(args.batch)]
        times = {}
        for name, (row_sr, col_sr, bits_fn, hash_fn) in CASES.items():
            row_spec = QuantSpec("int8", "row", stochastic=row_sr)
            col_spec = QuantSpec("int8", "row", stochastic=col_sr)
            quantize_mgpu._paired_bits, stochastic.hash_uint32 = bits_fn, hash_fn  # read by the kernel's trace
            quantize_mgpu._tile_call.clear_cache()  # a jit of static args: drop the previous variant's trace
            try:
                fn = lambda x, r=row_spec, c=col_spec: quantize_mgpu.quantize_pair_kernel(
                    x, r, c, seed, seed, interpret=interpret)
                times[name] = common.batched_seconds(fn, xs, args.rounds, args.calls)
            except Exception as e:  # one variant failing to lower must not cost the other rows
                print(f"| {shape} | {name} | failed: {type(e).__name__}: {str(e)[:200]} |", flush=True)
            finally:
                quantize_mgpu._paired_bits, stochastic.hash_uint32 = _LIBRARY_BITS, _LIBRARY_HASH
                quantize_mgpu._tile_call.clear_cache()
        nearest, before = times.get("round to nearest"), times.get("SR, 1 hash / element (before issue 28)")
        for name, t in times.items():
            ratio = lambda base: f"{t / base:.2f}x" if base else "n/a"
            lines.append(f"| {shape} | {name} | {t * 1e6:.1f} | {ratio(nearest)} | {ratio(before)} |")
            print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n\n" + (
        f"One jit of {args.batch} calls on distinct inputs, {args.calls} back to back, median of {args.rounds}, per "
        "call; both sides of the SR rows round stochastically. Only the first two rows are the library's numerics; "
        "the others swap the kernel's bits at trace time to attribute the cost (benchmarks/sr_cost.py).")
    if not args.interpret:
        common.record_results("Stochastic rounding cost in the quantize kernel", report + "\n")


if __name__ == "__main__":
    main()
