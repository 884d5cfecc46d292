"""Tiling of the scaled GEMM kernel (`qjax.kernels.scaled_matmul_mgpu`) and what a tiling needs: the kernel mode an
operand pair runs in, shared memory and registers per mode, and the default configs (the fastest measured)."""

import dataclasses

import jax.numpy as jnp

from qjax.numerics import INT32_SAFE_K
from qjax.qtensor import QTensor

SMEM_BYTES = 232_448  # shared memory per block on H100/H200
SMEM_MARGIN = 1024  # barriers and allocator alignment beyond `smem_bytes`
BLOCK_K = 128  # K per block scale ("1x128", "128x128")
EPI_TILE_M = 64
EPI_ROW_BYTES = 128  # epilogue SMEM tiles are 128-byte rows (one 128B swizzle)
COMPUTE_WGS = 2
FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tiling of the kernel. The CTA computes a (2 * tile_m, tile_n) output tile, one tile_m-row half per compute
    warpgroup.

    Attributes:
      tile_m: rows per compute warpgroup, a multiple of 64 (wgmma M). Promoting modes hold the f32 sum and one
        f32/int32 tile per 128-K block of a step in registers: (1 + tile_k / 128) * tile_m * tile_n / 128 must stay
        <= 192 per thread (of 232).
      tile_n: columns per CTA, a multiple of 64 and <= 256 (wgmma N).
      tile_k: K per pipeline step: 64, 128 or 256 (128 bytes of 8-bit codes = one 128B swizzle row). Promoting
        modes take 128 or 256: with 256 a step issues one wgmma per 128-K block into its own accumulator and
        promotes the first block while the second one's wgmma runs.
      max_concurrent_steps: pipeline stages (SMEM buffers per operand).
      grid_minor_dim, grid_tile_width: output tiles are visited in stripes `grid_tile_width` tiles wide along dim
        `grid_minor_dim` (0: M, 1: N; `plgpu.planar_snake`) so the ~132 tiles in flight share operand rows in L2.
        With 256 x 128 CTA tiles, 8 M-tiles x ~16 N-tiles in flight read the fewest distinct rows.
      num_ctas: persistent grid size; None = number of SMs on a GPU, 2 under the interpreter.
      cluster_m: 1, or 2 for clusters of two CTAs on neighbouring M tiles that share each B tile: one TMA load
        multicast to both halves B's L2 -> SMEM traffic (SMEM per CTA is unchanged).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 4
    grid_minor_dim: int = 0
    grid_tile_width: int = 8
    num_ctas: int | None = None
    cluster_m: int = 1

    def __post_init__(self):
        if self.tile_m <= 0 or self.tile_m % 64:
            raise ValueError(f"tile_m must be a positive multiple of 64 (wgmma M), got {self.tile_m}")
        if self.tile_n <= 0 or self.tile_n % 64 or self.tile_n > 256:
            raise ValueError(f"tile_n must be 64, 128, 192 or 256 (wgmma N <= 256), got {self.tile_n}")
        if self.tile_k not in (64, 128, 256):
            raise ValueError(f"tile_k must be 64, 128 or 256, got {self.tile_k}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
        if self.cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {self.cluster_m}")
        if self.grid_minor_dim not in (0, 1) or self.grid_tile_width < 1:
            raise ValueError(f"grid_minor_dim must be 0 or 1 and grid_tile_width >= 1, got {self.grid_minor_dim}, "
                             f"{self.grid_tile_width}")


# Row mode: 2 x 128 x 128 tiles, one int32/f32 accumulator of 128 registers per thread; 4 stages of 48 KiB.
ROW_CONFIG = TuningConfig(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=4)
# Promoting modes: the f32 sum and one wgmma tile per 128-K block are in registers, so 64 x 128 per warpgroup. Two
# blocks per step (3 stages of 66 KiB): block 0 is promoted while block 1's wgmma runs; CTA pairs share B tiles.
BLOCK_CONFIG = TuningConfig(tile_m=64, tile_n=128, tile_k=256, max_concurrent_steps=3, cluster_m=2)


def kernel_mode(a: QTensor, b: QTensor, precise_accumulation: bool) -> str:
    """"row" (scales in the epilogue), "block" (per-128-K block scales) or "promote" (row scales, f32 promotion
    every 128 of K: fp8 with precise accumulation, or int8 with a K whose int32 sum could overflow)."""
    if a.is_block_scaled or b.is_block_scaled:
        return "block"
    if jnp.dtype(a.data.dtype) in FP8 and precise_accumulation:
        return "promote"
    if jnp.dtype(a.data.dtype) == jnp.int8 and a.data.shape[-1] > INT32_SAFE_K:
        return "promote"
    return "row"


def _smem_bytes(config: TuningConfig, mode: str, epilogue_slots: int) -> int:
    cta_m = COMPUTE_WGS * config.tile_m
    stage = (cta_m + config.tile_n) * config.tile_k
    if mode == "block":
        stage += (cta_m + config.tile_n) * 4 * (config.tile_k // BLOCK_K)
    epilogue = COMPUTE_WGS * epilogue_slots * EPI_TILE_M * EPI_ROW_BYTES
    row_scales = COMPUTE_WGS * (config.tile_m + config.tile_n) * 4 if mode != "block" else 0
    return config.max_concurrent_steps * stage + epilogue + row_scales


def epilogue_slot_count(config: TuningConfig, mode: str) -> int:
    """2 epilogue SMEM tiles per warpgroup (one fills while the other is stored) where they fit, else 1."""
    return 2 if _smem_bytes(config, mode, 2) + SMEM_MARGIN <= SMEM_BYTES else 1


def smem_bytes(config: TuningConfig, mode: str) -> int:
    """Shared memory the kernel allocates for `config` (without the allocator's alignment padding); epilogue tiles
    are 128-byte rows whatever the output dtype."""
    return _smem_bytes(config, mode, epilogue_slot_count(config, mode))


def check_config(config: TuningConfig, mode: str):
    """ValueError naming the limit where `config` cannot run in `mode` (registers, shared memory, tile_k)."""
    if mode != "row" and config.tile_k not in (BLOCK_K, 2 * BLOCK_K):
        raise ValueError(f"mode {mode!r} promotes every {BLOCK_K} of K: tile_k must be {BLOCK_K} or "
                         f"{2 * BLOCK_K}, got {config.tile_k}")
    # The f32 sum plus one wgmma accumulator per 128-K block of a step, in 128 threads' registers (<= 232 each).
    tiles = 1 + config.tile_k // BLOCK_K
    if mode != "row" and tiles * config.tile_m * config.tile_n > 192 * 128:
        raise ValueError(f"mode {mode!r} keeps {tiles} (tile_m, tile_n) tiles in registers: {tiles} x "
                         f"{config.tile_m} x {config.tile_n} f32 needs more than 192 registers per thread; use "
                         f"smaller tiles or tile_k={BLOCK_K}")
    need = smem_bytes(config, mode) + SMEM_MARGIN
    if need > SMEM_BYTES:
        raise ValueError(f"config {config} needs ~{need} bytes of shared memory in mode {mode!r}, more than the "
                         f"{SMEM_BYTES} a Hopper block has; lower max_concurrent_steps or the tiles")


def default_config(a: QTensor, b: QTensor, precise_accumulation: bool = False) -> TuningConfig:
    """ROW_CONFIG, or BLOCK_CONFIG adjusted so that the operands need no extra padding."""
    if kernel_mode(a, b, precise_accumulation) == "row":
        return ROW_CONFIG
    config = BLOCK_CONFIG
    m, k = a.data.shape
    if k % config.tile_k:  # one 128-K block per step rather than padding K (a copy of both operands)
        config = dataclasses.replace(config, tile_k=BLOCK_K, max_concurrent_steps=5)
    if m % (config.cluster_m * COMPUTE_WGS * config.tile_m):  # no CTA pairs rather than padding M further
        config = dataclasses.replace(config, cluster_m=1)
    return config
