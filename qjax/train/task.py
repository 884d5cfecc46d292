"""What is trained: the data and the model of a config, the model's loss on a batch, and how its work is counted.

  dataset = make_dataset(config)                                   # config.data (qjax.data); ConfigError on a problem
  task = make_task_for_data(config, dataset)                       # make_task with the data's vocabulary / classes
  task = make_task(config, vocab_size=dataset.vocab_size)          # "lm": Llama (or GPT-2) on {"inputs", "targets"}
  task = make_task(config, num_classes=10, image_shape=(8, 8, 1))  # "image": ViT on {"images", "labels"}
  loss, aux = task.loss(params, batch, key)                        # float32 scalar, {"accuracy": ...} for images

The model config is the `config.model.size` preset of the `config.model.arch` family ("llama" when absent, or
"gpt2"; "lm" tasks only) with every non-None `config.model.<field>` replacing that field,
plus the run-level `recipe`, `keep_high_precision` and `min_features`, plus what the data dictates (vocab size,
number of classes, image shape; omitted -> the preset's, which is how benchmarks run a model on random inputs).
A `config.model.vocab_size` of its own may pad the data's vocabulary but not cut it (ConfigError).

`config.model.param_dtype="int8"` is INT8 weight-only training: the model is built with float32 params and `init`
turns every projection's kernel into a `qjax.optim.Int8Param` (int8 codes + one float32 scale per output channel,
no float copy); norms and embeddings are kept in the model's compute dtype (bfloat16 by default) and updated with
stochastic rounding, as `param_dtype="bfloat16"` params are. The model's layers take the Int8Param as it is (a
recipe whose forward reads the weight as int8 rows runs the stored codes on the int8 GEMM); the optimizer requantizes
them with stochastic rounding every step (`qjax.train.optimizer`). Their gradients and AdamW states are in the
compute dtype too, so an int8 weight costs 1 byte where a bfloat16 one costs 2, everything else equal.
With `config.init_from` (a Hugging Face Llama directory for "lm", ViT for "image") the shape comes from its
config.json instead, and the params are its weights (read by `init` through a host callback, so they never become
constants of the program). A ViT's classifier head is the checkpoint's when it has the data's number of classes;
otherwise (or for a ViTModel, which has none) a new zero head of the data's classes replaces it, which
`Task.init_note` says.

Batches with a "loss_mask" (instruction data: 1 on answer tokens) average the loss over the masked-in tokens only.

Your own model (`config.model.convert`, "lm" only): "package.module:factory" names a plain Flax linen model, written
with nn.Dense / nn.DenseGeneral / nn.Einsum / jnp.einsum and no qjax layers. The task calls factory(model_config)
(the run's LlamaConfig / GPT2Config: its shape, dtypes and eps) and trains
`qjax.quantize_model(model, config.recipe, skip=keep_high_precision, min_features=min_features)`
in place of qjax's explicit model. It follows qjax's LM convention: model(tokens, return_hidden=True) -> the final
norm's output (B, T, dim), and the LM head in its params as lm_head/kernel (dim, vocab) or a tied embed/embedding,
because the head and its loss run from the params (`models.lm_head_loss`). `qjax.train.mesh` splits its params
by path (names like qkv_proj and down_proj also take tensor parallelism); the start-up lines and memory estimate
describe the arch's model of the config's shape. Why a config field and not a Python argument: a run is its
config, so train.py takes it on the command line, config.json records it and a restarted process rebuilds the same
model to resume from its checkpoints. docs/quantize_model.md has an example.
"""

import dataclasses
import functools
import importlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qjax import convert, dispatch, health, models
from qjax import data as data_lib
from qjax.models import hf_checkpoint, hf_vit
from qjax import int8_params
from qjax.train.config import ConfigError

INT8 = "int8"  # config.model.param_dtype of INT8 weight-only training (module docstring)


@dataclasses.dataclass(frozen=True)
class Task:
    """A model and its training objective.

    Attributes:
      kind: "lm" or "image".
      model_config: the `LlamaConfig` / `GPT2Config` / `ViTConfig` the model was built from.
      model: the Flax module.
      unit: what throughput counts, "tokens" or "images"; units_per_example: seq_len for "lm", 1 for "image".
      flops_per_unit: training FLOPs per token / image (for MFU).
      seq_len: tokens per example ("lm" only).
      int8_params: INT8 weight-only training: `init` returns the projections' kernels as Int8Param.
      init_from: a Hugging Face Llama ("lm") or ViT ("image") directory whose weights `init` returns (None: random
        init).
      init_note: one line for the run's start-up output on what init_from could not keep (a replaced classifier
        head); None when it kept everything or there is no init_from.
    """

    kind: str
    model_config: Any
    model: nn.Module
    unit: str
    units_per_example: int
    flops_per_unit: float
    seq_len: int | None = None
    int8_params: bool = False
    init_from: str | None = None
    init_note: str | None = None

    def input_key(self) -> str:
        return "inputs" if self.kind == "lm" else "images"

    def dummy_batch(self, batch_size: int) -> dict:
        """Zeros shaped like a data batch of `batch_size` examples (for init and benchmarks)."""
        c = self.model_config
        if self.kind == "lm":
            tokens = jnp.zeros((batch_size, self.seq_len), jnp.int32)
            return {"inputs": tokens, "targets": tokens}
        return {"images": jnp.zeros((batch_size, c.image_size, c.image_size, c.channels), jnp.float32),
                "labels": jnp.zeros((batch_size,), jnp.int32)}

    def init(self, key: jax.Array, batch_size: int = 1):
        """Fresh params for `key` (the "quant" stream gets its own key, used only by stochastic recipes)."""
        params_key, quant_key = jax.random.split(key)
        inputs = self.dummy_batch(batch_size)[self.input_key()]

        def init():
            # Only the params come out of init; its forward pass is traced without a mesh, where backend "auto"
            # would warn on several GPUs that the kernels are off. The reference GEMMs keep it quiet.
            with dispatch.force("reference"):
                return self.model.init({"params": params_key, "quant": quant_key}, inputs)["params"]

        if self.init_from is None:
            params = init()
        else:
            # Under jit, arrays read here would be baked into the program as constants (GBs for a 1B model): read
            # them in a host callback instead, shaped and typed like the model's own init.
            c = self.model_config
            if self.kind == "lm":
                load = lambda: models.load_hf_llama(self.init_from, param_dtype=c.param_dtype)[1]
            else:  # num_classes other than the checkpoint's head's: load_hf_vit gives a new zero head
                load = lambda: models.load_hf_vit(self.init_from, num_classes=c.num_classes,
                                                  param_dtype=c.param_dtype)[1]
            params = jax.pure_callback(load, jax.eval_shape(init))
        if not self.int8_params:
            return params
        compute = jnp.dtype(self.model_config.compute_dtype)
        return jax.tree_util.tree_map_with_path(
            lambda path, p: int8_params.quantize_int8_param(p) if path[-1].key == "kernel" else p.astype(compute),
            params)

    def _apply(self, params, inputs, key, probes=None, mutable=("losses",)):
        # A language model's head runs inside the loss, over chunks of its vocabulary (`models.lm_head_loss`): the model
        # returns the hidden states, and the full float32 logits and their gradient never exist.
        variables = {"params": params} if probes is None else {"params": params, health.PROBES: probes}
        return self.model.apply(variables, inputs, rngs={"quant": key}, mutable=list(mutable),
                                **({"return_hidden": True} if self.kind == "lm" else {}))

    def health_probes(self):
        """Zeros for the model's gradient probes (`qjax.health`): the `probes` argument of `loss`."""
        inputs = self.dummy_batch(1)[self.input_key()]

        def probes():
            params = self.init(jax.random.key(0))
            return self._apply(params, inputs, jax.random.key(0), mutable=(health.COLLECTION, health.PROBES))[1]

        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(probes).get(health.PROBES, {}))

    def loss(self, params, batch: dict, key: jax.Array, probes=None) -> tuple[jax.Array, dict]:
        """(mean loss float32 (), aux dict of float32 () metrics) of `params` on one batch; `key` feeds "quant".
        A mixture-of-experts Llama's loss includes its layers' load-balancing losses, also reported as the metric
        "moe_aux_loss". With `probes` (`health_probes()`) the model measures its quantization health: aux["health"]
        holds the sown x and w stats, and the gradient with respect to `probes` the g stats (`qjax.health`)."""
        mutable = ("losses",) if probes is None else ("losses", health.COLLECTION)
        out, state = self._apply(params, batch[self.input_key()], key, probes, mutable)
        loss, aux = self._loss_of(out, state, params, batch, key)
        if probes is not None:
            aux = {**aux, "health": state.get(health.COLLECTION, {})}
        return loss, aux

    def _loss_of(self, out, state, params, batch, key):
        if self.kind == "lm":
            # instruction data ("loss_mask"): the answer tokens only
            loss = models.lm_head_loss(self.model_config, params, out, batch["targets"], batch.get("loss_mask"),
                                       jax.random.fold_in(key, 1))  # a stochastic head's own stream
            aux_losses = jax.tree.leaves(state.get("losses", {}))  # MoE layers' load-balancing losses, if any
            if not aux_losses:
                return loss, {}
            aux_loss = sum(aux_losses).astype(jnp.float32)
            return loss + aux_loss, {"moe_aux_loss": aux_loss}
        loss, accuracy = models.classification_loss(out, batch["labels"])
        return loss.astype(jnp.float32), {"accuracy": accuracy.astype(jnp.float32)}


def _model_overrides(config) -> dict:
    overrides = {k: v for k, v in config.model.items() if k not in ("size", "arch", "convert") and v is not None}
    if "moe" in overrides:  # a ConfigDict of MoEConfig's fields
        overrides["moe"] = models.MoEConfig(**overrides["moe"])
    if overrides.get("param_dtype") == INT8:
        overrides["param_dtype"] = "float32"  # what the model sees: its kernels become Int8Param after init
    overrides["recipe"] = config.recipe
    if config.get("keep_high_precision") is not None:
        overrides["keep_high_precision"] = tuple(config.keep_high_precision)
    if config.get("min_features") is not None:
        overrides["min_features"] = config.min_features
    return overrides


_NUMERICS_FIELDS = ("recipe", "keep_high_precision", "min_features", "compute_dtype", "param_dtype", "remat",
                    "recompute_attention", "attention", "smooth_swiglu")


def _check_no_shape(init_from: str, overrides: dict) -> None:
    shape = sorted(set(overrides) - set(_NUMERICS_FIELDS))
    if shape:
        raise ValueError(f"config.init_from={init_from!r} sets the model's shape: unset config.model.{shape[0]}")


def _check_vocab_size(overrides: dict, vocab_size: int | None) -> None:
    """config.model.vocab_size may pad the data's vocabulary (e.g. to a multiple of 128), never cut it: the data's
    tokenizer decides which ids occur."""
    chosen = overrides.get("vocab_size")
    if vocab_size is not None and chosen is not None and chosen < vocab_size:
        raise ValueError(f"config.model.vocab_size={chosen} is smaller than the {vocab_size} tokens of the data's "
                         "tokenizer, which decides the vocabulary: unset config.model.vocab_size (or set it >= "
                         f"{vocab_size} to pad the embedding)")


def _pretrained_config(init_from: str, overrides: dict, vocab_size: int | None) -> models.LlamaConfig:
    """The LlamaConfig of the checkpoint at `init_from` with the run's numerics; shape overrides are an error."""
    _check_no_shape(init_from, overrides)
    model_config = models.load_hf_config(init_from, **overrides)
    if vocab_size is not None and vocab_size > model_config.vocab_size:
        raise ValueError(f"the data's tokenizer has {vocab_size} tokens, the model at config.init_from only "
                         f"{model_config.vocab_size}: use the model's tokenizer (config.data.tokenizer)")
    return model_config


def _pretrained_vit_config(init_from: str, overrides: dict, num_classes: int | None,
                           image_shape: tuple[int, int, int] | None) -> tuple[models.ViTConfig, str | None]:
    """(the ViTConfig of the checkpoint at `init_from` with the run's numerics and the data's classes, the note of a
    replaced head or None). Shape overrides and images not of the checkpoint's (H, W, C) are errors."""
    _check_no_shape(init_from, overrides)
    hf = hf_checkpoint.read_config(init_from)
    if num_classes is not None:
        overrides = dict(overrides, num_classes=num_classes)
    model_config = hf_vit.config_from_hf(hf, **overrides)  # a ViTModel without num_classes: ValueError asking for it
    size, channels = model_config.image_size, model_config.channels
    if image_shape is not None and tuple(image_shape) != (size, size, channels):
        height, width, data_channels = image_shape
        fix = (f"resize them with --config.data.image_size={size}" if data_channels == channels else
               f"use {channels}-channel images")
        raise ValueError(f"the data's images are {height}x{width}x{data_channels}, the ViT at config.init_from takes "
                         f"{size}x{size}x{channels}: {fix}")
    head = hf_vit.head_classes(hf)
    if head == model_config.num_classes:
        return model_config, None
    had = f"classifier has {head} classes" if head else "is a ViTModel (no classifier)"
    return model_config, (f"init_from: the checkpoint's {had}, the data {model_config.num_classes}: a new "
                          f"zero-initialized head of {model_config.num_classes} classes replaces it")


def _import_factory(path: str):
    """The object that "package.module:name" (name may be dotted) names; ValueError saying what is wrong."""
    module_name, colon, name = path.partition(":")
    if not (module_name and colon and name):
        raise ValueError(f"config.model.convert must be 'package.module:factory', got {path!r}")
    try:
        target = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"config.model.convert={path!r}: cannot import {module_name!r} ({e}); put its package on "
                         "PYTHONPATH") from None
    for part in name.split("."):
        if not hasattr(target, part):
            raise ValueError(f"config.model.convert={path!r}: {module_name} has no {name!r}")
        target = getattr(target, part)
    return target


@functools.lru_cache(maxsize=8)
def _converted_model(path: str, model_config, recipe) -> nn.Module:
    """factory(model_config), converted per the config's numerics (module docstring). Cached so that equal configs
    give an equal model, hence an equal Task and the train step's compile cache (`qjax.train.step`)."""
    model = _import_factory(path)(model_config)
    if not isinstance(model, nn.Module):
        raise TypeError(f"config.model.convert={path!r} returned {type(model).__name__}, not a flax.linen Module")
    if hasattr(type(model), "_qjax_rules"):
        raise TypeError(f"config.model.convert={path!r} returned a model qjax.quantize_model already converted: "
                        "return the plain model (the run converts it per config.recipe)")
    return convert.quantize_model(model, recipe, skip=model_config.keep_high_precision,
                                  min_features=model_config.min_features)


def _check_convertible(config) -> None:
    """ValueError for what config.model.convert does not combine with."""
    if config.task != "lm":
        raise ValueError("config.model.convert is for task 'lm' (its factory gets a LlamaConfig / GPT2Config)")
    if config.get("init_from"):
        raise ValueError("config.model.convert builds the model from scratch: unset config.init_from")
    if config.model.get("param_dtype") == INT8:
        raise ValueError("config.model.convert needs float params (int8 weight-only training runs qjax's explicit "
                         "layers): set config.model.param_dtype to float32 or bfloat16")
    if config.get("health_every"):
        raise ValueError("qjax.health measures qjax's explicit layers, not a converted model: set "
                         "config.health_every=0 with config.model.convert")


def make_task(config, *, vocab_size: int | None = None, num_classes: int | None = None,
              image_shape: tuple[int, int, int] | None = None) -> Task:
    """The task of a (checked) training config; data facts override the preset (module docstring)."""
    overrides = _model_overrides(config)
    int8 = config.model.get("param_dtype") == INT8
    convert_path = config.model.get("convert")
    try:
        if convert_path:
            _check_convertible(config)
        if int8:
            int8_params.check_recipe(config.recipe)
        if config.task == "lm":
            arch = models.LM_ARCHS[config.model.get("arch", "llama")]  # checked by check_config
            init_from = config.get("init_from")
            if init_from:
                model_config = _pretrained_config(init_from, overrides, vocab_size)
            else:
                _check_vocab_size(overrides, vocab_size)
                if vocab_size is not None:
                    overrides.setdefault("vocab_size", vocab_size)
                overrides.setdefault("max_seq_len", config.seq_len)
                model_config = arch.make_config(config.model.size, **overrides)
            if config.seq_len > model_config.max_seq_len:
                raise ValueError(f"config.seq_len {config.seq_len} exceeds config.model.max_seq_len "
                                 f"{model_config.max_seq_len}")
            if convert_path:
                model = _converted_model(convert_path, model_config, config.recipe)
            else:
                model = arch.model(model_config)
            return Task("lm", model_config, model, "tokens", config.seq_len,
                        models.flops_per_token(model_config, config.seq_len), seq_len=config.seq_len,
                        int8_params=int8, init_from=init_from or None)
        init_from, note = config.get("init_from") or None, None
        if init_from:
            model_config, note = _pretrained_vit_config(init_from, overrides, num_classes, image_shape)
        else:
            if num_classes is not None:
                overrides["num_classes"] = num_classes
            if image_shape is not None:
                height, width, channels = image_shape
                if height != width:
                    raise ValueError(f"the ViT takes square images, the data has {height}x{width}")
                overrides.update(image_size=height, channels=channels)
            model_config = models.vit_config(config.model.size, **overrides)
        return Task("image", model_config, models.ViT(model_config), "images", 1,
                    models.flops_per_example(model_config), int8_params=int8, init_from=init_from, init_note=note)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad model config (config.model.* / recipe / keep_high_precision / min_features): {e}") \
            from None


def make_dataset(config):
    """The dataset of a checked config; data errors become ConfigErrors naming config.data."""
    seq_len = config.seq_len if config.task == "lm" else None
    try:
        return data_lib.make_dataset(config.data, batch_size=config.batch_size, seq_len=seq_len, seed=config.seed)
    except (TypeError, ValueError, OSError) as e:
        raise ConfigError(f"config.data: {e}") from None


def make_task_for_data(config, dataset) -> Task:
    """`make_task` with the facts of `dataset` (`make_dataset`): its vocabulary, or its classes and image shape."""
    if config.task == "lm":
        if not hasattr(dataset, "vocab_size"):
            raise ConfigError(f"config.task='lm' needs token data, but config.data.kind={config.data.kind!r} is "
                              "image data; use configs/llama_*.py with kind='tokens', or task='image'")
        return make_task(config, vocab_size=dataset.vocab_size)
    if not hasattr(dataset, "num_classes"):
        raise ConfigError(f"config.task='image' needs image data, but config.data.kind={config.data.kind!r} is "
                          "token data")
    return make_task(config, num_classes=dataset.num_classes, image_shape=dataset.image_shape)
