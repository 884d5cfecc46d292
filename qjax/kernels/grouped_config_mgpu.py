"""Tiling of the grouped scaled GEMM kernels (`qjax.kernels.grouped_matmul_mgpu`, `grouped_contract_mgpu`): the
config, how many pipeline stages fit in shared memory, and the defaults each mode takes."""

import dataclasses

import jax.numpy as jnp

from qjax.kernels.gemm_config_mgpu import SMEM_BYTES, SMEM_MARGIN


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Tiling of the scaled grouped kernels: a CTA computes a (compute_warpgroups * tile_m, tile_n) tile.

    Attributes:
      tile_m: rows per compute warpgroup (wgrad: of K), a multiple of 64 (wgmma M) <= 256; smaller tiles waste
        fewer rows at group boundaries.
      tile_n: columns per tile, a multiple of 64 and <= 256 (wgmma N).
      tile_k: K per pipeline step (wgrad: tokens), 64 or 128 (128 bytes of 8-bit codes = one 128B swizzle row).
      max_concurrent_steps: pipeline stages (> 1: a step's wgmma may run while the next step's TMA lands); with two
        compute warpgroups at most as many as fit beside the two output tiles of the call's out_dtype.
      grid_tile_width: (item, n-tile) pairs are visited in stripes this many n-tiles wide (`plgpu.planar_snake`), so
        CTAs in flight share rows of a in L2.
      num_ctas: persistent grid size; None = number of SMs on a GPU, 2 under the interpreter.
      compute_warpgroups: 1, or 2 for kernels with a memory warpgroup and two compute warpgroups (module
        docstring), each owning tile_m rows of a (2 * tile_m, tile_n) tile; the contracting kernel takes it too.
        The field defaults to 1; the kernels' own defaults (`DEFAULT_CONFIG`, `PROMOTE_CONFIG`) take 2.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    num_ctas: int | None = None
    compute_warpgroups: int = 1

    def __post_init__(self):
        if self.tile_m <= 0 or self.tile_m % 64 or self.tile_m > 256:
            raise ValueError(f"tile_m must be 64, 128, 192 or 256 (wgmma M steps of 64, TMA boxes <= 256), got "
                             f"{self.tile_m}")
        if self.tile_n <= 0 or self.tile_n % 64 or self.tile_n > 256:
            raise ValueError(f"tile_n must be 64, 128, 192 or 256 (wgmma N <= 256), got {self.tile_n}")
        if self.tile_k not in (64, 128):
            raise ValueError(f"tile_k must be 64 or 128, got {self.tile_k}")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")
        if self.compute_warpgroups not in (1, 2):
            raise ValueError(f"compute_warpgroups must be 1 or 2, got {self.compute_warpgroups}")
        if _fitting_stages(self, 1, jnp.float32) < self.max_concurrent_steps:
            raise ValueError(f"{self} needs more shared memory than a Hopper block has; lower max_concurrent_steps")
        if _fitting_stages(self, self.compute_warpgroups, jnp.float32) < 2:
            raise ValueError(f"{self} needs more shared memory than a Hopper block has for two pipeline stages and "
                             f"two float32 output tiles; use smaller tiles")

    def stages(self, out_dtype) -> int:
        """Pipeline stages of the rows kernel for outputs of out_dtype: max_concurrent_steps, or with two compute
        warpgroups as many as fit in shared memory beside their (tile_m, tile_n) output tiles and scales."""
        return min(self.max_concurrent_steps, _fitting_stages(self, self.compute_warpgroups, out_dtype))


def _fitting_stages(cfg: GroupedConfig, warpgroups: int, out_dtype) -> int:
    """How many pipeline stages fit in shared memory beside `warpgroups` output tiles of out_dtype and scales."""
    stage = (warpgroups * cfg.tile_m + cfg.tile_n) * cfg.tile_k
    fixed = warpgroups * (cfg.tile_m * cfg.tile_n * jnp.dtype(out_dtype).itemsize + (cfg.tile_m + cfg.tile_n) * 4)
    return (SMEM_BYTES - SMEM_MARGIN - fixed) // stage


# The configs both grouped kernels take when given none (as from `qjax.ragged_dot`), accumulating and promoting (fp8
# with precise): two compute warpgroups (faster than one for every shape benchmarks/ragged.py times), promoting ones
# on 64-row halves (registers: `resolve_config`).
DEFAULT_CONFIG = GroupedConfig(compute_warpgroups=2)
PROMOTE_CONFIG = GroupedConfig(compute_warpgroups=2, tile_m=64)


def resolve_config(config: GroupedConfig | None, promote: bool) -> GroupedConfig:
    """config, or the default for the mode; ValueError where two promoting compute warpgroups would run out of
    registers: each holds the f32 sum and a tile_k partial sum, 2 * tile_m * tile_n / 128 per thread, which must
    stay <= 192 of the 232 the warp-specialized pipeline gives it (the dense kernel's bound)."""
    config = config or (PROMOTE_CONFIG if promote else DEFAULT_CONFIG)
    if promote and config.compute_warpgroups == 2 and 2 * config.tile_m * config.tile_n > 192 * 128:
        raise ValueError(f"promoting (fp8, precise) with two compute warpgroups keeps two ({config.tile_m}, "
                         f"{config.tile_n}) f32 tiles in registers, more than 192 per thread: use tile_m=64")
    return config
