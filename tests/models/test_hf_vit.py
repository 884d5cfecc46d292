"""Hugging Face ViT checkpoints: qjax logits vs a numpy HF-layout forward, save/load round trip, ViTModel and new
heads, errors, and (where torch and transformers import) parity with transformers' ViTForImageClassification."""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from helpers import save_hf_dir, snr_db

from qjax import models

HF_CONFIG = {"architectures": ["ViTForImageClassification"], "model_type": "vit", "image_size": 8, "patch_size": 4,
             "num_channels": 3, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 48, "layer_norm_eps": 1e-12, "hidden_act": "gelu", "qkv_bias": True,
             "id2label": {str(i): f"LABEL_{i}" for i in range(5)}}
VIT_MODEL = dict(HF_CONFIG, architectures=["ViTModel"])


def random_hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors in the HF ViT layout ((out, in) weights, the patch conv (dim, C, p, p)); norms near 1,
    biases non-zero. ViTModel's carry its pooler (which the loader leaves out) and no classifier."""
    rng = np.random.default_rng(seed)
    d, m, c, p = hf["hidden_size"], hf["intermediate_size"], hf["num_channels"], hf["patch_size"]
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
    b = lambda n: (0.1 * rng.standard_normal(n)).astype(np.float32)
    norm = lambda: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    classify = hf["architectures"] == ["ViTForImageClassification"]
    pre = "vit." if classify else ""
    tokens = (hf["image_size"] // p) ** 2 + 1
    t = {pre + "embeddings.patch_embeddings.projection.weight": w(d, c, p, p),
         pre + "embeddings.patch_embeddings.projection.bias": b(d),
         pre + "embeddings.cls_token": b((1, 1, d)), pre + "embeddings.position_embeddings": b((1, tokens, d)),
         pre + "layernorm.weight": norm(), pre + "layernorm.bias": b(d)}
    for i in range(hf["num_hidden_layers"]):
        layer = f"{pre}encoder.layer.{i}."
        for name, (n_out, n_in) in {"attention.attention.query": (d, d), "attention.attention.key": (d, d),
                                    "attention.attention.value": (d, d), "attention.output.dense": (d, d),
                                    "intermediate.dense": (m, d), "output.dense": (d, m)}.items():
            t.update({layer + name + ".weight": w(n_out, n_in), layer + name + ".bias": b(n_out)})
        for name in ("layernorm_before", "layernorm_after"):
            t.update({layer + name + ".weight": norm(), layer + name + ".bias": b(d)})
    if classify:
        t.update({"classifier.weight": w(len(hf["id2label"]), d), "classifier.bias": b(len(hf["id2label"]))})
    else:
        t.update({"pooler.dense.weight": w(d, d), "pooler.dense.bias": b(d)})
    return t


def write_hf_dir(path, hf: dict = HF_CONFIG, tensors=None) -> dict[str, np.ndarray]:
    """A Hugging Face model directory (config.json + model.safetensors) with random weights; returns the tensors."""
    return save_hf_dir(path, hf, random_hf_tensors(hf) if tensors is None else tensors)


_erf = np.vectorize(math.erf)
_ACT = {"gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
        "gelu_pytorch_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))}


def hf_reference(hf: dict, t: dict, pixel_values: np.ndarray) -> np.ndarray:
    """transformers' ViT forward written in numpy, float64: pixel_values (B, C, H, W) -> ViTForImageClassification's
    logits (B, classes), or ViTModel's final hidden state's class token (B, dim) (the input to a classifier)."""
    d, n_heads, p, eps = hf["hidden_size"], hf["num_attention_heads"], hf["patch_size"], hf["layer_norm_eps"]
    hd = d // n_heads
    classify = hf["architectures"] == ["ViTForImageClassification"]
    pre = "vit." if classify else ""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    ln = lambda x, name: ((x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
                          * t[name + ".weight"] + t[name + ".bias"])
    linear = lambda x, name: x @ t[name + ".weight"].T + t[name + ".bias"]
    b, c, h, w = pixel_values.shape
    # Conv2d(kernel = stride = p) as a GEMM over (C, p, p) patches, flattened row-major over the patch grid.
    patches = pixel_values.reshape(b, c, h // p, p, w // p, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
    conv = pre + "embeddings.patch_embeddings.projection"
    x = patches @ t[conv + ".weight"].reshape(d, -1).T + t[conv + ".bias"]
    x = np.concatenate([np.broadcast_to(t[pre + "embeddings.cls_token"], (b, 1, d)), x], axis=1)
    x = x + t[pre + "embeddings.position_embeddings"]
    for i in range(hf["num_hidden_layers"]):
        layer = f"{pre}encoder.layer.{i}."
        y = ln(x, layer + "layernorm_before")
        heads = lambda name: linear(y, layer + "attention.attention." + name).reshape(b, -1, n_heads, hd).transpose(
            0, 2, 1, 3)
        q, k, v = heads("query"), heads("key"), heads("value")
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        x = x + linear((a @ v).transpose(0, 2, 1, 3).reshape(x.shape), layer + "attention.output.dense")
        y = ln(x, layer + "layernorm_after")
        x = x + linear(_ACT[hf["hidden_act"]](linear(y, layer + "intermediate.dense")), layer + "output.dense")
    x = ln(x, pre + "layernorm")[:, 0]
    return linear(x, "classifier") if classify else x


PIXELS = np.random.default_rng(1).standard_normal((3, 3, 8, 8)).astype(np.float32)  # (B, C, H, W), HF's layout


def _qjax_logits(config, params, pixel_values=PIXELS):
    # "highest": on a GPU, float32 GEMMs would otherwise run in TF32 (10-bit mantissas), far from 60 dB.
    with jax.default_matmul_precision("highest"):
        images = jnp.asarray(pixel_values.transpose(0, 2, 3, 1))  # (B, H, W, C), qjax's layout
        return np.asarray(jax.jit(models.ViT(config).apply)({"params": params}, images))


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_logits_match_hf_reference(tmp_path, act):
    hf = dict(HF_CONFIG, hidden_act=act)
    tensors = write_hf_dir(tmp_path, hf)
    config, params = models.load_hf_vit(str(tmp_path), compute_dtype="float32")
    assert (config.dim, config.mlp_dim, config.num_classes, config.pool, config.norm_eps) == (32, 48, 5, "cls", 1e-12)
    assert config.gelu_approximate == (act != "gelu")
    init = jax.eval_shape(models.ViT(config).init, jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, init)
    ref = hf_reference(hf, tensors, PIXELS)
    ours = _qjax_logits(config, params)
    assert snr_db(ref, ours) >= 60
    # The other GELU differs visibly: the test can tell them apart.
    wrong = _qjax_logits(dataclasses.replace(config, gelu_approximate=not config.gelu_approximate), params)
    assert snr_db(ref, wrong) < snr_db(ref, ours) - 20


def test_vit_model_and_new_head(tmp_path):
    """A ViTModel (no classifier; its pooler is left out) and a classifier of other classes load with a zero head;
    the body computes the reference's class token."""
    tensors = write_hf_dir(tmp_path / "model", VIT_MODEL)
    config, params = models.load_hf_vit(str(tmp_path / "model"), num_classes=7, compute_dtype="float32")
    assert config.num_classes == 7 and not np.any(params["head"]["kernel"]) and not np.any(params["head"]["bias"])
    features = hf_reference(VIT_MODEL, tensors, PIXELS)
    head = np.random.default_rng(2).standard_normal((32, 7)).astype(np.float32)
    params["head"]["kernel"] = head
    assert snr_db(features @ head, _qjax_logits(config, params)) >= 60
    with pytest.raises(ValueError, match="ViTModel has no classifier; pass num_classes"):
        models.load_hf_vit(str(tmp_path / "model"))
    write_hf_dir(tmp_path / "cls")
    _, with_head = models.load_hf_vit(str(tmp_path / "cls"))
    config3, new_head = models.load_hf_vit(str(tmp_path / "cls"), num_classes=3)
    assert new_head["head"]["kernel"].shape == (32, 3) and not np.any(new_head["head"]["kernel"])
    del new_head["head"], with_head["head"]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), new_head, with_head)


def test_save_load_round_trip_bit_exact(tmp_path):
    write_hf_dir(tmp_path / "in")
    config, params = models.load_hf_vit(str(tmp_path / "in"))
    models.save_hf_vit(config, params, str(tmp_path / "out"))
    config2, params2 = models.load_hf_vit(str(tmp_path / "out"))
    assert config2 == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), params, params2)
    saved = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    original = safetensors.numpy.load_file(str(tmp_path / "in" / "model.safetensors"))
    assert saved.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(saved[name], original[name], err_msg=name)


def test_qjax_init_saves_and_loads(tmp_path):
    """A qjax-initialised ViT (exact GELU) written as HF, sharded, and read back gives the same logits."""
    config = models.vit_config("tiny", pool="cls", gelu_approximate=False, norm_eps=1e-12, compute_dtype="float32")
    params = jax.jit(models.ViT(config).init)(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    params["head"]["kernel"] = jax.random.normal(jax.random.key(1), params["head"]["kernel"].shape)  # not all zero
    models.save_hf_vit(config, params, str(tmp_path), max_shard_bytes=20_000)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    loaded_config, loaded = models.load_hf_vit(str(tmp_path), compute_dtype="float32")
    assert loaded_config == config
    np.testing.assert_array_equal(_qjax_logits(loaded_config, loaded), _qjax_logits(config, params))
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    assert (hf["hidden_act"], hf["torch_dtype"], len(hf["id2label"])) == ("gelu", "float32", 5)
    with pytest.raises(ValueError, match="pool='cls'"):
        models.save_hf_vit(models.vit_config("tiny", pool="mean"), params, str(tmp_path / "mean"))


def _break(tmp_path, hf=HF_CONFIG, drop=None, reshape=None):
    tensors = random_hf_tensors(HF_CONFIG)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    write_hf_dir(tmp_path, hf, tensors)
    return str(tmp_path)


@pytest.mark.parametrize("kind, kwargs, message", [
    ("missing", {"drop": "vit.encoder.layer.1.attention.attention.key.bias"},
     "missing tensor vit.encoder.layer.1.attention.attention.key.bias"),
    ("head", {"drop": "classifier.weight"}, "missing tensor classifier.weight"),
    ("shape", {"reshape": "vit.embeddings.position_embeddings"}, "vit.embeddings.position_embeddings has shape"),
    ("conv", {"reshape": "vit.embeddings.patch_embeddings.projection.weight"}, "projection.weight has shape"),
    ("arch", {"hf": dict(HF_CONFIG, architectures=["ViTForMaskedImageModeling"])}, "architectures"),
    ("type", {"hf": dict(HF_CONFIG, model_type="deit")}, "model_type 'deit'"),
    ("field", {"hf": {k: v for k, v in HF_CONFIG.items() if k != "intermediate_size"}}, "'intermediate_size'"),
    ("act", {"hf": dict(HF_CONFIG, hidden_act="relu")}, "hidden_act='relu'"),
    ("bias", {"hf": dict(HF_CONFIG, qkv_bias=False)}, "qkv_bias=False"),
])
def test_bad_checkpoints_raise(tmp_path, kind, kwargs, message):
    with pytest.raises(ValueError, match=message):
        models.load_hf_vit(_break(tmp_path, **kwargs))


def test_shape_overrides_raise(tmp_path):
    write_hf_dir(tmp_path)
    with pytest.raises(ValueError, match=r"fields \['n_heads', 'pool'\] come from the checkpoint"):
        models.load_hf_vit(str(tmp_path), pool="mean", n_heads=2)


def test_matches_transformers(tmp_path):
    """Logits equal transformers' ViTForImageClassification's (float32), for a model transformers built and saved
    with save_pretrained, and for the directory save_hf_vit writes back.

    Skipped where torch or transformers does not import (CI); the GPU image has both (device step `hf-vit`)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                       num_labels=5)
    model = transformers.ViTForImageClassification(hf_config).eval()
    with torch.no_grad():  # random weights of every scale (the init's are ~0.02, its biases 0 and norms 1)
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * (param.shape[-1] ** -0.5 if param.ndim > 1 else 0.3))
    model.save_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        ref = model(pixel_values=torch.as_tensor(PIXELS)).logits.numpy()
    config, params = models.load_hf_vit(str(tmp_path / "hf"), compute_dtype="float32")
    assert not config.gelu_approximate and config.norm_eps == hf_config.layer_norm_eps
    ours = _qjax_logits(config, params)
    assert snr_db(ref, ours) >= 60
    models.save_hf_vit(config, params, str(tmp_path / "saved"))
    reloaded = transformers.ViTForImageClassification.from_pretrained(str(tmp_path / "saved")).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(pixel_values=torch.as_tensor(PIXELS)).logits.numpy(), ref)
