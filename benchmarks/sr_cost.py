"""Where the stochastic-rounding time of the fused quantize kernel goes (a diagnosis, not a library path).

    python benchmarks/sr_cost.py [--shapes 16384x2048 16384x5632]    # GPU; appends a table to RESULTS.md
    python benchmarks/sr_cost.py --interpret --shapes 256x256        # CPU smoke test (times meaningless)

The int8 row pair (`quantize_mgpu.quantize_pair_kernel`, amax + tile kernels, both sides stochastic) is timed with
`qjax.stochastic.hash_uint32` swapped at trace time for cheaper mixes, and with rounding to nearest, so the
difference between rows attributes the cost: the hash, the element index, or the rounding. Only the first row
is the library's numerics; the others exist to be timed.
"""

import argparse
import sys

import jax
import jax.numpy as jnp

import common
from qjax import stochastic
from qjax.kernels import quantize_mgpu, resolve_interpret
from qjax.qtensor import QuantSpec

_LIBRARY_HASH = stochastic.hash_uint32


def _one_multiply(seed, index):
    v = (jnp.asarray(index, jnp.uint32) ^ jnp.asarray(seed, jnp.uint32)) * jnp.uint32(0x9E3779B1)
    return v ^ (v >> 16)


def _no_mix(seed, index):
    return jnp.asarray(index, jnp.uint32) ^ jnp.asarray(seed, jnp.uint32)


def _seed_only(seed, index):  # the index is dead code: the rounding alone
    return jnp.broadcast_to(jnp.asarray(seed, jnp.uint32) * jnp.uint32(0x9E3779B1), jnp.shape(index))


HASHES = {"library hash (lowbias32 x 2)": _LIBRARY_HASH, "one multiply + xorshift": _one_multiply,
          "index ^ seed (no mixing)": _no_mix, "seed only (no index)": _seed_only}


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

    def seconds(fn, inputs):
        return common.batched_seconds(fn, inputs, args.rounds, args.calls)

    seed = jnp.uint32(7)
    nearest, sr = QuantSpec("int8", "row"), QuantSpec("int8", "row", stochastic=True)
    lines = ["| x | int8 row pair (amax + tile kernels) | us | vs nearest |", "|---|---|---:|---:|"]
    for shape in args.shapes:
        m, k = (int(d) for d in shape.split("x"))
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        xs = [x + jnp.bfloat16(i) for i in range(args.batch)]
        cases = [("round to nearest", nearest, nearest, _LIBRARY_HASH)]
        cases += [(f"SR both sides, {name}", sr, sr, fn) for name, fn in HASHES.items()]
        cases += [("SR row side only, library hash", sr, nearest, _LIBRARY_HASH),
                  ("SR column side only, library hash", nearest, sr, _LIBRARY_HASH)]
        base = None
        for name, row_spec, col_spec, hash_fn in cases:
            stochastic.hash_uint32 = hash_fn  # read by the kernel's trace (quantize_mgpu._codes)
            quantize_mgpu._tile_call.clear_cache()  # a jit of static args: drop the trace of the previous hash
            try:
                fn = lambda x, r=row_spec, c=col_spec: quantize_mgpu.quantize_pair_kernel(
                    x, r, c, seed, seed, interpret=interpret)
                t = seconds(fn, xs)
            finally:
                stochastic.hash_uint32 = _LIBRARY_HASH
            base = base or t
            lines.append(f"| {shape} | {name} | {t * 1e6:.1f} | {t / base:.2f}x |")
            print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n\n" + (
        f"One jit of {args.batch} calls on distinct inputs, {args.calls} back to back, median of {args.rounds}, per "
        "call. Rows other than the first two swap `stochastic.hash_uint32` for a cheaper mix (not the library's "
        "numerics) to attribute the stochastic-rounding cost.")
    if not args.interpret:
        common.append_results("Stochastic rounding cost in the quantize kernel", report + "\n")


if __name__ == "__main__":
    main()
