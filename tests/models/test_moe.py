"""The mixture-of-experts Llama: the MoE layer against a per-token reference, training with a quantized recipe,
the auxiliary loss through the train task, config checks."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import adamw_losses
from ml_collections import config_dict

from qjax import models
from qjax.models.moe import MoE
from qjax.train.task import make_task

FAST_COMPILE = {"xla_backend_optimization_level": 0}
INIT = lambda config, residual=False: nn.initializers.normal(0.02)  # noqa: E731
MOE = models.MoEConfig(n_experts=4, top_k=2, n_shared_experts=1, expert_ffn_dim=64, aux_loss_weight=0.01)
CONFIG = models.llama_config("tiny", vocab_size=64, n_layers=1, max_seq_len=64, moe=MOE, recipe="int8_rowwise")


def _reference_moe(params, x, moe):
    """Every expert on every token (float32), mixed with the top_k renormalised router probabilities (zero for the
    other experts), plus the shared SwiGLU."""
    swiglu = lambda h: jax.nn.silu(h[..., :h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:]
    tokens = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(tokens @ params["router"])
    kth = jnp.sort(probs, axis=-1)[:, -moe.top_k][:, None]
    mix = jnp.where(probs >= kth, probs, 0.0)
    mix = mix / mix.sum(-1, keepdims=True)
    experts = jnp.einsum("tef,efd->ted", swiglu(jnp.einsum("td,edf->tef", tokens, params["experts_gate_up"])),
                         params["experts_down"])
    shared = swiglu(tokens @ params["shared_gate_up_proj"]["kernel"]) @ params["shared_down_proj"]["kernel"]
    return (jnp.einsum("te,ted->td", mix, experts) + shared).reshape(x.shape)


def test_moe_layer_equals_every_expert_reference():
    config = dataclasses.replace(CONFIG, recipe="bf16", compute_dtype="float32")
    x = jax.random.normal(jax.random.key(0), (2, 8, config.dim))
    params = jax.jit(MoE(config, INIT).init)(jax.random.key(1), x)["params"]
    out, state = jax.jit(lambda p, x: MoE(config, INIT).apply({"params": p}, x, mutable=["losses"]))(params, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_reference_moe(params, x, MOE)), rtol=2e-4, atol=2e-5)
    (aux,) = state["losses"]["moe_aux_loss"]
    assert 0.5 * MOE.aux_loss_weight < float(aux) < MOE.n_experts * MOE.aux_loss_weight  # 1 x weight when balanced


def test_quantized_moe_llama_trains_and_reports_its_aux_loss():
    tokens = jnp.tile(jnp.arange(32) * 7 % 64, (4, 2))  # a repeating sequence: learnable
    config = config_dict.ConfigDict({
        "task": "lm", "seq_len": 63, "recipe": "int8_rowwise", "keep_high_precision": None, "min_features": None,
        "model": {"size": "tiny", "n_layers": 1, "moe": dataclasses.asdict(MOE)}})
    task = make_task(config, vocab_size=64)
    assert task.model_config.moe == MOE
    params = jax.jit(task.init)(jax.random.key(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    step = jax.jit(jax.value_and_grad(lambda p, key: task.loss(p, batch, key), has_aux=True),
                   compiler_options=FAST_COMPILE)
    (_, aux), grads = step(params, jax.random.key(1))
    assert set(aux) == {"moe_aux_loss"} and 0 < float(aux["moe_aux_loss"]) < 0.1
    assert float(jnp.abs(grads["layers_0"]["moe"]["router"]).sum()) > 0  # the router learns (aux loss, weights)
    assert float(jnp.abs(grads["layers_0"]["moe"]["experts_gate_up"]).sum()) > 0

    def value_and_grad(p, key):
        (loss, _), g = step(p, key)
        return loss, g

    losses = adamw_losses(value_and_grad, params, steps=15, learning_rate=1e-2)
    assert losses[-1] < 0.7 * losses[0], losses
    config.model.moe = None  # the dense Llama reports no aux loss
    dense = make_task(config, vocab_size=64)
    assert jax.eval_shape(dense.loss, jax.eval_shape(dense.init, jax.random.key(0)), batch, jax.random.key(1))[1] == {}


def test_flops_count_top_k_experts_per_token():
    dense_ffn = dataclasses.replace(CONFIG, moe=None, ffn_dim=(MOE.top_k + MOE.n_shared_experts) * 64)
    # top_k routed + shared experts of width 64 per token: the FLOPs of a dense SwiGLU of their total width
    assert models.flops_per_token(CONFIG, 64) == models.flops_per_token(dense_ffn, 64)


def test_bad_moe_configs_raise():
    with pytest.raises(ValueError, match="top_k"):
        models.MoEConfig(n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="n_shared_experts"):
        models.MoEConfig(n_shared_experts=-1)
    with pytest.raises(ValueError, match="LlamaConfig.moe"):
        models.llama_config("tiny", moe={"n_experts": 4})
