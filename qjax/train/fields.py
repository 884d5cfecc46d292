"""The fields of a config file, for train.py: dotted names, one-line docs, and the error for a misspelled override.

  config = load_config("configs/llama_int8.py")
  print(show_config(config, "configs/llama_int8.py"))   # "steps = 300  # optimizer steps of the run ..." per field
  unknown_override_error(["--config.step=30"], config, "configs/llama_int8.py")
  # -> "unknown config field 'step'; did you mean 'steps'? (python train.py --config configs/llama_int8.py
  #     --show_config lists the fields)"

A field's doc is its trailing comment in the config file, or in the base config it imports (`from configs import
llama_base`): configs/llama_base.py and configs/vit_base.py put one field per line with its comment, so the doc
lives beside the default it describes and cannot drift into a separate table.
"""

import ast
import difflib
import importlib.util
import io
import pathlib
import re
import tokenize
from typing import Any

from ml_collections import config_dict


def load_config(path: str) -> config_dict.ConfigDict:
    """`get_config()` of the config file at `path` (imports like `from configs import llama_base` resolve against
    sys.path, which holds the repository root when train.py runs)."""
    spec = importlib.util.spec_from_file_location(f"_qjax_config_{pathlib.Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def flatten(config, prefix: str = "") -> dict[str, Any]:
    """{dotted field name: value} for every leaf of a ConfigDict ("optimizer.lr": 0.002); placeholders give None."""
    out = {}
    for key, value in config.items():
        if isinstance(value, config_dict.ConfigDict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _dotted(node) -> str | None:
    """"model.dim" for the assignment target `config.model.dim`; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or not parts:
        return None
    return ".".join(reversed(parts))


def field_docs(path) -> dict[str, str]:
    """{dotted field name: its trailing comment} of the config file at `path` and the sibling configs it imports.

    Handles `config.x = value  # doc` and the entries of `config.x = config_dict.ConfigDict({"y": value,  # doc`.
    """
    path = pathlib.Path(path)
    source = path.read_text()
    tree = ast.parse(source)
    docs = {}
    for node in ast.walk(tree):  # the base configs first, so the file's own comments win
        if isinstance(node, ast.ImportFrom) and (node.module == "configs" or node.level):
            for alias in node.names:
                sibling = path.parent / f"{alias.name}.py"
                if sibling.exists():
                    docs.update(field_docs(sibling))
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        name = _dotted(node.targets[0])
        if name is None:
            continue
        if node.lineno in comments:
            docs[name] = comments[node.lineno]
        value = node.value
        if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Dict):
            for key in value.args[0].keys:
                if isinstance(key, ast.Constant) and key.lineno in comments:
                    docs[f"{name}.{key.value}"] = comments[key.lineno]
    return docs


def show_config(config, path) -> str:
    """Every field of `config` as `name = value  # doc`, one per line, sorted by name (as ConfigDict keeps them)."""
    docs = field_docs(path)
    rows = [(f"{name} = {value!r}", docs.get(name, "")) for name, value in flatten(config).items()]
    width = max(len(left) for left, _ in rows)
    return "\n".join(f"{left:<{width}}  # {doc}" if doc else left for left, doc in rows)


def unknown_override_error(argv, config, config_arg: str) -> str | None:
    """The one-line error for the first `--config.<name>` in `argv` naming no field of `config`, else None."""
    names = set(flatten(config))
    names |= {name.rsplit(".", i)[0] for name in names for i in range(1, name.count(".") + 1)}  # "model", ...
    for arg in argv:
        match = re.match(r"-{1,2}(?:no)?config\.([^=]+)", arg)
        if match and match.group(1) not in names:
            field = match.group(1)
            close = difflib.get_close_matches(field, sorted(names), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            return (f"unknown config field '{field}'{hint} (python train.py --config {config_arg} --show_config "
                    "lists the fields)")
    return None
