"""Where each array of the train state lies on a ("data", "fsdp", "tensor") mesh, from parameter paths.

  specs = param_specs(params, mesh)                   # PartitionSpec per param (ShapeDtypeStructs work too)
  state_specs(opt_state, params, mesh)                # the same for an optimizer state
  with qjax.flax.weight_shardings(layer_sharding(params, mesh)): ...   # while tracing the model

Rules (Megatron tensor parallelism, FSDP over the other dim; a dim takes an axis only if the axis' size divides it):

  param (path ends with)                           dims            spec
  column-parallel kernels: qkv_proj, gate_up_proj,  (K, N)          (fsdp, tensor)
    fc1 (ViT)
  row-parallel kernels: o_proj, down_proj, fc2      (K, N)          (tensor, fsdp)
  any other param with ndim >= 2 (embedding,         (..., a, b)     fsdp on its largest dim
    lm_head, patch_embed, pos_embed, ...)
  1-D params (norm scales, biases) and scalars      -               replicated

The batch splits over ("data", "fsdp") (`qjax.train.mesh.batch_sharding`). Column-parallel layers leave their output
features split over "tensor" and row-parallel ones sum over it, so attention heads (qkv -> o) and the FFN
(gate_up -> down) stay split between the two GEMMs. A fused kernel's columns are [q | k | v] and [gate | up]: a
contiguous shard of them is not one device's heads, so XLA moves the fused output between the tensor devices
before the split (correct, one exchange of the layer's output; a per-shard interleaved column order would avoid it).

Optimizer states: a leaf shaped like its param (float32 AdamW moments, small tensors the low-bit optimizers keep in
float32) takes the param's spec; the low-bit states' codes (n_blocks, block) and scales (n_blocks,) split their
blocks over "fsdp" (dim 0); scalars (counts) are replicated. Gradients take the params' specs.
"""

import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qjax.weight_sharding import WeightSharding
from qjax.train.mesh import DATA_AXIS, FSDP_AXIS, TENSOR_AXIS

COLUMN_PARALLEL = re.compile(r"(^|/)(qkv_proj|gate_up_proj|fc1)/kernel$")
ROW_PARALLEL = re.compile(r"(^|/)(o_proj|down_proj|fc2)/kernel$")


def path_name(path) -> str:
    """A jax key path as "layers_0/attn/qkv_proj/kernel" (dict keys, attributes and indices joined by "/")."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


def _fits(mesh: Mesh, axis: str, size: int) -> bool:
    return mesh.shape.get(axis, 1) > 1 and size % mesh.shape[axis] == 0


def param_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of the param at `name` (module docstring's rules)."""
    dims = [None] * len(shape)
    if len(shape) < 2:
        return PartitionSpec(*dims)
    if COLUMN_PARALLEL.search(name) or ROW_PARALLEL.search(name):
        k_axis, n_axis = (FSDP_AXIS, TENSOR_AXIS) if COLUMN_PARALLEL.search(name) else (TENSOR_AXIS, FSDP_AXIS)
        for dim, axis in ((0, k_axis), (1, n_axis)):
            if _fits(mesh, axis, shape[dim]):
                dims[dim] = axis
        return PartitionSpec(*dims)
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if _fits(mesh, FSDP_AXIS, shape[dim]):
            dims[dim] = FSDP_AXIS
            break
    return PartitionSpec(*dims)


def param_specs(params, mesh: Mesh):
    """PartitionSpec per leaf of a params pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(lambda path, p: param_spec(path_name(path), p.shape, mesh), params)


def state_specs(opt_state, params, mesh: Mesh):
    """PartitionSpec per leaf of an optimizer state for `params` (module docstring): a leaf whose path ends with a
    param's path (then optionally a quantized state's field) and has its shape takes the param's spec; other
    leaves with ndim >= 1 split dim 0 over "fsdp" where it divides; the rest are replicated."""
    by_name = {path_name(path): (p.shape, param_spec(path_name(path), p.shape, mesh))
               for path, p in jax.tree_util.tree_flatten_with_path(params)[0]}

    def spec(path, leaf):
        name = path_name(path)
        for param_name, (shape, pspec) in by_name.items():
            if (name == param_name or name.endswith("/" + param_name)) and tuple(leaf.shape) == tuple(shape):
                return pspec
        if leaf.ndim >= 1 and _fits(mesh, FSDP_AXIS, leaf.shape[0]):
            return PartitionSpec(FSDP_AXIS, *[None] * (leaf.ndim - 1))
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, opt_state)


def named(specs, mesh: Mesh):
    """PartitionSpecs -> NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def layer_sharding(params, mesh: Mesh):
    """lookup(layer name) -> `qjax.dot_general.WeightSharding` of that layer's kernel (or None when it is whole
    on every device), for `qjax.flax.weight_shardings`: the quantized GEMMs then gather 8-bit codes."""
    tokens = tuple(a for a in (DATA_AXIS, FSDP_AXIS) if a in mesh.axis_names)
    table = {}
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_name(path)
        if not name.endswith("/kernel") or len(p.shape) != 2:
            continue
        dims = tuple(param_spec(name, p.shape, mesh))
        if dims == (None, None):
            continue
        fsdp = [d for d in (0, 1) if dims[d] == FSDP_AXIS]
        tensor = [d for d in (0, 1) if dims[d] == TENSOR_AXIS]
        as_dim = lambda d: "k" if d == 0 else "n"  # noqa: E731  a Dense kernel is (K, N)
        table[name[:-len("/kernel")]] = WeightSharding(
            tokens, FSDP_AXIS if fsdp else None, as_dim(fsdp[0]) if fsdp else "k",
            TENSOR_AXIS if tensor else None, as_dim(tensor[0]) if tensor else "n")
    return table.get
