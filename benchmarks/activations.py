"""What a Llama block saves for its backward, per recipe: the residuals `saved_residuals` reports, per token.

  python benchmarks/activations.py                      # 1.1B block ("1b"), batch 1 x seq 2048, abstract inputs
  python benchmarks/activations.py --size tiny --seq 64 --recipes bf16,int8_rowwise --append
  python benchmarks/activations.py --recipes bf16,int8_dataflow,int8_dataflow_recompute
  python benchmarks/activations.py --recipes bf16,int8_dataflow,int8_dataflow:recompute_attention

Recipes are named as benchmarks/common.py's `recipe_variant` names them: a data-flow recipe followed by
"_recompute" is that recipe with `Recipe.recompute_prologue_output` (the fused norms' and SwiGLU's outputs
recomputed in the backward instead of saved); "_recompute_w" also with `Recipe.recompute_weight_codes` (the
weights' dgrad codes re-quantized in the backward). Any name may end in ":recompute_attention"
(`LlamaConfig.recompute_attention`: the block input saved instead of attention's inputs).

Traces the vjp of one `qjax.models.llama.Block` on ShapeDtypeStruct inputs (nothing is computed, so it runs on
CPU in a few seconds at any size) and prints, per recipe, a table of the residuals grouped by where they come
from (`jax._src.ad_checkpoint.saved_residuals`'s description: producing primitive, file:line, function), with
shape, dtype and bytes per token, then the total per token and its ratio to the first recipe (bf16 by default).

Each residual falls in one of three kinds, told apart by tracing the block twice, at batch B and 2B:
  activation          its size doubles with the batch; counted in the per-token total.
  attention internal  its size doubles too, but it is produced inside `qjax.models.layers.attention`
                      (jax.nn.dot_product_attention) and is laid out heads-first, not (batch, seq, ...): the
                      scores, mask, probabilities and softmax sums of the XLA path, which flash attention does not
                      keep (it keeps a logsumexp). q, k, v and the attention output are (batch, seq, ...) views and
                      count as activations. Reported per token, excluded from the total.
  per step            its size does not change with the batch: the compute-dtype or 8-bit copies of the weights,
                      their scales, RNG seeds. Reported in bytes per step, excluded from the total.
  param               a parameter of the block itself (saved as it is, e.g. under Recipe.recompute_weight_codes):
                      live anyway, so it costs the backward nothing. Listed, never summed.
The batch, not the shape, decides "per token": at seq 2048 a quantized (2048, 2048) activation and a quantized
2048 x 2048 weight look alike.
"""

import argparse
import collections
import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals

from common import REPO, record_results, recipe_variant

sys.path.insert(0, str(REPO))  # this checkout's qjax, not whichever one is installed
from qjax.models import llama  # noqa: E402

KINDS = ("activation", "attention internal", "per step", "param")
def block_residuals(config: llama.LlamaConfig, batch: int, seq: int) -> list[tuple[jax.ShapeDtypeStruct, str]]:
    """[(aval, source)] that the vjp of one block saves, traced on abstract inputs x (batch, seq, dim)."""
    block = llama.Block(config)
    x = jax.ShapeDtypeStruct((batch, seq, config.dim), jnp.dtype(config.compute_dtype))
    positions = jnp.arange(seq)
    params = jax.eval_shape(block.init, jax.random.key(0), x, positions)
    # A scalar loss: what the block saves does not depend on what follows it.
    loss = lambda p, x: block.apply(p, x, positions, rngs={"quant": jax.random.key(0)}).astype(jnp.float32).sum()
    return saved_residuals(loss, params, x)


def short_source(source: str) -> str:
    """The description without absolute paths: 'output of mul from qjax/models/llama.py:152:14 (RMSNorm...)'."""
    source = source.replace(str(REPO) + "/", "")
    return re.sub(r"/\S*/site-packages/", "", source)


def nbytes(aval) -> int:
    return aval.size * aval.dtype.itemsize


def classify(config: llama.LlamaConfig, batch: int, seq: int) -> list[tuple[str, jax.ShapeDtypeStruct, str]]:
    """[(kind, aval at `batch`, short source)] for every residual of the block (kinds: see the module docstring)."""
    once, twice = block_residuals(config, batch, seq), block_residuals(config, 2 * batch, seq)
    if [s for _, s in once] != [s for _, s in twice]:
        raise RuntimeError("the block's residuals at batch B and 2B differ in kind or order; cannot pair them")
    out = []
    for (aval, source), (aval2, _) in zip(once, twice):
        if source.startswith("from the argument p["):  # p: the block's variables (block_residuals)
            kind = "param"  # the block's own parameters: live anyway, no memory of the backward's
        elif nbytes(aval2) == nbytes(aval):
            kind = "per step"
        elif nbytes(aval2) == 2 * nbytes(aval):
            in_attention = source.endswith("(attention)") and "qjax/models/layers.py" in source
            kind = "attention internal" if in_attention and aval.shape[:2] != (batch, seq) else "activation"
        else:
            raise RuntimeError(f"residual {aval} from {source} grows {nbytes(aval2) / nbytes(aval)}x with the batch")
        out.append((kind, aval, short_source(source)))
    return out


def report(config: llama.LlamaConfig, recipes: list[str], batch: int, seq: int) -> str:
    """Markdown: one table of grouped residuals per recipe, then a summary table of the totals."""
    tokens = batch * seq
    sections, totals = [], {}
    for name in recipes:
        rows = collections.defaultdict(lambda: [0, 0])  # (kind, source, shape, dtype) -> [count, bytes]
        recipe_name, _, option = name.partition(":")
        if option not in ("", "recompute_attention"):
            raise ValueError(f"unknown option {option!r} in {name!r}: the only one is ':recompute_attention'")
        variant = dataclasses.replace(config, recipe=recipe_variant(recipe_name), recompute_attention=bool(option))
        for kind, aval, source in classify(variant, batch, seq):
            row = rows[(kind, source, aval.shape, str(aval.dtype))]
            row[0] += 1
            row[1] += nbytes(aval)
        sum_kind = lambda k: sum(b for key, (_, b) in rows.items() if key[0] == k)
        totals[name] = (sum_kind("activation") / tokens, sum_kind("attention internal") / tokens,
                        sum_kind("per step"))
        lines = [f"### {name}", "", "| kind | where (saved_residuals) | shape | dtype | count | bytes/token |",
                 "|---|---|---|---|---:|---:|"]
        for (kind, source, shape, dtype), (count, b) in sorted(rows.items(), key=lambda kv: KINDS.index(kv[0][0])):
            per_token = {"per step": f"({b:,} B/step)", "param": "(live anyway)"}.get(kind, f"{b / tokens:,.1f}")
            lines.append(f"| {kind} | {source} | {shape} | {dtype} | {count} | {per_token} |")
        act, attn, step = totals[name]
        lines.append(f"\nActivations {act:,.1f} B/token; attention internals {attn:,.1f} B/token (excluded); "
                     f"per-step residuals {step / 2**20:,.1f} MiB (excluded).\n")
        sections.append("\n".join(lines))
    base = totals[recipes[0]][0]
    summary = [f"Block of `{config_label(config)}`, batch {batch} x seq {seq}, compute {config.compute_dtype}.", "",
               f"| recipe | activations B/token | vs {recipes[0]} | attention internals B/token | per step MiB |",
               "|---|---:|---:|---:|---:|"]
    for name, (act, attn, step) in totals.items():
        summary.append(f"| {name} | {act:,.1f} | {act / base:.2f}x | {attn:,.1f} | {step / 2**20:,.1f} |")
    return "\n".join(summary) + "\n\n" + "\n".join(sections)


def config_label(config: llama.LlamaConfig) -> str:
    return (f"dim={config.dim} heads={config.n_heads}/{config.n_kv_heads} ffn={config.ffn_dim} "
            f"attention={config.attention}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1b", choices=list(llama.LLAMA_SIZES), help="LLAMA_SIZES preset")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--recipes", default="bf16,int8_rowwise,fp8_tensorwise",
                        help="comma-separated recipe names (common.recipe_variant's, e.g. "
                             "int8_dataflow_recompute_w); ratios are to the first")
    parser.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--append", action="store_true", help="append the tables to the results JSON")
    args = parser.parse_args()
    # Attention on the XLA path on every machine: cuDNN's residuals would make the tables device-dependent.
    config = llama.llama_config(args.size, n_layers=1, max_seq_len=args.seq,
                                compute_dtype=args.compute_dtype, attention="xla")
    text = report(config, args.recipes.split(","), args.batch, args.seq)
    print(text)
    if args.append:
        record_results("Saved activations of a Llama block (saved_residuals)", text + "\n")


if __name__ == "__main__":
    main()
