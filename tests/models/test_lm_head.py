"""The LM head + cross-entropy over vocabulary chunks (`qjax.models.lm_head`) against the model's logits and
`lm_loss`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qjax
from qjax import models
from qjax.models import lm_head as lhl
from helpers import run_on_cpu_devices


def _setup(arch, compute_dtype, recipe, b=2, t=12, n_layers=1):
    make = models.llama_config if arch == "llama" else models.gpt2_config
    model_cls = models.Llama if arch == "llama" else models.GPT2
    config = make("tiny", compute_dtype=compute_dtype, recipe=recipe, n_layers=n_layers)
    model = model_cls(config)
    tokens = jax.random.randint(jax.random.key(1), (b, t + 1), 0, config.vocab_size)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    return config, model, params, tokens[:, :-1], tokens[:, 1:]


def _losses(config, model, params, inputs, targets, mask=None, chunk_elements=97):
    """(chunked loss, unchunked loss): the same params, the head run per chunk vs the model's full logits."""
    key = jax.random.key(2)

    def chunked(p):
        hidden = model.apply({"params": p}, inputs, rngs={"quant": key}, return_hidden=True)
        return lhl.lm_head_loss(config, p, hidden, targets, mask, chunk_elements=chunk_elements)

    def full(p):
        logits = model.apply({"params": p}, inputs, rngs={"quant": key})
        if mask is None:
            return models.lm_loss(logits, targets)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return jax.jit(jax.value_and_grad(chunked))(params), jax.jit(jax.value_and_grad(full))(params)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# 2 x 12 tokens, vocab 256. chunk_elements 97: 64 chunks of 4 columns; 700: 9 chunks of 29 (the last overlaps its
# neighbour by 5 columns); 1400: 5 chunks of 52 (overlap 4).
@pytest.mark.parametrize("arch,recipe,chunk_elements", [("llama", "bf16", 97), ("llama", "int8_dataflow", 700),
                                                        ("gpt2", "fp8_dataflow", 1400)])
def test_equals_full_logits_float32(arch, recipe, chunk_elements):
    config, model, params, inputs, targets = _setup(arch, "float32", recipe)
    (loss, grads), (loss_ref, grads_ref) = _losses(config, model, params, inputs, targets,
                                                   chunk_elements=chunk_elements)
    np.testing.assert_allclose(loss, loss_ref, rtol=2e-6)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g_ref = dict(jax.tree_util.tree_leaves_with_path(grads_ref))[path]
        # float32 sums over chunks in another order than one GEMM: 1.4e-5 on an H200 (64 chunks), under 1e-5 on CPU
        assert _rel(g, g_ref) < 3e-5, (jax.tree_util.keystr(path), _rel(g, g_ref))


def test_bf16_compute_and_mask():
    config, model, params, inputs, targets = _setup("llama", "bfloat16", "int8_rowwise", b=2, t=16)
    mask = (jnp.arange(16)[None, :] >= 5).astype(jnp.int32) * jnp.array([[1], [0]])  # one row partly, one not
    for m in (None, mask):
        (loss, grads), (loss_ref, grads_ref) = _losses(config, model, params, inputs, targets, m, chunk_elements=1000)
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
        errors = {jax.tree_util.keystr(p): _rel(g, r) for (p, g), r in
                  zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref))}
        head = errors.pop("['lm_head']['kernel']")
        assert max(errors.values()) < 1e-5, errors  # the same dhidden rows reach every layer below the head
        # The head's gradient: each chunk's bf16 GEMM over all tokens against XLA:CPU's unchunked one; the logits'
        # gradient in bf16 differs in its last bit where the float32 softmax rounds differently (log-sum-exp over
        # chunks), so the two agree at bf16 rounding, not float32.
        assert head < 2**-6, head


def test_nan_stays_visible():
    config, model, params, inputs, targets = _setup("llama", "float32", "bf16")
    params = jax.tree.map(lambda x: x, params)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"].at[3, 7].set(jnp.nan)
    (loss, grads), _ = _losses(config, model, params, inputs, targets, chunk_elements=700)
    assert np.isnan(loss)
    assert np.isnan(np.asarray(grads["lm_head"]["kernel"])).any()


def test_a_target_outside_the_vocabulary_makes_the_loss_nan():
    hidden = jax.random.normal(jax.random.key(0), (1, 4, 8))
    kernel = jax.random.normal(jax.random.key(1), (8, 32))
    weights = jnp.full((1, 4), 0.25)
    for bad in (32, -1):  # one past the end; a negative id (optax's cross-entropy: NaN, or the last column)
        targets = jnp.array([[3, bad, 7, 31]])
        loss = lhl.chunked_cross_entropy(hidden, kernel, targets, weights, recipe="bf16", chunk_elements=40)
        assert np.isnan(loss), (bad, loss)


def test_overlapping_last_chunk():
    """Vocab 32 in 3 chunks of 11 columns (the last starts at column 21, overlapping the second's last column):
    loss and gradients equal one chunk's, to float32 rounding."""
    b, t, dim, vocab = 2, 10, 16, 32
    keys = jax.random.split(jax.random.key(3), 3)
    hidden = jax.random.normal(keys[0], (b, t, dim))
    kernel = jax.random.normal(keys[1], (dim, vocab)) * 0.3
    targets = jax.random.randint(keys[2], (b, t), 0, vocab).at[0, :3].set(jnp.array([20, 21, 31]))  # at the seam
    weights = jnp.full((b, t), 1.0 / (b * t), jnp.float32)
    loss = lambda h, k, chunk_elements: lhl.chunked_cross_entropy(h, k, targets, weights, recipe="bf16",
                                                                   chunk_elements=chunk_elements)
    got = jax.value_and_grad(loss, argnums=(0, 1))(hidden, kernel, 240)  # 12 columns asked: 3 chunks of 11
    want = jax.value_and_grad(loss, argnums=(0, 1))(hidden, kernel, 10**9)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-6)
    for g, w in zip(got[1], want[1]):
        assert _rel(g, w) < 1e-5


def test_peak_memory_below_full_logits():
    """Compiled for the CPU: the gradient's temporaries with chunks stay under one float32 copy of the logits,
    where the unchunked loss keeps several (the logits, their softmax and gradient)."""
    b, t, dim, vocab = 2, 512, 64, 8192
    hidden = jax.ShapeDtypeStruct((b, t, dim), jnp.bfloat16)
    kernel = jax.ShapeDtypeStruct((dim, vocab), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
    weights = jnp.full((b, t), 1.0 / (b * t), jnp.float32)

    def chunked(h, k, tg):
        return lhl.chunked_cross_entropy(h, k, tg, weights, recipe="bf16", chunk_elements=2**20)

    def full(h, k, tg):
        logits = jnp.einsum("btd,dv->btv", h, k).astype(jnp.float32)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, tg) * weights)

    temp = lambda f: jax.jit(jax.grad(f, argnums=(0, 1))).lower(hidden, kernel, targets).compile() \
        .memory_analysis().temp_size_in_bytes
    logits_f32 = b * t * vocab * 4
    assert temp(full) > 2 * logits_f32
    assert temp(chunked) < logits_f32 / 2, (temp(chunked), logits_f32)


def _kernel_sized_amaxes(jaxpr, size: int, in_loop: bool = False) -> tuple[int, int]:
    """(inside a scan, outside one): how many max-reductions read an array of `size` elements (a kernel's amax)."""
    counts = [0, 0]
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_max" and eqn.invars[0].aval.size == size:
            counts[0 if in_loop else 1] += 1
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else [param]):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    inner = _kernel_sized_amaxes(sub, size, in_loop or eqn.primitive.name == "scan")
                    counts = [counts[0] + inner[0], counts[1] + inner[1]]
    return counts[0], counts[1]


@pytest.mark.parametrize("recipe", ["int8_rowwise", "fp8_rowwise"])
def test_a_row_scaled_quantized_head_in_chunks(recipe):
    """Each chunk quantizes its own columns of the kernel, never the whole kernel. With row scales the forward's and
    wgrad's codes are then the unchunked GEMM's: the loss and the kernel's gradient equal one chunk's to float32
    rounding; dgrad's scales span a chunk's columns, so the hidden states' gradient moves at the codes' rounding."""
    b, t, dim, vocab = 2, 16, 32, 96
    hidden = jax.random.normal(jax.random.key(0), (b, t, dim))
    kernel = jax.random.normal(jax.random.key(1), (dim, vocab)) * 0.2
    targets = jax.random.randint(jax.random.key(2), (b, t), 0, vocab)
    weights = jnp.full((b, t), 1.0 / (b * t))

    def loss_and_grads(chunk_elements):
        loss = lambda h, k: lhl.chunked_cross_entropy(h, k, targets, weights, recipe=recipe,
                                                      chunk_elements=chunk_elements)
        return jax.value_and_grad(loss, argnums=(0, 1))

    chunked = loss_and_grads(b * t * 12)  # 8 chunks of 12 columns
    inside, outside = _kernel_sized_amaxes(jax.make_jaxpr(chunked)(hidden, kernel).jaxpr, kernel.size)
    assert inside == outside == 0
    assert _kernel_sized_amaxes(jax.make_jaxpr(chunked)(hidden, kernel).jaxpr, dim * 12)[0] >= 2  # fwd and bwd
    (loss, (dh, dk)), (loss_ref, (dh_ref, dk_ref)) = jax.jit(chunked)(hidden, kernel), \
        jax.jit(loss_and_grads(10**9))(hidden, kernel)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    assert _rel(dk, dk_ref) < 1e-5, _rel(dk, dk_ref)
    assert 0 < _rel(dh, dh_ref) < 0.05, _rel(dh, dh_ref)


def test_bad_input():
    config, model, params, inputs, targets = _setup("llama", "float32", "bf16")
    hidden = jnp.zeros((2, 12, config.dim))
    with pytest.raises(ValueError, match="hidden"):
        lhl.lm_head_loss(config, params, hidden, targets[:, :5])
    with pytest.raises(TypeError, match="int token ids"):
        lhl.lm_head_loss(config, params, hidden, targets.astype(jnp.float32))
    with pytest.raises(ValueError, match="pass lm_head_loss a key"):
        lhl.chunked_cross_entropy(hidden, jnp.zeros((config.dim, 8)), targets, jnp.ones(targets.shape),
                                  recipe=qjax.with_stochastic_gradients(qjax.recipe("int8_rowwise")))


_FSDP_SCRIPT = """
import re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from qjax.models import lm_head as lhl

mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Auto,))  # as qjax.train.make_mesh's
b, t, dim, vocab = 4, 32, 64, 1024
hidden = jax.device_put(jax.random.normal(jax.random.key(0), (b, t, dim)), NamedSharding(mesh, P("fsdp")))
kernel = jax.device_put(jax.random.normal(jax.random.key(1), (dim, vocab)) * 0.1, NamedSharding(mesh, P(None, "fsdp")))
targets = jax.random.randint(jax.random.key(2), (b, t), 0, vocab)
weights = jnp.full((b, t), 1.0 / (b * t))
loss = lambda h, k: lhl.chunked_cross_entropy(h, k, targets, weights, recipe="bf16", chunk_elements=b * t * 128)
grads_as_params = (NamedSharding(mesh, P()), (hidden.sharding, kernel.sharding))  # FSDP: reduce-scattered
with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as qjax.train's step is traced
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), out_shardings=grads_as_params)
    compiled = step.lower(hidden, kernel).compile()
hlo = compiled.as_text()
bodies = set(re.findall(r"body=%?([\\w.-]+)", hlo))
assert len(bodies) == 2, bodies  # the forward's and the backward's chunk loops (8 chunks of 128 columns)
for name in bodies:
    body = hlo.split(name + " ", 1)[1].split("\\n}", 1)[0]
    assert "all-gather" not in body, (name, body)
got = compiled(hidden, kernel)
want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(np.asarray(hidden), np.asarray(kernel))
for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=1e-7)

# A mesh of explicit axes, where shardings are part of the arrays' types: the same values
explicit = jax.make_mesh((2,), ("fsdp",), axis_types=(AxisType.Explicit,))
with jax.set_mesh(explicit):
    split = lambda x, spec: jax.device_put(np.asarray(x), NamedSharding(explicit, spec))
    loss = lambda h, k, tg, w: lhl.chunked_cross_entropy(h, k, tg, w, recipe="bf16", chunk_elements=b * t * 128)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(split(hidden, P("fsdp")), split(kernel, P(None, "fsdp")),
                                                            split(targets, P("fsdp")), split(weights, P("fsdp")))
for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-5, atol=1e-7)
print("ok")
"""


def test_fsdp_gathers_the_head_once_before_the_chunk_loops():
    """The head split along the vocabulary over "fsdp" (qjax.train.mesh's rule) and the tokens split too: the chunk
    loops hold no all-gather (the kernel is gathered once, before them), and the values equal one device's, on a
    mesh of auto axes (qjax.train's) and of explicit ones."""
    assert run_on_cpu_devices(_FSDP_SCRIPT, devices=2).strip().endswith("ok")
