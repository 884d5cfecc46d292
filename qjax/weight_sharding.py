"""How a quantized GEMM's weight lies on the mesh (FSDP, tensor parallelism): `WeightSharding`, and the per-device
form of the GEMM for a weight stored split (`qjax.linear_core`'s module docstring says what happens to codes, scales
and gradients). Layouts are `linear_core.Layout`'s (B?, rows, K) views; the GEMM itself is `linear_core.linear_parts`.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from qjax import formats
from qjax.qtensor import QTensor


@dataclasses.dataclass(frozen=True)
class WeightSharding:
    """How a GEMM's weight (rhs, 2-D) lies on the context mesh, in its (N, K) view: N output features, K contracted.

    Attributes:
      tokens: mesh axes the lhs' leading dim (the tokens' batch) is split over, e.g. ("data", "fsdp").
      fsdp: mesh axis (one of `tokens`) the weight is stored split over along `fsdp_dim` ("n" or "k") and
        all-gathered over, as 8-bit codes + scales, before its GEMMs; None: not stored split.
      tensor: mesh axis (not one of `tokens`) the weight stays split over through its GEMMs along `tensor_dim`:
        "n" column-parallel (output features split), "k" row-parallel (lhs features split, outputs summed over
        it); None: no tensor parallelism.
    """

    tokens: tuple[str, ...]
    fsdp: str | None = None
    fsdp_dim: str = "k"
    tensor: str | None = None
    tensor_dim: str = "n"

    def __post_init__(self):
        for name in ("fsdp_dim", "tensor_dim"):
            if getattr(self, name) not in ("n", "k"):
                raise ValueError(f"WeightSharding.{name} must be 'n' or 'k', got {getattr(self, name)!r}")
        if self.fsdp is not None and self.fsdp not in self.tokens:
            raise ValueError(f"WeightSharding.fsdp {self.fsdp!r} must be one of the token axes {self.tokens}")
        if self.tensor is not None and self.tensor in self.tokens:
            raise ValueError(f"WeightSharding.tensor {self.tensor!r} must not split the tokens {self.tokens}")
        if self.fsdp and self.tensor and self.fsdp_dim == self.tensor_dim:
            raise ValueError("WeightSharding: fsdp and tensor must split different dims of the weight, got "
                             f"both on {self.fsdp_dim!r}")

    def axes(self, dim: str) -> tuple[str, ...]:
        """The mesh axes dim "n" or "k" of the weight is split over in memory."""
        return tuple(a for a, d in ((self.fsdp, self.fsdp_dim), (self.tensor, self.tensor_dim)) if a and d == dim)

    def lhs_k_axes(self) -> tuple[str, ...]:
        """The mesh axes the lhs' contracted features are split over (row-parallel)."""
        return (self.tensor,) if self.tensor and self.tensor_dim == "k" else ()

    def out_n_axes(self) -> tuple[str, ...]:
        """The mesh axes the output's features are split over (column-parallel)."""
        return (self.tensor,) if self.tensor and self.tensor_dim == "n" else ()


def trivial_axes() -> set[str]:
    """The context mesh's axes of size 1. A collective over one moves nothing, but XLA keeps it (and may combine
    it with others), so the per-device GEMMs leave them out (`without_trivial_axes`, `linear_core.device_axes`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return set() if mesh.empty else {a for a in mesh.axis_names if mesh.shape[a] == 1}


def without_trivial_axes(sharding: WeightSharding) -> WeightSharding:
    """`sharding` without the context mesh's axes of size 1 (`trivial_axes`): the same split of every array. Kept,
    a size-1 "data" axis turns the weight gradient's sum over it (the transpose of `per_device_sharded`'s cast)
    into an all-reduce per layer, which XLA combines into one after the last layer's backward, holding every
    layer's gradient until then."""
    trivial = trivial_axes()
    if not trivial & ({sharding.fsdp, sharding.tensor} | set(sharding.tokens)):
        return sharding
    return dataclasses.replace(sharding, tokens=tuple(a for a in sharding.tokens if a not in trivial),
                               fsdp=None if sharding.fsdp in trivial else sharding.fsdp,
                               tensor=None if sharding.tensor in trivial else sharding.tensor)


def gather(q, axis: str | None, dim: int, ternary: bool = False):
    """A weight's shard, quantized (QTensor) or not (array), all-gathered over mesh `axis` along `dim` of its 2-D
    layout; a QTensor's scales travel with its codes where they differ along `dim` (row scales of rows, blocks).
    ternary: q's codes are ternary (-1, 0, 1; one tensor scale, the same on every device), gathered packed 4 per
    byte (`gather_ternary`)."""
    if axis is None or q is None:
        return q
    gather = lambda x: lax.all_gather(x, axis, axis=dim, tiled=True)  # noqa: E731
    if not isinstance(q, QTensor):
        return gather(q)
    if ternary:
        return QTensor(gather_ternary(q.data, axis, dim), q.scale, q.granularity)
    scale_split = q.granularity != "tensor" and (q.granularity != "row" or dim == 0)
    return QTensor(gather(q.data), gather(q.scale) if scale_split else q.scale, q.granularity)


def gather_ternary(codes, axis: str, dim: int):
    """int8 ternary codes, a device's shard (..., R, C), all-gathered over mesh `axis` along `dim` as uint8 with 2
    bits per code (`formats.pack_ternary`): a quarter of the int8 gather's bytes. The shard is packed flat (padded to
    a multiple of 4 codes), so any shape packs; the unpacked shards are then laid side by side along `dim`."""
    flat = codes.reshape(-1)
    packed = formats.pack_ternary(jnp.pad(flat, (0, -flat.size % 4)))
    shards = formats.unpack_ternary(lax.all_gather(packed, axis))[:, :flat.size].reshape(-1, *codes.shape)
    shape = list(codes.shape)
    shape[dim] *= shards.shape[0]
    return jnp.moveaxis(shards, 0, dim).reshape(shape)


def varying(x, axes: tuple[str, ...]):
    """x typed as varying over `axes` inside shard_map: a Pallas kernel's output carries no per-device type (it is
    per-device data all the same), and the custom VJP's types must match its inputs'."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def sharded_layout(recipe, layout, sharding: WeightSharding):
    """`layout` (a `dot_general` GEMM view) of the per-device GEMM (lhs local; rhs gathered over FSDP, split over
    tensor) for a weight split per `sharding` over the context mesh, or None where it cannot run so (then
    `qjax.dot_general`'s whole-weight path runs: XLA gathers the float weight): no mesh, the XLA backend, inside
    a shard_map, batch dims, a rhs that is not 2-D or an lhs not contracting its last dim, mesh axes `sharding`
    does not name, dims that do not split evenly, or block-scaled shards that would split 128-blocks."""
    mesh = jax.sharding.get_abstract_mesh()
    if recipe.backend == "xla" or mesh.empty or mesh.size == 1 or mesh.manual_axes or layout.lhs_batch:
        return None
    named = set(sharding.tokens) | {sharding.tensor} - {None}
    lhs_rank = len(layout.lhs_shape)
    if (len(layout.rhs_shape) != 2 or layout.lhs_contract != (lhs_rank - 1,) or lhs_rank < 2
            or not named <= set(mesh.axis_names) or any(mesh.shape[a] > 1 and a not in named for a in mesh.axis_names)):
        return None
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    tokens = size(sharding.tokens)
    k_dim = layout.rhs_contract[0]
    local_k = layout.k // size(sharding.axes("k"))
    local_n = layout.n // size(sharding.axes("n"))
    if (layout.lhs_shape[0] % tokens or layout.k % size(sharding.axes("k")) or layout.n % size(sharding.axes("n"))
            or (recipe.is_block_scaled and ((layout.m // tokens) % 128 or local_k % 128 or local_n % 128))):
        return None
    rhs = list(layout.rhs_shape)
    rhs[k_dim] //= size(sharding.lhs_k_axes())
    rhs[1 - k_dim] //= size(sharding.out_n_axes())
    lhs = (layout.lhs_shape[0] // tokens, *layout.lhs_shape[1:-1], layout.lhs_shape[-1] // size(sharding.lhs_k_axes()))
    return dataclasses.replace(layout, lhs_shape=lhs, rhs_shape=tuple(rhs))


def per_device_sharded(fn, sharding: WeightSharding, layout):
    """fn (lhs, rhs, seeds) -> out, run inside `jax.shard_map` over the context mesh with the weight's shard
    (module docstring): lhs and out split along dim 0 over the token axes, their features over the tensor axis
    where the layer is row- / column-parallel; rhs split per `sharding`."""
    spec = lambda axes: tuple(axes) or None  # noqa: E731
    lhs_rank, k_dim = len(layout.lhs_shape), layout.rhs_contract[0]
    rhs_dims = [None, None]
    rhs_dims[k_dim], rhs_dims[1 - k_dim] = spec(sharding.axes("k")), spec(sharding.axes("n"))
    lhs_spec = jax.sharding.PartitionSpec(spec(sharding.tokens), *[None] * (lhs_rank - 2),
                                          spec(sharding.lhs_k_axes()))
    out_spec = jax.sharding.PartitionSpec(spec(sharding.tokens), *[None] * (lhs_rank - 2),
                                          spec(sharding.out_n_axes()))
    per_device = sharding.tokens + ((sharding.tensor,) if sharding.tensor else ())

    def body(lhs, rhs, seeds):
        device = lax.axis_index(per_device).astype(jnp.uint32)
        seeds = seeds + device * jnp.uint32(0x9E3779B9)  # distinct stochastic-rounding streams per device
        # As in `linear_core.per_device`: the transposes of these casts sum lhs' gradient over the tensor axis (a
        # column-parallel layer's partial dgrads) and the weight's over the token axes it is not gathered over.
        out = fn(varying(lhs, per_device), varying(rhs, per_device), seeds, None)
        return lax.psum(out, sharding.tensor) if sharding.lhs_k_axes() else out  # row-parallel partial sums

    return jax.shard_map(body, in_specs=(lhs_spec, jax.sharding.PartitionSpec(*rhs_dims),
                                         jax.sharding.PartitionSpec()), out_specs=out_spec)
