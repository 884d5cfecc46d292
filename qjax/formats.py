"""Number formats qjax quantizes to: their ranges and saturating casts.

A `Format` names an 8-bit storage type (int8, e4m3, e5m2) and the facts about it that scaling and rounding need.
"ternary" (BitNet b1.58's weights) is int8 storage holding only -1, 0 and 1: max_value 1, and its scale comes from
the mean |x| instead of the amax (`qjax.quantize`).
Ternary codes travel packed 2 bits each, 4 per byte (`pack_ternary`: FSDP gathers them so).
The casts here are the reference semantics for every kernel: finite values saturate to the format's range (as
Mosaic GPU's f32->fp8 cast does), NaN stays NaN, and +-Inf is never turned into a finite number.
"""

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Format:
    """An 8-bit (or 16-bit) storage format.

    Attributes:
      name: "int8", "ternary", "e4m3", "e5m2" or "bf16".
      dtype: the jnp dtype arrays of this format are stored in.
      max_value: the largest finite magnitude (127 for int8, 1 for ternary, 448 for e4m3, 57344 for e5m2).
      mantissa_bits: explicit mantissa bits (0 for int8: its grid spacing is 1).
      min_exponent: exponent of the smallest normal number (floats only); below it the grid spacing is constant.
    """

    name: str
    dtype: jnp.dtype
    max_value: float
    mantissa_bits: int
    min_exponent: int

    @property
    def is_integer(self) -> bool:
        return jnp.issubdtype(self.dtype, jnp.integer)


INT8 = Format("int8", jnp.dtype(jnp.int8), 127.0, 0, 0)
E4M3 = Format("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, 3, -6)
E5M2 = Format("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, 2, -14)
BF16 = Format("bf16", jnp.dtype(jnp.bfloat16), float(jnp.finfo(jnp.bfloat16).max), 7, -126)
TERNARY = Format("ternary", jnp.dtype(jnp.int8), 1.0, 0, 0)

FORMATS = {f.name: f for f in (INT8, TERNARY, E4M3, E5M2, BF16)}
_BY_DTYPE = {f.dtype: f for f in (INT8, E4M3, E5M2, BF16)}  # jnp.int8 means int8, never ternary


def get_format(name_or_dtype) -> Format:
    """Returns the `Format` for a name ("int8", "ternary", "e4m3", "e5m2", "bf16") or a dtype (jnp.int8,
    jnp.float8_e4m3fn, ...)."""
    if isinstance(name_or_dtype, Format):
        return name_or_dtype
    if isinstance(name_or_dtype, str) and name_or_dtype in FORMATS:
        return FORMATS[name_or_dtype]
    try:
        dtype = jnp.dtype(name_or_dtype)
    except TypeError:
        dtype = None
    if dtype in _BY_DTYPE:
        return _BY_DTYPE[dtype]
    raise ValueError(
        f"unsupported quantization format {name_or_dtype!r}; use one of {sorted(FORMATS)} "
        "or the dtypes jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16")


def saturating_cast(x: jnp.ndarray, fmt: Format) -> jnp.ndarray:
    """Casts float32 values that are already on `fmt`'s grid (or are to be rounded to nearest) into `fmt.dtype`.

    Finite values are clamped to [-max, max]; NaN stays NaN (int8 has no NaN: callers keep NaN visible through the
    scale, see `qjax.quantize`); +-Inf is passed to the cast unclamped, so it becomes Inf (e5m2, bf16) or NaN (e4m3,
    which has no Inf), never a finite number. For int8 the values must already be integers.
    """
    clamped = jnp.clip(x, -fmt.max_value, fmt.max_value)
    if not fmt.is_integer:
        clamped = jnp.where(jnp.isinf(x), x, clamped)
    return clamped.astype(fmt.dtype)


_TERNARY_SHIFTS = (6, 4, 2, 0)  # bit offsets of elements 4i .. 4i+3 in byte i (the first in the high bits)


def pack_ternary(codes: jnp.ndarray) -> jnp.ndarray:
    """int8 ternary codes (-1, 0, 1), shape (..., 4k) -> uint8 (..., k): code + 1 (0, 1, 2) in 2 bits, element 4i
    in the highest two bits of byte i."""
    fields = (codes + 1).astype(jnp.uint8)
    packed = fields[..., 0::4] << _TERNARY_SHIFTS[0]
    for i, shift in enumerate(_TERNARY_SHIFTS[1:], 1):
        packed = packed | (fields[..., i::4] << shift)
    return packed


def unpack_ternary(packed: jnp.ndarray) -> jnp.ndarray:
    """Inverse of `pack_ternary`: uint8 (..., k) -> int8 codes (..., 4k)."""
    fields = jnp.stack([(packed >> shift) & jnp.uint8(3) for shift in _TERNARY_SHIFTS], axis=-1)
    return (fields.astype(jnp.int8) - 1).reshape(*packed.shape[:-1], -1)
