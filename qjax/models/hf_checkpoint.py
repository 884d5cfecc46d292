"""Hugging Face model directories on disk: config.json and safetensors, one file or shards with an index.

`hf_llama` and `hf_vit` map their model's tensors; this module reads and writes the files for both:

  hf = read_config(path)                               # config.json as a dict
  tensors = read_tensors(path, {name: shape, ...})     # numpy arrays, shapes checked
  write_checkpoint(out_dir, tensors, hf, dtype="bfloat16", max_shard_bytes=None, caller="save_hf_vit")

A directory holds `config.json` and either `model.safetensors` or shards named by `model.safetensors.index.json`
(its "weight_map": tensor name -> file).
"""

import json
import os

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def read_config(path: str) -> dict:
    """The config.json of the Hugging Face model directory `path`, as a dict."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path} has no config.json (a Hugging Face model directory has one)")
    with open(config_path) as f:
        return json.load(f)


def config_fields(hf: dict, names: dict[str, str], defaults: dict) -> dict:
    """qjax config fields from a config.json dict: names maps each Hugging Face key to its qjax field; a key missing
    from hf takes its value in `defaults` (transformers' default), else a ValueError names it."""
    fields = {}
    for hf_name, name in names.items():
        if hf_name in hf:
            fields[name] = hf[hf_name]
        elif hf_name in defaults:
            fields[name] = defaults[hf_name]
        else:
            raise ValueError(f"config.json has no {hf_name!r}")
    return fields


def read_tensors(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """{name: array} for every name of `shapes` from the directory's single file or its sharded index, in the stored
    dtype. ValueError naming the tensor for one that is missing or not of its shape in `shapes`."""
    index_path, single_path = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map' object")
    elif os.path.exists(single_path):
        weight_map = {}
    else:
        raise ValueError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    by_file: dict[str, list[str]] = {}
    for name in shapes:
        if weight_map and name not in weight_map:
            raise ValueError(f"checkpoint {path} is missing tensor {name} (not in {INDEX_FILE})")
        by_file.setdefault(weight_map.get(name, SINGLE_FILE), []).append(name)
    out = {}
    for file, wanted in by_file.items():
        with safetensors.safe_open(os.path.join(path, file), framework="numpy") as f:
            present = set(f.keys())
            for name in wanted:
                if name not in present:
                    raise ValueError(f"checkpoint {path} is missing tensor {name} (looked in {file})")
                out[name] = f.get_tensor(name)
    for name, shape in shapes.items():
        if out[name].shape != shape:
            raise ValueError(f"tensor {name} has shape {out[name].shape}, config.json implies {shape}")
    return out


def write_checkpoint(out_dir: str, tensors: dict[str, np.ndarray], hf_config: dict, *, dtype: str | None,
                     max_shard_bytes: int | None, caller: str) -> None:
    """Writes config.json (`hf_config` with its torch_dtype set) and the tensors: model.safetensors, or shards of at
    most `max_shard_bytes` each plus model.safetensors.index.json.

    dtype: "float32", "bfloat16" or "float16" for the tensors; None keeps theirs (which must then be one dtype).
    caller: the public function's name, for its error messages.
    """
    if dtype is not None:
        if dtype not in NUMPY_DTYPES:
            raise ValueError(f"{caller} dtype must be one of {tuple(NUMPY_DTYPES)}, got {dtype!r}")
        tensors = {name: x.astype(NUMPY_DTYPES[dtype]) for name, x in tensors.items()}
    stored = {x.dtype.name for x in tensors.values()}
    if len(stored) != 1:
        raise ValueError(f"params mix dtypes {sorted(stored)}; pass {caller}(..., dtype=...)")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(hf_config, torch_dtype=stored.pop()), f, indent=2)
    metadata = {"format": "pt"}  # transformers' loader checks for it
    if max_shard_bytes is None:
        safetensors.numpy.save_file(tensors, os.path.join(out_dir, SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    for name, x in tensors.items():
        if shards[-1] and sum(y.nbytes for y in shards[-1].values()) + x.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][name] = x
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.numpy.save_file(shard, os.path.join(out_dir, file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(x.nbytes for x in tensors.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
