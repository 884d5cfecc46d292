"""Hugging Face ViT checkpoints (config.json + safetensors) in and out of qjax's `ViT`.

  config, params = load_hf_vit("path/to/hf_dir", recipe="int8_rowwise")   # ViTConfig, float32 param tree
  logits = ViT(config).apply({"params": params}, images)                 # images: pixel_values (B, C, H, W)
                                                                         # transposed to (B, H, W, C)
  save_hf_vit(config, params, "out_dir")                                 # transformers' ViTForImageClassification

`ViTForImageClassification` (google/vit-base-patch16-224) and `ViTModel` (no classifier: pass num_classes, the head
starts at zero) directories load; the files are read as `hf_checkpoint` describes. Tensor names, P being "vit." for
ViTForImageClassification and "" for ViTModel, and the qjax parameter they become (HF stores linear weights as
(out, in); qjax kernels are (in, out), the transpose; q|k|v are one fused kernel):

  P embeddings.patch_embeddings.projection.{weight,bias}   patch_embed/{kernel,bias}   the conv weight (dim, C, p, p)
                                                            as (p * p * C, dim): `patchify`'s (p, p, C) order
  P embeddings.cls_token                                    cls_token (1, 1, dim)
  P embeddings.position_embeddings                          pos_embed (1, 1 + patches, dim)
  P encoder.layer.{i}.layernorm_before.{weight,bias}        layers_{i}/attn_norm/{scale,bias}
  P encoder.layer.{i}.attention.attention.{query,key,value}.{weight,bias}    layers_{i}/attn/qkv_proj  [q | k | v]
  P encoder.layer.{i}.attention.output.dense.{weight,bias}  layers_{i}/attn/o_proj/{kernel,bias}
  P encoder.layer.{i}.layernorm_after.{weight,bias}         layers_{i}/mlp_norm/{scale,bias}
  P encoder.layer.{i}.intermediate.dense.{weight,bias}      layers_{i}/mlp/fc1/{kernel,bias}
  P encoder.layer.{i}.output.dense.{weight,bias}            layers_{i}/mlp/fc2/{kernel,bias}
  P layernorm.{weight,bias}                                 norm/{scale,bias}
  classifier.{weight,bias}                                  head/{kernel,bias}

HF ViT is qjax's ViT with pool="cls" (the classifier reads the class token after the final LayerNorm), the
config's layer_norm_eps (1e-12 by default) and, for hidden_act "gelu", the exact erf GELU (gelu_approximate=False);
"gelu_pytorch_tanh" / "gelu_new" map to the tanh form. ViTModel's pooler (dense + tanh, unused by the classifier) is
not loaded. Dropout is not modelled (qjax's ViT has none): fine-tuning from a checkpoint trained with dropout runs
without it.
"""

import jax
import numpy as np

from qjax.models.hf_checkpoint import NUMPY_DTYPES, config_fields, read_config, read_tensors, write_checkpoint
from qjax.models.vit import ViTConfig

_ARCHITECTURES = {"ViTForImageClassification": "vit.", "ViTModel": ""}  # -> tensor name prefix
# config.json field -> ViTConfig field.
_CONFIG_FIELDS = {"image_size": "image_size", "patch_size": "patch_size", "num_channels": "channels",
                  "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                  "intermediate_size": "mlp_dim", "layer_norm_eps": "norm_eps"}
_DEFAULTS = {"num_channels": 3, "layer_norm_eps": 1e-12}  # transformers' ViTConfig defaults
_GELU_APPROXIMATE = {"gelu": False, "gelu_pytorch_tanh": True, "gelu_new": True}  # hidden_act -> gelu_approximate
# ViTConfig fields the checkpoint's tensors fix: an override would misread them (n_heads) or fail on a shape.
_FIXED = ("image_size", "patch_size", "channels", "dim", "n_layers", "n_heads", "mlp_dim", "pool")


def _architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or ["ViTModel"]
    if hf.get("model_type") != "vit" or len(architectures) != 1 or architectures[0] not in _ARCHITECTURES:
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} / architectures "
                         f"{hf.get('architectures')!r}; only model_type 'vit', {' or '.join(_ARCHITECTURES)} loads")
    return architectures[0]


def head_classes(hf: dict) -> int | None:
    """The class count of a config.json dict's classifier: ViTForImageClassification's num_labels (transformers
    writes id2label, num_labels is its length; default 2), None for a ViTModel (no classifier)."""
    if _architecture(hf) != "ViTForImageClassification":
        return None
    if "num_labels" in hf:
        return hf["num_labels"]
    return len(hf["id2label"]) if hf.get("id2label") else 2


def config_from_hf(hf: dict, **overrides) -> ViTConfig:
    """The `ViTConfig` of a Hugging Face ViT config.json dict; `overrides` replace ViTConfig fields (recipe,
    compute_dtype, num_classes, ...). ViTModel has no classifier: num_classes must be among the overrides.
    ValueError naming the field for anything qjax's ViT does not compute the same way."""
    architecture = _architecture(hf)
    fixed = sorted(set(overrides) & set(_FIXED))
    if fixed:
        raise ValueError(f"ViTConfig fields {fixed} come from the checkpoint and cannot be overridden")
    if hf.get("qkv_bias", True) is not True:
        raise ValueError(f"config.json: qkv_bias={hf['qkv_bias']!r} is not supported (qjax's ViT needs True)")
    act = hf.get("hidden_act", "gelu")
    if act not in _GELU_APPROXIMATE:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported (qjax's ViT runs "
                         f"{' or '.join(map(repr, _GELU_APPROXIMATE))})")
    fields = config_fields(hf, _CONFIG_FIELDS, _DEFAULTS)
    fields.update(pool="cls", gelu_approximate=_GELU_APPROXIMATE[act])
    if architecture == "ViTForImageClassification":
        fields["num_classes"] = head_classes(hf)
    elif "num_classes" not in overrides:
        raise ValueError("config.json: ViTModel has no classifier; pass num_classes=... for a new (zero) head")
    fields.update(overrides)
    return ViTConfig(**fields)


def config_to_hf(config: ViTConfig) -> dict:
    """The Hugging Face ViTForImageClassification config.json dict of `config` (`write_checkpoint` adds
    torch_dtype). ValueError for a config HF ViT does not compute (mean pooling)."""
    if config.pool != "cls":
        raise ValueError(f"save_hf_vit needs ViTConfig.pool='cls' (HF ViT classifies its class token), got "
                         f"{config.pool!r}")
    hf = {hf_name: getattr(config, name) for hf_name, name in _CONFIG_FIELDS.items()}
    hf.update(architectures=["ViTForImageClassification"], model_type="vit", qkv_bias=True,
              hidden_act="gelu_pytorch_tanh" if config.gelu_approximate else "gelu",
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              id2label={str(i): f"LABEL_{i}" for i in range(config.num_classes)},
              label2id={f"LABEL_{i}": i for i in range(config.num_classes)})
    return hf


def _tensor_names(config: ViTConfig, prefix: str) -> dict[str, str]:
    """{qjax param path ("layers_0/attn/o_proj/kernel", ...): HF tensor name}, every tensor but q/k/v's and the
    classifier's (those have no one-to-one param)."""
    names = {"patch_embed/kernel": "embeddings.patch_embeddings.projection.weight",
             "patch_embed/bias": "embeddings.patch_embeddings.projection.bias",
             "cls_token": "embeddings.cls_token", "pos_embed": "embeddings.position_embeddings",
             "norm/scale": "layernorm.weight", "norm/bias": "layernorm.bias"}
    per_layer = {"attn_norm": "layernorm_before", "attn/o_proj": "attention.output.dense",
                 "mlp_norm": "layernorm_after", "mlp/fc1": "intermediate.dense", "mlp/fc2": "output.dense"}
    for i in range(config.n_layers):
        for ours, theirs in per_layer.items():
            weight = "scale" if ours.endswith("norm") else "kernel"
            names[f"layers_{i}/{ours}/{weight}"] = f"encoder.layer.{i}.{theirs}.weight"
            names[f"layers_{i}/{ours}/bias"] = f"encoder.layer.{i}.{theirs}.bias"
    return {path: prefix + name for path, name in names.items()}


def _qkv_names(prefix: str, i: int) -> list[str]:
    return [f"{prefix}encoder.layer.{i}.attention.attention.{x}" for x in ("query", "key", "value")]


def expected_shapes(config: ViTConfig, *, prefix: str = "vit.", classifier: bool = True
                    ) -> dict[str, tuple[int, ...]]:
    """{tensor name: (shape)} of every tensor `load_hf_vit` reads from a checkpoint of `config`, HF layout ((out, in)
    weights). prefix: "vit." (ViTForImageClassification) or "" (ViTModel); classifier: whether its head is read."""
    d, m, p = config.dim, config.mlp_dim, config.patch_size
    shapes = {"patch_embed/kernel": (d, config.channels, p, p), "patch_embed/bias": (d,), "cls_token": (1, 1, d),
              "pos_embed": (1, config.num_tokens, d), "norm/scale": (d,), "norm/bias": (d,)}
    per_layer = {"attn_norm/scale": (d,), "attn_norm/bias": (d,), "attn/o_proj/kernel": (d, d),
                 "attn/o_proj/bias": (d,), "mlp_norm/scale": (d,), "mlp_norm/bias": (d,),
                 "mlp/fc1/kernel": (m, d), "mlp/fc1/bias": (m,), "mlp/fc2/kernel": (d, m), "mlp/fc2/bias": (d,)}
    shapes.update({f"layers_{i}/{path}": shape for i in range(config.n_layers) for path, shape in per_layer.items()})
    out = {name: shapes[path] for path, name in _tensor_names(config, prefix).items()}
    for i in range(config.n_layers):
        for name in _qkv_names(prefix, i):
            out.update({name + ".weight": (d, d), name + ".bias": (d,)})
    if classifier:
        out.update({"classifier.weight": (config.num_classes, d), "classifier.bias": (config.num_classes,)})
    return out


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def load_hf_vit(path: str, **overrides) -> tuple[ViTConfig, dict]:
    """(ViTConfig, params) of the Hugging Face ViT checkpoint directory `path`.

    overrides: ViTConfig fields to replace (recipe, compute_dtype, param_dtype, ...; not the shape fields or pool,
    which the checkpoint fixes). num_classes other than the checkpoint's classifier's (or any, for a ViTModel)
    gives a new head of zeros, as `ViT.init` makes it, for fine-tuning on other classes. The params are a pytree
    of numpy arrays in `config.param_dtype` shaped as `ViT(config).init` makes them. ValueError naming the tensor
    or config.json field for a missing tensor, a wrong shape or a model qjax's ViT does not compute.
    """
    hf = read_config(path)
    config = config_from_hf(hf, **overrides)
    keep_head = config.num_classes == head_classes(hf)
    prefix = _ARCHITECTURES[_architecture(hf)]
    dtype = NUMPY_DTYPES[config.param_dtype]
    shapes = expected_shapes(config, prefix=prefix, classifier=keep_head)
    t = {name: np.asarray(x).astype(dtype) for name, x in read_tensors(path, shapes).items()}
    params: dict = {}
    for param, name in _tensor_names(config, prefix).items():
        x = t[name]
        if param.endswith("kernel"):
            # Linear (out, in) -> (in, out); the patch conv (dim, C, p, p) -> (p, p, C, dim) -> (p * p * C, dim).
            x = x.transpose(2, 3, 1, 0).reshape(-1, config.dim) if param == "patch_embed/kernel" else x.T
        _set(params, param, x)
    for i in range(config.n_layers):
        q, k, v = _qkv_names(prefix, i)
        params[f"layers_{i}"]["attn"]["qkv_proj"] = {
            "kernel": np.concatenate([t[q + ".weight"], t[k + ".weight"], t[v + ".weight"]]).T,
            "bias": np.concatenate([t[q + ".bias"], t[k + ".bias"], t[v + ".bias"]])}
    if keep_head:
        params["head"] = {"kernel": t["classifier.weight"].T, "bias": t["classifier.bias"]}
    else:
        params["head"] = {"kernel": np.zeros((config.dim, config.num_classes), dtype),
                          "bias": np.zeros((config.num_classes,), dtype)}
    # Contiguous copies: the transposes above are views, and safetensors / device_put want dense arrays.
    return config, jax.tree.map(np.ascontiguousarray, params)


def hf_tensors(config: ViTConfig, params) -> dict[str, np.ndarray]:
    """{HF tensor name: array} (ViTForImageClassification) of a qjax ViT param tree: `load_hf_vit`'s inverse."""
    p = jax.tree.map(np.asarray, params)
    out = {}
    for param, name in _tensor_names(config, "vit.").items():
        x = p
        for key in param.split("/"):
            x = x[key]
        if param == "patch_embed/kernel":
            pp = config.patch_size
            x = x.reshape(pp, pp, config.channels, config.dim).transpose(3, 2, 0, 1)
        elif param.endswith("kernel"):
            x = x.T
        out[name] = x
    for i in range(config.n_layers):
        qkv = p[f"layers_{i}"]["attn"]["qkv_proj"]
        for name, w, b in zip(_qkv_names("vit.", i), np.split(qkv["kernel"].T, 3), np.split(qkv["bias"], 3)):
            out.update({name + ".weight": w, name + ".bias": b})
    out.update({"classifier.weight": p["head"]["kernel"].T, "classifier.bias": p["head"]["bias"]})
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def save_hf_vit(config: ViTConfig, params, out_dir: str, *, dtype: str | None = None,
                max_shard_bytes: int | None = None) -> None:
    """Writes `params` as a Hugging Face ViTForImageClassification checkpoint: config.json and model.safetensors,
    or shards of at most `max_shard_bytes` each plus model.safetensors.index.json.

    dtype: "float32", "bfloat16" or "float16" for the tensors; None keeps the params' dtype. ValueError for
    pool="mean" (HF ViT classifies the class token).
    """
    write_checkpoint(out_dir, hf_tensors(config, params), config_to_hf(config), dtype=dtype,
                     max_shard_bytes=max_shard_bytes, caller="save_hf_vit")
