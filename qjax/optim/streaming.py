"""Runs a per-tensor optimizer step over a whole pytree with temporaries of about one group of tensors.

Left alone, XLA schedules every tensor's dequantize -> Adam -> quantize at once and holds each tensor's float32
m, v and update at the same time: a low-bit AdamW step then peaks above fp32 AdamW's. `run` bounds that:

  groups  consecutive tensors (tree order) whose sizes add up to at most a budget (1/`GROUPS` of the tree) run
          one group after another: a group's inputs pass an `optimization_barrier` with the previous group's
          outputs, so its work cannot start before they exist. Inside a group nothing is ordered, so XLA fuses as
          it does without streaming (a barrier per tensor would stop XLA fusing across tensors).
  chunks  a tensor with quantized states larger than the budget is a group of its own and runs in a
          `lax.fori_loop` over chunks of whole state blocks (about the budget each, the rest as one static tail
          after the loop), each chunk's results written in place into the loop's carry: one compiled body per
          tensor, not one per chunk.

Quantization works per block and Adam per element, so results are bit-identical to the unstreamed step (tested).
Float32 states are never chunked (the optimizers keep only small or odd-sized tensors in float32).
"""

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from qjax.optim import blockwise

# A group holds about 1/GROUPS of the tree's elements, at least MIN_GROUP_ELEMENTS: the step's temporaries (~16
# bytes per element of a group on CPU) are then ~0.5 bytes per param whatever the model's size, while the number
# of sequenced groups (hence the fusions XLA cannot merge across them) stays ~GROUPS.
GROUPS = 32
MIN_GROUP_ELEMENTS = 1 << 20


def groups(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive index groups of `sizes` whose sums stay <= budget (a larger size is a group alone)."""
    out, total = [], 0
    for i, size in enumerate(sizes):
        if out and total + size <= budget:
            out[-1].append(i)
            total += size
        else:
            out.append([i])
            total = size
    return out


def _rows_of(state, start, n_rows: int, block: int):
    """Rows start:start+n_rows of a quantized state's (n_blocks, ...) arrays: a state of n_rows * block elements."""
    leaves, treedef = jax.tree.flatten(state)
    part = jax.tree.unflatten(treedef, [lax.dynamic_slice_in_dim(a, start, n_rows) for a in leaves])
    return dataclasses.replace(part, shape=(n_rows * block,))


def _set_rows(state, part, start):
    leaves, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, [lax.dynamic_update_slice_in_dim(a, b, start, 0)
                                        for a, b in zip(leaves, jax.tree.leaves(part), strict=True)])


def _chunked(fn, g, mu, nu, p, extra, in_place: bool, budget: int):
    """fn on chunks of whole blocks of one tensor (module docstring); returns what fn on the whole tensor would."""
    n_blocks = mu.codes.shape[0]
    block = g.size // n_blocks
    rows = max(1, budget // block)
    g2 = g.reshape(n_blocks, block)
    p2 = None if p is None else p.reshape(n_blocks, block)
    x2 = p2 if in_place else jnp.zeros((n_blocks, block), g.dtype)

    def chunk(carry, start, n_rows):
        x2, mu_all, nu_all = carry
        source = x2 if in_place else p2  # in place: the param rows not yet overwritten
        p_rows = None if source is None else lax.dynamic_slice_in_dim(source, start, n_rows).reshape(-1)
        x, mu_part, nu_part = fn(lax.dynamic_slice_in_dim(g2, start, n_rows).reshape(-1),
                                 _rows_of(mu_all, start, n_rows, block), _rows_of(nu_all, start, n_rows, block),
                                 p_rows, start.astype(jnp.uint32) * jnp.uint32(block), *extra)
        x2 = lax.dynamic_update_slice_in_dim(x2, x.reshape(n_rows, block), start, 0)
        return x2, _set_rows(mu_all, mu_part, start), _set_rows(nu_all, nu_part, start)

    n_full, tail = divmod(n_blocks, rows)
    carry = lax.fori_loop(0, n_full, lambda i, c: chunk(c, i * rows, rows), (x2, mu, nu))
    if tail:  # after the loop: the barrier keeps XLA from computing the tail's temporaries beside the loop's
        # (in place, p's rows come from the carry: passing p2 too would keep the old param alive, a copy)
        (g2, p2), carry = lax.optimization_barrier(((g2, None if in_place else p2), carry))
        carry = chunk(carry, jnp.int32(n_full * rows), tail)
    x2, mu, nu = carry
    return x2.reshape(g.shape), mu, nu


def sequenced(fn: Callable, items: Sequence[tuple], sizes: Sequence[int], budget: int | None = None) -> list:
    """[fn(*item) for item in items], the items in consecutive groups of at most `budget` elements (`sizes`: each
    item's; default 1/GROUPS of their sum, at least MIN_GROUP_ELEMENTS) run one group after another, as `run`
    orders its groups: a group's inputs pass an `optimization_barrier` with the previous group's outputs."""
    if budget is None:
        budget = max(MIN_GROUP_ELEMENTS, -(-sum(sizes) // GROUPS))
    out: list = [None] * len(items)
    previous = ()
    for group in groups(sizes, budget):
        inputs = [items[i] for i in group]
        if previous:  # this group's inputs exist only after the previous group's outputs
            inputs, _ = lax.optimization_barrier((inputs, previous))
        for i, item in zip(group, inputs, strict=True):
            out[i] = fn(*item)
        previous = [out[i] for i in group]
    return out


def run(fn: Callable, tensors: Sequence[tuple], *, in_place: bool, whole: Sequence[bool] | None = None,
        budget: int | None = None) -> list[tuple]:
    """[fn(g, mu, nu, p, offset, *extra) for (g, mu, nu, p, *extra) in tensors], streamed (module docstring).

    Args:
      fn: one tensor's step -> (x, new mu, new nu); x has g's shape (the new param when `in_place`, else an array
        of g's dtype, e.g. the update). g, p arrive flattened when chunked; `offset` is the uint32 row-major index of
        the first element fn gets (0 for a whole tensor), e.g. for stochastic rounding's element hash.
      tensors: per tensor (g, mu, nu, p, *extra); mu, nu float32 arrays or `blockwise` states; p an array or None;
        extra: values passed through unchanged (a weight decay, a seed).
      in_place: x overwrites p (a chunk reads p's rows before writing them).
      whole: per tensor, True runs it unchunked (e.g. a kernel that streams it itself); None: none.
      budget: elements per group (default: 1/GROUPS of all tensors' elements, at least MIN_GROUP_ELEMENTS).
    Returns:
      fn's results, one tuple per tensor, in order.
    """
    tensors = [tuple(t) for t in tensors]
    if budget is None:
        budget = max(MIN_GROUP_ELEMENTS, -(-sum(t[0].size for t in tensors) // GROUPS))
    out: list = [None] * len(tensors)
    previous = ()
    for group in groups([t[0].size for t in tensors], budget):
        inputs = [tensors[i][:4] for i in group]
        if previous:  # this group's inputs exist only after the previous group's outputs
            inputs, _ = lax.optimization_barrier((inputs, previous))
        for i, (g, mu, nu, p) in zip(group, inputs, strict=True):
            extra = tensors[i][4:]
            if blockwise.is_quantized(mu) and g.size > budget and not (whole and whole[i]):
                out[i] = _chunked(fn, g, mu, nu, p, extra, in_place, budget)
            else:
                out[i] = fn(g, mu, nu, p, jnp.uint32(0), *extra)
        previous = [out[i] for i in group]
    return out
