"""Hugging Face Llama checkpoints (config.json + safetensors) in and out of qjax's `Llama`.

  config, params = load_hf_llama("path/to/hf_dir", recipe="int8_rowwise")   # LlamaConfig, float32 param tree
  logits = Llama(config).apply({"params": params}, tokens)
  save_hf_llama(config, params, "out_dir")                                   # transformers' LlamaForCausalLM reads it

A directory holds `config.json` and either `model.safetensors` or shards named by `model.safetensors.index.json`
(its "weight_map": tensor name -> file). Tensor names and the qjax parameter they become (HF stores every linear
weight as (out, in); qjax kernels are (in, out), the transpose; q|k|v and gate|up are one fused kernel each):

  model.embed_tokens.weight                          embed/embedding            (vocab, dim), as is
  model.layers.{i}.self_attn.{q,k,v}_proj.weight     layers_{i}/attn/qkv_proj/kernel      columns [q | k | v]
  model.layers.{i}.self_attn.o_proj.weight           layers_{i}/attn/o_proj/kernel
  model.layers.{i}.mlp.{gate,up}_proj.weight         layers_{i}/mlp/gate_up_proj/kernel   columns [gate | up]
  model.layers.{i}.mlp.down_proj.weight              layers_{i}/mlp/down_proj/kernel
  model.layers.{i}.{input,post_attention}_layernorm.weight   layers_{i}/{attn,mlp}_norm/scale
  model.norm.weight                                  norm/scale
  lm_head.weight                                     lm_head/kernel (absent when tie_word_embeddings)

RoPE needs no permutation: Hugging Face's Llama q/k weights are laid out for `rotate_half` (the pairs are
(x[i], x[i + head_dim / 2])), which is `qjax.models.ops.apply_rope`'s pairing, with the same frequencies
theta^(-2i / head_dim). Tensors load as float32 (or `param_dtype`); a bfloat16 checkpoint loads exactly.
"""

import jax
import numpy as np

from qjax.models.hf_checkpoint import NUMPY_DTYPES, config_fields, read_config, read_tensors, write_checkpoint
from qjax.models.llama import LlamaConfig

# config.json field -> LlamaConfig field.
_CONFIG_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
                  "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
                  "intermediate_size": "ffn_dim", "max_position_embeddings": "max_seq_len",
                  "tie_word_embeddings": "tie_embeddings", "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps"}
_DEFAULTS = {"num_key_value_heads": None, "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
    """The `LlamaConfig` of a Hugging Face Llama config.json dict; `overrides` replace LlamaConfig fields (recipe,
    compute_dtype, ...). ValueError naming the field for anything qjax's Llama does not compute the same way."""
    if hf.get("model_type") != "llama" or hf.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} / architectures "
                         f"{hf.get('architectures')!r}; only model_type 'llama', LlamaForCausalLM loads")
    required = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    for field, value in required.items():
        if hf.get(field, value) != value:
            raise ValueError(f"config.json: {field}={hf[field]!r} is not supported (qjax's Llama needs {value!r})")
    # transformers 5 nests the RoPE base in rope_parameters; older versions write rope_theta (and rope_scaling).
    for field in ("rope_scaling", "rope_parameters"):
        rope = hf.get(field) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"config.json: {field}={rope!r} is not supported (qjax's Llama runs plain RoPE)")
    if "rope_theta" in (hf.get("rope_parameters") or {}):
        hf = dict(hf, rope_theta=hf["rope_parameters"]["rope_theta"])
    fields = config_fields(hf, _CONFIG_FIELDS, _DEFAULTS)
    if fields["n_kv_heads"] is None:
        fields["n_kv_heads"] = fields["n_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != fields["dim"] // fields["n_heads"]:
        raise ValueError(f"config.json: head_dim {head_dim} != hidden_size / num_attention_heads; qjax's Llama "
                         "needs head_dim = hidden_size // num_attention_heads")
    fields.update(overrides)
    return LlamaConfig(**fields)


def config_to_hf(config: LlamaConfig) -> dict:
    """The Hugging Face config.json dict of `config` (`write_checkpoint` adds torch_dtype)."""
    hf = {hf_name: getattr(config, name) for hf_name, name in _CONFIG_FIELDS.items()}
    hf.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", attention_bias=False,
              mlp_bias=False, head_dim=config.head_dim, bos_token_id=None, eos_token_id=None)
    return hf


def _layer_tensors(i: int) -> dict[str, str]:
    prefix = f"model.layers.{i}."
    return {name: prefix + name + ".weight" for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """{tensor name: (shape)} of every tensor a checkpoint of `config` must hold, HF layout ((out, in) weights)."""
    d, f, kv = config.dim, config.ffn_dim, config.n_kv_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    per_layer = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
                 "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
                 "mlp.down_proj": (d, f), "input_layernorm": (d,), "post_attention_layernorm": (d,)}
    for i in range(config.n_layers):
        shapes.update({tensor: per_layer[name] for name, tensor in _layer_tensors(i).items()})
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def load_hf_config(path: str, **overrides) -> LlamaConfig:
    """The `LlamaConfig` of the Hugging Face model directory `path` (its config.json), `overrides` replaced."""
    return config_from_hf(read_config(path), **overrides)


def load_hf_llama(path: str, **overrides) -> tuple[LlamaConfig, dict]:
    """(LlamaConfig, params) of the Hugging Face Llama checkpoint directory `path`.

    overrides: LlamaConfig fields to replace (recipe, compute_dtype, param_dtype, ...). The params are a pytree of
    numpy arrays in `config.param_dtype` shaped as `Llama(config).init` makes them. ValueError naming the tensor
    or config.json field for a missing tensor, a wrong shape or a model qjax's Llama does not compute.
    """
    config = load_hf_config(path, **overrides)
    tensors = read_tensors(path, expected_shapes(config))
    dtype = NUMPY_DTYPES[config.param_dtype]
    t = {name: np.asarray(x).astype(dtype) for name, x in tensors.items()}
    params = {"embed": {"embedding": t["model.embed_tokens.weight"]}, "norm": {"scale": t["model.norm.weight"]}}
    for i in range(config.n_layers):
        n = {name: t[tensor] for name, tensor in _layer_tensors(i).items()}
        params[f"layers_{i}"] = {
            "attn_norm": {"scale": n["input_layernorm"]},
            "attn": {"qkv_proj": {"kernel": np.concatenate(
                         [n["self_attn.q_proj"], n["self_attn.k_proj"], n["self_attn.v_proj"]]).T},
                     "o_proj": {"kernel": n["self_attn.o_proj"].T}},
            "mlp_norm": {"scale": n["post_attention_layernorm"]},
            "mlp": {"gate_up_proj": {"kernel": np.concatenate([n["mlp.gate_proj"], n["mlp.up_proj"]]).T},
                    "down_proj": {"kernel": n["mlp.down_proj"].T}},
        }
    if not config.tie_embeddings:
        params["lm_head"] = {"kernel": t["lm_head.weight"].T}
    # Contiguous copies: the transposes above are views, and safetensors / device_put want dense arrays.
    return config, jax.tree.map(np.ascontiguousarray, params)


def hf_tensors(config: LlamaConfig, params) -> dict[str, np.ndarray]:
    """{HF tensor name: array} of a qjax Llama param tree (the inverse of `load_hf_llama`'s mapping)."""
    p = jax.tree.map(np.asarray, params)
    d, kv, f = config.dim, config.n_kv_heads * config.head_dim, config.ffn_dim
    out = {"model.embed_tokens.weight": p["embed"]["embedding"], "model.norm.weight": p["norm"]["scale"]}
    for i in range(config.n_layers):
        layer, names = p[f"layers_{i}"], _layer_tensors(i)
        q, k, v = np.split(layer["attn"]["qkv_proj"]["kernel"].T, [d, d + kv])
        gate, up = np.split(layer["mlp"]["gate_up_proj"]["kernel"].T, [f])
        out.update({names["self_attn.q_proj"]: q, names["self_attn.k_proj"]: k, names["self_attn.v_proj"]: v,
                    names["self_attn.o_proj"]: layer["attn"]["o_proj"]["kernel"].T,
                    names["mlp.gate_proj"]: gate, names["mlp.up_proj"]: up,
                    names["mlp.down_proj"]: layer["mlp"]["down_proj"]["kernel"].T,
                    names["input_layernorm"]: layer["attn_norm"]["scale"],
                    names["post_attention_layernorm"]: layer["mlp_norm"]["scale"]})
    if not config.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"]["kernel"].T
    return {name: np.ascontiguousarray(x) for name, x in out.items()}


def save_hf_llama(config: LlamaConfig, params, out_dir: str, *, dtype: str | None = None,
                  max_shard_bytes: int | None = None) -> None:
    """Writes `params` as a Hugging Face Llama checkpoint: config.json and model.safetensors, or shards of at most
    `max_shard_bytes` each plus model.safetensors.index.json.

    dtype: "float32", "bfloat16" or "float16" for the tensors; None keeps the params' dtype.
    """
    write_checkpoint(out_dir, hf_tensors(config, params), config_to_hf(config), dtype=dtype,
                     max_shard_bytes=max_shard_bytes, caller="save_hf_llama")
