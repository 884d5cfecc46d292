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
what a brute-force argmin returns. `encode_nearest` gets the same answer arithmetically (the map's level and affine
position give two candidate codes, one float32 threshold looked up in `codec_table` picks one), without a search
over the table: on a GPU, lookups per element are what a binary search (one per bit) paid for. Kernels, which have
no gather (Mosaic GPU), call `encode_unit` and `codec_table` with their own table lookup. A 4-bit map's codes are
stored two per byte (`pack_4bit` / `unpack_4bit`).
"""

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from qjax import numerics


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


@dataclasses.dataclass(frozen=True)
class _Encoder:
    """Constants of the arithmetic nearest-code encoder of one map (see `encode_nearest`).

    A map value's *position* G is an affine function of its magnitude t on each level (decade of a dynamic map; the
    whole range of a linear map): G = t * level_scale[l] + level_offset[l], where code j of the non-negative half
    sits at G = j + 0.5 (dynamic) or G = j (linear); floor(G - shift) is the candidate code c.
    """

    size: int
    level_bounds: tuple  # float32 magnitudes: t >= level_bounds[l - 1] selects level l (ascending)
    level_scale: tuple
    level_offset: tuple
    nearest_shift: float  # floor(G - nearest_shift) = c with the nearest code in {c, c + 1}
    first_tie_shift: float  # floor(G - first_tie_shift) = c with the first tied code in {c, c + 1} (x > 1)
    mirrored: bool  # signed map: code j < size - 1 holds -(value of code size - 2 - j)
    exponent_bits: int  # dynamic map's E (its levels); 0 for a linear map
    table: np.ndarray  # float32 (2 * size,): pair thresholds T_0..T_{size-2}, 1.0 (unused), then the map itself


def _ordered(f: np.ndarray) -> np.ndarray:
    """float32 -> int64 keys in the order of the floats (-0 and +0 share key 0)."""
    bits = f.view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _unordered(k: np.ndarray) -> np.ndarray:
    bits = np.where(k < 0, (-k) | 0x80000000, k).astype(np.uint32)
    return bits.view(np.float32)


def _pair_thresholds(qmap: np.ndarray) -> np.ndarray:
    """T_j = the smallest float32 x in (qmap[j], qmap[j+1]] with |x - qmap[j+1]| < |x - qmap[j]| in float32.

    The comparison is the brute-force argmin's own (float32 subtraction rounds monotonically, so it is false then
    true as x grows): between the two codes, x >= T_j picks j + 1 and ties stay on j. Bisection over the floats.
    """
    low, high = qmap[:-1], qmap[1:]
    lo, hi = _ordered(low), _ordered(high)  # invariant: lo picks j, hi picks j + 1
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        x = _unordered(mid)
        up = np.abs(x - high) < np.abs(x - low)
        lo, hi = np.where(up, lo, mid), np.where(up, mid, hi)
    return _unordered(hi)


def _dynamic_encoder(qmap: np.ndarray, signed: bool, exponent_bits: int) -> _Encoder:
    # Level i holds n_i values (0.1 + 0.9 (k + 0.5) / n_i) s_i, k < n_i, s_i = 10**(i - E + 1). At position
    # p = (t / s_i - 0.1) n_i / 0.9 value k sits at p = k + 0.5, the level below's last value at p = -0.1, 1.0 at
    # p = n_i. Nearest-code boundaries: integers, 0.2 (with the level below) and n_i - 0.25 (with 1.0), so
    # floor(p - 0.6) brackets each boundary by >= 0.15 on both sides. floor(p) = c has value c within 0.5 of p and
    # values c - 1, c + 1 >= 0.1 away on either side, which brackets the beyond-1 threshold. Decade boundaries need
    # not be exact: within a few ulps of 10**(i - E) both levels give the same c. Global position G = start + p.
    zero = qmap.size // 2 - 1 if signed else 0
    scale, offset, start = [], [], zero + 1
    for i in range(exponent_bits):
        n = 2 ** (i + (0 if signed else 1))
        s = 10.0 ** (i - exponent_bits + 1)
        scale.append(n / (0.9 * s))
        offset.append(start - n / 9.0)  # global position: start of the level + p
        start += n
    bounds = tuple(float(np.float32(10.0 ** (i - exponent_bits))) for i in range(1, exponent_bits))
    return _Encoder(qmap.size, bounds, tuple(scale), tuple(offset), 0.6, 0.0, signed, exponent_bits,
                    _table(qmap))


def _linear_encoder(qmap: np.ndarray, include_zero: bool) -> _Encoder:
    # value j = (j + first) / steps sits at position G = t * steps - first = j; boundaries at j + 0.5.
    steps, first = (qmap.size - 1, 0) if include_zero else (qmap.size, 1)
    return _Encoder(qmap.size, (), (float(steps),), (float(-first),), 0.0, -0.5, False, 0, _table(qmap))


def _table(qmap: np.ndarray) -> np.ndarray:
    return np.concatenate([_pair_thresholds(qmap), [1.0], qmap]).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _encoder_for(key: bytes, size: int) -> _Encoder:
    qmap = np.frombuffer(key, np.float32)
    bits = size.bit_length() - 1
    if bits in (4, 8):
        for signed in (True, False):
            if np.array_equal(qmap, dynamic_map(signed, bits - 1, bits)):
                return _dynamic_encoder(qmap, signed, bits - 1)
    for include_zero in (False, True):
        if np.array_equal(qmap, linear_map(size, include_zero)):
            return _linear_encoder(qmap, include_zero)
    raise ValueError(f"encode_nearest has an arithmetic encoder for dynamic_map(signed, total_bits - 1, total_bits) "
                     f"and linear_map(n, include_zero) only; got another map of {size} values")


def _encoder(qmap) -> _Encoder:
    table = np.asarray(qmap, np.float32)
    size = table.shape[0]
    if table.ndim != 1 or size < 2 or size & (size - 1):
        raise ValueError(f"map size must be a power of two, got shape {table.shape}")
    return _encoder_for(table.tobytes(), size)


def _position(magnitude: jax.Array, enc: _Encoder) -> jax.Array:
    """The affine position G of float32 magnitudes on their level (see `_Encoder`)."""
    scale = jnp.float32(enc.level_scale[0])
    offset = jnp.float32(enc.level_offset[0])
    for bound, s, o in zip(enc.level_bounds, enc.level_scale[1:], enc.level_offset[1:]):
        above = magnitude >= bound
        scale, offset = jnp.where(above, jnp.float32(s), scale), jnp.where(above, jnp.float32(o), offset)
    return magnitude * scale + offset


def encode_nearest(x: jax.Array, qmap) -> jax.Array:
    """Nearest code of each element of float32 `x` in the sorted map `qmap` (2**bits values): uint8, x's shape.

    Equals `encode_brute_force` (argmin_j |x - qmap[j]| in float32, ties to the lower index) for every float32 x,
    including its float32 artefacts: NaN, +Inf and -Inf encode as code 0 (NaN/Inf distances; callers keep NaN
    visible through the block's absmax, which is then NaN), and for x > 1 the distances x - qmap[j] round to the
    same float32 for all qmap[j] close enough to 1.0 (x >= 2**25: for all j), so the lowest tied code is returned.
    `qmap` must be one of `MAPS`, or `dynamic_map(signed, bits - 1, bits)` / `linear_map(n, include_zero)`.

    Cost per element: one gather from a 2 * 2**bits float32 table, no transcendental functions; comparisons with
    the map's decade boundaries (6 for 8 bits, 2 for dynamic 4 bits, none for linear), ~40 elementwise ops.
    Method: the magnitude t's level and affine position give a pair {c, c + 1} holding the nearest code, the exact
    float32 threshold T_c between the two (precomputed with the brute-force comparison) picks one. For x > 1 the
    answer is the first code j with fl(x - qmap[j]) == fl(x - 1): with d = fl(x - 1), fl(x - q) == d exactly when q
    >= about (x - d) - ulp(d) / 2, so the same position arithmetic on that target gives a pair {c, c + 1} holding
    it, and comparing fl(x - qmap[c]) with d picks one.
    """
    enc = _encoder(qmap)
    size = enc.size
    x = jnp.asarray(x).astype(jnp.float32)

    beyond = x > 1  # 1.0 is every map's last value; beyond it distances can tie
    d = x - 1
    half_ulp = lax.bitcast_convert_type(lax.bitcast_convert_type(d, jnp.int32) & 0x7F800000, jnp.float32) * 2.0**-24
    target = jnp.where(beyond, (x - d) - half_ulp, x)  # x - d is exact (Sterbenz); the sum only needs ~1e-7

    shift = jnp.where(beyond, jnp.float32(enc.first_tie_shift), jnp.float32(enc.nearest_shift))
    c = _pair_start(target, shift, beyond.astype(jnp.int32), enc)
    index = (c + jnp.where(beyond, size, 0)).astype(jnp.uint32)  # unsigned: no negative-index wrap-around ops
    entry = jnp.asarray(enc.table)[index]  # T_c, or qmap[c] beyond 1
    code = jnp.where(beyond, c + (jnp.abs(x - entry) != d), c + (x >= entry))
    # NaN distances make argmin return 0; +Inf ties all distances at Inf (-Inf lands on code 0 by itself).
    code = jnp.where(jnp.isnan(x) | (x == jnp.inf), 0, code)
    return code.astype(jnp.uint8)


def _pair_start(target: jax.Array, shift, beyond, enc: _Encoder) -> jax.Array:
    """int32 c of the code pair {c, c + 1} that holds the answer for float32 `target` (see `encode_nearest`).

    beyond: 1 where the first tied code beyond 1.0 is wanted (then c may be size - 1), else 0. floor(position) is
    position - 0.5 rounded half to even by the magic-number add (no float -> int conversion, which runs at a
    quarter of the FP32 rate on Hopper; Mosaic GPU has no floor op): off by one only at integer positions, where
    both pairs hold the answer (every decision boundary is >= 0.15 from an integer position, see
    `_dynamic_encoder`). NaN targets give some c in range (callers replace their code)."""
    size = enc.size
    # The 0.5 goes into the shift before the clip: after it, XLA would fold it into the magic constant.
    position = jnp.clip(_position(jnp.abs(target), enc) - (shift + jnp.float32(0.5)), -1.5, size - 0.5)
    c = numerics.round_half_even_to_int32(position)
    negative = target < 0
    if enc.mirrored:  # pair {c, c+1} of |t| mirrors to {size-3-c, size-2-c}; a single code c to size-2-c
        c = jnp.where(negative, size - 3 + beyond - c, c)
    else:  # non-negative map: below it, code 0 is nearest / first tied
        c = jnp.where(negative, 0, c)
    return jnp.clip(c, 0, size - 2 + beyond)


def codec_table(qmap) -> np.ndarray:
    """float32 (2 * size,) table of a map for `encode_unit`'s and a kernel's lookups: index c < size - 1 holds the
    threshold T_c between codes c and c + 1 (x >= T_c is nearer c + 1), index size + j holds qmap[j] (decoding)."""
    return _encoder(qmap).table


def encode_unit(x: jax.Array, qmap, lookup=None) -> jax.Array:
    """`encode_nearest` of float32 x with |x| <= 1 + a few ulps (values times their block's 1 / absmax) or NaN.

    lookup: index (int32, x's shape, in [0, size - 1)) -> float32 `codec_table(qmap)[index]`; default: a jnp
    gather. Kernels pass their own (Mosaic GPU has no gather). One lookup per element, ~40 elementwise ops.
    Returns uint8 codes of x's shape; NaN encodes as 0 (the block's NaN absmax keeps it visible)."""
    enc = _encoder(qmap)
    if lookup is None:
        table = jnp.asarray(enc.table)
        lookup = lambda index: table[index]  # noqa: E731
    c = _pair_start(x, enc.nearest_shift, 0, enc)  # beyond 1.0 (by an ulp) the pair {size - 2, size - 1} holds 1.0
    code = c + (x >= lookup(c)).astype(jnp.int32)
    return jnp.where(jnp.isnan(x), 0, code).astype(jnp.uint8)


def quantize_blocks(x: jax.Array, qmap, lookup=None, broadcast_rows=numerics.broadcast_last):
    """f32 blocks (..., B) -> (codes uint8 (..., B), absmax f32 (...)): the block format of the code-book optimizer
    states. absmax = max |x| (NaN if the block holds NaN; 0 for all-zero blocks and, by
    `numerics.invertible_scale`, below 2**-126; +Inf above 2**126); codes = `encode_unit` of x * (1 / absmax), one
    division per block (1 for absmax 0).

    lookup: as in `encode_unit`; broadcast_rows(values (...), shape) -> values broadcast along B (kernels pass one
    that sets their register layout)."""
    absmax = numerics.invertible_scale(numerics.amax(x, axis=-1))
    inverse = broadcast_rows(1 / numerics.nonzero(absmax), x.shape)
    return encode_unit(x * inverse, qmap, lookup), absmax


def encode_brute_force(x: jax.Array, qmap) -> jax.Array:
    """Reference for `encode_nearest`: argmin over the whole map (memory x.size * 2**bits; tests only)."""
    table = jnp.asarray(qmap, jnp.float32)
    dist = jnp.abs(x.astype(jnp.float32)[..., None] - table)
    return jnp.argmin(dist, axis=-1).astype(jnp.uint8)


def pack_4bit(codes: jax.Array) -> jax.Array:
    """uint8 codes < 16, shape (..., 2k) -> uint8 (..., k): element 2i in the high nibble, 2i+1 in the low."""
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack_4bit(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_4bit`: uint8 (..., k) -> uint8 codes (..., 2k)."""
    return jnp.stack([packed >> 4, packed & jnp.uint8(15)], axis=-1).reshape(*packed.shape[:-1], -1)


def decode(codes: jax.Array, qmap) -> jax.Array:
    """codes (uint8, any shape) -> float32 map values of the same shape."""
    return jnp.asarray(qmap, jnp.float32)[codes.astype(jnp.int32)]
