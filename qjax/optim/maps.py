"""Quantization maps (code books) for optimizer states, and nearest-code encoding.

A map is a sorted float32 table of 2**bits values in [-1, 1]; a state block is stored as indices into it (codes)
plus its absmax, and decodes as `qmap[code] * absmax`.

  DYNAMIC_SIGNED_8BIT     dynamic tree map, signed, 7 exponent levels: Adam's first moment m (bitsandbytes, torchao)
  DYNAMIC_UNSIGNED_8BIT   dynamic tree map, unsigned, 7 levels: second moment v
  DYNAMIC_SIGNED_4BIT     signed dynamic-exponent map with 3 exponent bits: [-0.8875, ..., 0, ..., 0.8875, 1.0]
  LINEAR_UNSIGNED_4BIT    1/16, 2/16, ..., 1 (no zero: v's small values are rounded up, never to 0, so that
                          1/sqrt(v) does not blow up; torchao's 4-bit v map)

The dynamic map's defining formula (Dettmers 2016, bitsandbytes `create_dynamic_map`): with E = max exponent bits and
S = total_bits - 1 non-sign bits, for each level i = 0..E-1 take n_i = 2**(i + S - E) (signed) or 2**(i + S - E + 1)
(unsigned) equal sub-intervals of [0.1, 1], i.e. boundaries b_j = 0.1 + 0.9 j / n_i; their midpoints times
10**(i - E + 1) are the positive values (negated copies too if signed); then 0 and 1.0 are added and the list sorted.
We evaluate it in float64 and round each value once to float32. (bitsandbytes evaluates linspace and the midpoints
in float32 first, which can move a value by about one float32 ulp; the code books are otherwise identical.)

Encoding is nearest-code: `code = argmin_j |x - qmap[j]|` computed in float32, ties to the lower index, which is
what a brute-force argmin returns. `encode_nearest` gets the same answer with a binary search (bits gathers) and a
final comparison of the two bracketing codes.
"""

import numpy as np
import jax
import jax.numpy as jnp


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """The dynamic (tree) quantization map: sorted float32 array of 2**total_bits values (see module docstring)."""
    if total_bits not in (4, 8):
        raise ValueError(f"total_bits must be 4 or 8, got {total_bits}")
    non_sign_bits = total_bits - 1
    if not 1 <= max_exponent_bits <= non_sign_bits:
        raise ValueError(f"max_exponent_bits must be in [1, {non_sign_bits}], got {max_exponent_bits}")
    values = [0.0, 1.0]
    # Extra values when fewer exponent bits than non-sign bits leave an all-zero-exponent level (bitsandbytes'
    # "additional_items"): they reuse the last level's decade.
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    levels = [(i, 2 ** (i + non_sign_bits - max_exponent_bits + (0 if signed else 1)))
              for i in range(max_exponent_bits)]
    if additional > 0:
        levels.append((max_exponent_bits - 1, additional))
    for i, n in levels:
        boundaries = 0.1 + 0.9 * np.arange(n + 1, dtype=np.float64) / n
        means = (boundaries[:-1] + boundaries[1:]) / 2.0 * 10.0 ** (i - max_exponent_bits + 1)
        values += means.tolist()
        if signed:
            values += (-means).tolist()
    out = np.sort(np.asarray(values, dtype=np.float64)).astype(np.float32)
    if out.size != 2**total_bits:
        raise ValueError(f"signed={signed}, max_exponent_bits={max_exponent_bits}, total_bits={total_bits} "
                         f"gives {out.size} values, not {2**total_bits}")
    return out


def linear_map(n: int = 16, include_zero: bool = False) -> np.ndarray:
    """k/n for k = 1..n (or 0..n-1 and 1 with include_zero: then n values from 0 to 1) as float32."""
    if include_zero:
        return (np.arange(n, dtype=np.float64) / (n - 1)).astype(np.float32)
    return (np.arange(1, n + 1, dtype=np.float64) / n).astype(np.float32)


def _frozen(a):
    a.setflags(write=False)
    return a


DYNAMIC_SIGNED_8BIT = _frozen(dynamic_map(signed=True, max_exponent_bits=7, total_bits=8))
DYNAMIC_UNSIGNED_8BIT = _frozen(dynamic_map(signed=False, max_exponent_bits=7, total_bits=8))
DYNAMIC_SIGNED_4BIT = _frozen(dynamic_map(signed=True, max_exponent_bits=3, total_bits=4))
LINEAR_UNSIGNED_4BIT = _frozen(linear_map(16, include_zero=False))

MAPS = {
    "dynamic_signed_8bit": DYNAMIC_SIGNED_8BIT,
    "dynamic_unsigned_8bit": DYNAMIC_UNSIGNED_8BIT,
    "dynamic_signed_4bit": DYNAMIC_SIGNED_4BIT,
    "linear_unsigned_4bit": LINEAR_UNSIGNED_4BIT,
}


def get_map(name: str) -> np.ndarray:
    """A named map from MAPS."""
    if name not in MAPS:
        raise ValueError(f"unknown quantization map {name!r}; use one of {sorted(MAPS)}")
    return MAPS[name]


def encode_nearest(x: jax.Array, qmap) -> jax.Array:
    """Nearest code of each element of float32 `x` in the sorted map `qmap` (2**bits values): uint8, x's shape.

    Equals `argmin_j |x - qmap[j]|` in float32 with ties to the lower index. NaN encodes as code 0 (callers keep NaN
    visible through the block's absmax, which is then NaN).
    """
    table = jnp.asarray(qmap, jnp.float32)
    size = table.shape[0]
    if size & (size - 1):
        raise ValueError(f"map size must be a power of two, got {size}")
    x = x.astype(jnp.float32)
    # lo = largest j with qmap[j] <= x (0 when x < qmap[0]); one gather per bit.
    # The first step compares against one known entry: gathering at a constant index array would make XLA
    # constant-fold a gather the size of x (minutes of compile time for a 1B-parameter model).
    step = size // 2
    lo = jnp.where(x >= table[step], step, 0).astype(jnp.int32)
    step //= 2
    while step:
        lo = jnp.where(x >= table[lo + step], lo + step, lo)
        step //= 2
    hi = jnp.minimum(lo + 1, size - 1)
    # The same float32 distances a brute-force argmin compares; strict < keeps ties on the lower index.
    go_up = jnp.abs(x - table[hi]) < jnp.abs(x - table[lo])
    return jnp.where(go_up, hi, lo).astype(jnp.uint8)


def encode_brute_force(x: jax.Array, qmap) -> jax.Array:
    """Reference for `encode_nearest`: argmin over the whole map (memory x.size * 2**bits; tests only)."""
    table = jnp.asarray(qmap, jnp.float32)
    dist = jnp.abs(x.astype(jnp.float32)[..., None] - table)
    return jnp.argmin(dist, axis=-1).astype(jnp.uint8)


def decode(codes: jax.Array, qmap) -> jax.Array:
    """codes (uint8, any shape) -> float32 map values of the same shape."""
    return jnp.asarray(qmap, jnp.float32)[codes.astype(jnp.int32)]
