"""Mixture-of-experts feed-forward for the Llama (`LlamaConfig.moe`): a router, top-k routed experts run as
quantized grouped GEMMs (`qjax.ragged_dot`), shared experts, and a load-balancing auxiliary loss.

  x (B, T, dim) -> router logits in float32 (DeepSeek-V3 keeps the router in high precision) -> softmax
  -> top_k experts per token, their probabilities renormalised to sum to 1
  -> the (token, expert) pairs sorted by expert -> ragged_dot gate_up (E, dim, 2F) -> SwiGLU -> ragged_dot down
     (E, F, dim) -> weighted and added back to their tokens
  + shared experts: one dense SwiGLU of width n_shared_experts * F that every token takes

Auxiliary loss (Switch Transformer's, DeepSeek's expert-level balance loss): aux_loss_weight * E * sum_e f_e * P_e,
f_e the fraction of routed (token, slot) pairs sent to expert e and P_e the mean router probability of e; 1 at
perfect balance. Each MoE layer sows it into the "losses" collection (`model.apply(..., mutable=["losses"])`);
`qjax.train`'s task adds the sum to the training loss and reports it as the metric "moe_aux_loss".

Parameter tree of one layer (names are what `keep_high_precision` matches): moe/router (dim, E) float32,
moe/experts_gate_up (E, dim, 2F) with columns [gate | up], moe/experts_down (E, F, dim), and with shared experts
moe/shared_gate_up_proj/kernel, moe/shared_down_proj/kernel.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

import qjax
from qjax.models import layers
from qjax.models.ops import swiglu


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shape of a Llama's mixture-of-experts feed-forward layers.

    Attributes:
      n_experts: routed experts E per layer.
      top_k: experts each token is routed to (1 <= top_k <= n_experts).
      n_shared_experts: experts every token takes (0: none), run as one dense SwiGLU of width n_shared * F.
      expert_ffn_dim: SwiGLU hidden width F of each expert.
      aux_loss_weight: weight of the load-balancing loss added to the training loss (0: not added).
    """

    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    expert_ffn_dim: int = 128
    aux_loss_weight: float = 0.01

    def __post_init__(self):
        layers.check_positive_ints(self, ("n_experts", "top_k", "expert_ffn_dim"))
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        if isinstance(self.n_shared_experts, bool) or not isinstance(self.n_shared_experts, int) \
                or self.n_shared_experts < 0:
            raise ValueError(f"MoEConfig.n_shared_experts must be an int >= 0, got {self.n_shared_experts!r}")
        if not self.aux_loss_weight >= 0:
            raise ValueError(f"MoEConfig.aux_loss_weight must be >= 0, got {self.aux_loss_weight!r}")

    def projections(self, dim: int) -> dict[str, tuple[int, int]]:
        """{layer name under a block: (features_in, features_out)} of one MoE layer's quantized GEMMs (per expert)."""
        f, shared = self.expert_ffn_dim, self.n_shared_experts * self.expert_ffn_dim
        out = {"moe/experts_gate_up": (dim, 2 * f), "moe/experts_down": (f, dim)}
        if shared:
            out.update({"moe/shared_gate_up_proj": (dim, 2 * shared), "moe/shared_down_proj": (shared, dim)})
        return out


class MoE(nn.Module):
    """(B, T, dim) -> (B, T, dim), compute dtype; `config` is the LlamaConfig, `config.moe` a MoEConfig;
    kernel_init(config, residual) -> a weight's initializer (the dense MLP's; residual=True for projections into
    the residual stream)."""

    config: Any
    kernel_init: Callable

    @nn.compact
    def __call__(self, x):
        c, m = self.config, self.config.moe
        compute, param_dtype = jnp.dtype(c.compute_dtype), jnp.dtype(c.param_dtype)
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)

        router = self.param("router", self.kernel_init(c), (dim, m.n_experts), jnp.float32)
        probs = jax.nn.softmax(jnp.dot(tokens.astype(jnp.float32), router, precision=lax.Precision.HIGHEST))
        top_probs, top_experts = lax.top_k(probs, m.top_k)  # (tokens, top_k)
        top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)

        # (token, slot) pairs sorted by expert: rows of expert e are contiguous, as ragged_dot's groups.
        flat_experts = top_experts.reshape(-1)
        order = jnp.argsort(flat_experts, stable=True)
        token_of_row = order // m.top_k
        group_sizes = jnp.bincount(flat_experts, length=m.n_experts).astype(jnp.int32)

        def expert_weights(name, shape, residual=False):
            w = self.param(name, self.kernel_init(c, residual), shape, param_dtype).astype(compute)
            recipe = layers.recipe_for(c, layers.layer_name(self, name), shape[1], shape[2])
            key = self.make_rng("quant") if recipe.needs_key else None
            return lambda rows: qjax.ragged_dot(rows, w, group_sizes, recipe=recipe, key=key)

        f = m.expert_ffn_dim
        gate_up = expert_weights("experts_gate_up", (m.n_experts, dim, 2 * f))
        down = expert_weights("experts_down", (m.n_experts, f, dim), residual=True)
        gate, up = jnp.split(gate_up(tokens.astype(compute)[token_of_row]), 2, axis=-1)
        rows_out = down(swiglu(gate, up)).astype(jnp.float32) * top_probs.reshape(-1)[order][:, None]
        out = jnp.zeros((tokens.shape[0], dim), jnp.float32).at[token_of_row].add(rows_out).astype(compute)

        fraction = group_sizes.astype(jnp.float32) / flat_experts.shape[0]
        self.sow("losses", "moe_aux_loss",
                 m.aux_loss_weight * m.n_experts * jnp.sum(fraction * jnp.mean(probs, axis=0)))

        if m.n_shared_experts:
            shared = m.n_shared_experts * f
            dense = lambda name, f_in, f_out, residual=False: layers.dense(
                self, c, name, f_in, f_out, use_bias=False, kernel_init=self.kernel_init(c, residual))
            s_gate, s_up = jnp.split(dense("shared_gate_up_proj", dim, 2 * shared)(x), 2, axis=-1)
            out = out + dense("shared_down_proj", shared, dim, residual=True)(swiglu(s_gate, s_up)).reshape(-1, dim)
        return out.reshape(batch, seq, dim)
