"""Helpers shared by the JAX benchmark scripts: timing, SNR, and recording results as JSON.

Scripts in this folder run as `python benchmarks/NAME.py`, so `import common` finds this file.
"""

import datetime
import fcntl
import json
import os
import pathlib
import re
import shlex
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent


def time_ms(fn, args, warmup, reps, inner=1):
    """Median milliseconds of one call of `fn(*args)`.

    Each of `reps` timed samples dispatches `inner` calls back to back and waits once: dispatch is asynchronous,
    so for ops shorter than the host's dispatch time (a 1024^3 GEMM takes ~2 us on an H200) inner > 1 keeps the
    GPU queue full and measures the device rather than one launch plus a round trip per sample.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def interleaved_ms(fns: dict, warmup: int, rounds: int, inner: int) -> dict[str, list[float]]:
    """Milliseconds per call of each of `fns` (name -> zero-argument function returning arrays to wait on), one
    sample per round: every round times `inner` calls of each function in turn, the order reversed every other round,
    so a drift of the GPU's clocks or temperature during the run falls on all of them alike. The i-th samples of two
    functions are a pair: their ratio compares them within one round."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    samples = {name: [] for name in fns}
    for round_index in range(rounds):
        for name in (list(fns) if round_index % 2 == 0 else list(fns)[::-1]):
            start = time.perf_counter()
            outs = [fns[name]() for _ in range(inner)]
            jax.block_until_ready(outs)
            samples[name].append((time.perf_counter() - start) * 1e3 / inner)
    return samples


# The ~1.1B Llama the step benchmarks time (TinyLlama's shape), at batch 8 x 2048.
TINYLLAMA = dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, vocab_size=32000)


def llama_config(size: str):
    """configs/llama_base.py's config at the Llama preset `size`, "1b" in TinyLlama's shape (TINYLLAMA)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # the configs/ package
    from configs import llama_base  # noqa: PLC0415

    config = llama_base.get_config()
    config.model.size = size
    for field, value in (TINYLLAMA.items() if size == "1b" else ()):
        setattr(config.model, field, value)
    return config


def llama_step_config(recipe: str, small: bool):
    """`llama_config` under `recipe`: the 1.1B TinyLlama shape at batch 8 x 2048, or (small) the tiny preset at
    batch 4 x 128."""
    config = llama_config("tiny" if small else "1b")
    config.recipe = recipe
    config.batch_size, config.seq_len = (4, 128) if small else (8, 2048)
    config.steps = 1000
    return config


def step_runner(config, task, batch: dict, *, health: bool = False):
    """A zero-argument function running one train step of `config` on `batch` (`qjax.train.make_train_step`, the
    state initialised once and threaded through, since each step donates it); returns the step's loss."""
    from qjax.train import make_train_step  # noqa: PLC0415

    init_state, train_step = make_train_step(config, task, health=health)
    holder = [init_state()]

    def run_one():
        holder[0], metrics = train_step(holder[0], batch)
        return metrics["loss"]

    return run_one


def random_lm_batch(rng: np.random.Generator, vocab_size: int, batch_size: int, seq_len: int) -> dict:
    """A language-model batch of random tokens: {"inputs", "targets"}, int32 (batch_size, seq_len), the targets the
    inputs shifted by one."""
    tokens = rng.integers(0, vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def batched_seconds(fn, inputs, rounds: int, calls: int) -> float:
    """Median seconds per call of fn over `inputs` (arrays, or tuples of arguments): one jit of fn on every input
    (distinct inputs, so XLA cannot merge the calls), dispatched `calls` times back to back and timed to the last
    result, median of `rounds`. Dispatching one short call at a time would time the host instead."""
    batched = jax.jit(lambda inputs: [fn(*a) if isinstance(a, tuple) else fn(a) for a in inputs])
    jax.block_until_ready(batched(inputs))  # compile + warm up
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready([batched(inputs) for _ in range(calls)])
        samples.append((time.perf_counter() - start) / calls / len(inputs))
    return statistics.median(samples)


def snr_db(ref, out) -> float:
    """20 log10(|ref| / |ref - out|) in float64 on the host; inf when equal, nan if either holds NaN/Inf."""
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    if not (np.isfinite(ref).all() and np.isfinite(out).all()):
        return float("nan")
    err = np.linalg.norm(ref - out)
    return float("inf") if err == 0 else float(20 * np.log10(np.linalg.norm(ref) / err))


def git_commit() -> str:
    """Short commit of the checkout, '+dirty' when qjax/ or benchmarks/ differ from it; 'unknown' without git.

    $QJAX_COMMIT, when set, is returned instead: a copy of the working tree sent to another machine can carry a
    stale .git, so the runner there passes the commit the copy was made from."""
    if os.environ.get("QJAX_COMMIT"):
        return os.environ["QJAX_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "qjax", "benchmarks"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def device_kind() -> str:
    return jax.devices()[0].device_kind


def parse_tables(report: str) -> tuple[list[dict], str]:
    """The markdown tables of `report` as {"columns": [...], "rows": [[...], ...]}, and the rest of its text."""
    tables, notes, lines = [], [], report.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|[\s:|-]+\|?", lines[i + 1].strip()):
            cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
            table = {"columns": cells(lines[i]), "rows": []}
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                table["rows"].append(cells(lines[i]))
                i += 1
            tables.append(table)
        else:
            notes.append(lines[i])
            i += 1
    return tables, "\n".join(notes).strip()


def record_results(title: str, report: str) -> None:
    """Adds `report` (markdown: tables and notes) as a section of this suite's JSON results, with the device, UTC
    date, jax version, commit and command line.

    The file is $QJAX_RESULTS_DIR/$QJAX_SUITE.json (`python -m benchmarks run` sets both; run alone, a script
    writes runs/benchmarks/<script>.json). Nothing tracked by git is written: `python -m benchmarks publish`
    copies a run's results into benchmarks/results/ and regenerates benchmarks/README.md from them."""
    script = pathlib.Path(sys.argv[0]).name
    out_dir = pathlib.Path(os.environ.get("QJAX_RESULTS_DIR", REPO / "runs" / "benchmarks"))
    suite = os.environ.get("QJAX_SUITE", script.removesuffix(".py"))
    tables, notes = parse_tables(report)
    section = {
        "title": title, "device": device_kind(), "platform": jax.default_backend(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__, "commit": git_commit(),
        "command": "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{script}", *sys.argv[1:]]),
        "tables": tables, "notes": notes,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{suite}.json"
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a suite's scripts may finish at the same time on several GPUs
        f.seek(0)
        results = json.loads(f.read() or json.dumps({"suite": suite, "sections": []}))
        results["sections"].append(section)
        f.seek(0)
        f.truncate()
        json.dump(results, f, indent=1)
    print(f"recorded in {path}")


# Options a benchmark row or convergence entry may name after its recipe (":option"): what each sets in a train
# config. Model fields, not recipes: a run's recipe stays one of qjax.RECIPES (or a variant below).
MODEL_OPTIONS = {
    "recompute_attention": "config.model.recompute_attention=True",
    "smooth_swiglu": "config.model.smooth_swiglu=True",
    "lm_head_8bit": "config.keep_high_precision=() (the LM head under the run's recipe)",
}


def split_options(name: str) -> tuple[str, tuple[str, ...]]:
    """"recipe:option:option" -> (recipe, options); ValueError naming the valid options for an unknown one."""
    recipe, *options = name.split(":")
    unknown = [o for o in options if o not in MODEL_OPTIONS]
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} in {name!r}: use any of :{', :'.join(MODEL_OPTIONS)}")
    return recipe, tuple(options)


def apply_options(config, options: tuple[str, ...]) -> None:
    """Sets each of `options` (MODEL_OPTIONS) in a train config (ml_collections, configs/*_base.py); the fields of
    options not named stay as the config has them. ValueError for an option the config's model lacks."""
    for option in options:
        if option == "lm_head_8bit":
            config.keep_high_precision = ()
        elif option in config.model:
            config.model[option] = True
        else:
            raise ValueError(f"option :{option} sets config.model.{option}, which this model's config does not have")


def recipe_variant(name: str):
    """A recipe of `qjax.RECIPES` by name, or one of the benchmarks' variants of them (ablations, not public):
    int8_fwd / int8_fwd_dgrad (int8_rowwise with wgrad, or dgrad and wgrad, in bf16), any of these or a recipe +
    "_sr" (stochastic rounding of the gradient operand, `qjax.with_stochastic_gradients`: int8_rowwise_sr,
    int8_dataflow_sr as Jetfire rounds; an '_sr' that changes nothing raises ValueError), and any data-flow recipe
    or its "_sr" + "_recompute" (`Recipe.recompute_prologue_output`) or + "_recompute_w" (also
    `Recipe.recompute_weight_codes`)."""
    import dataclasses

    import qjax

    for suffix, weights in (("_recompute_w", True), ("_recompute", False)):
        if name.endswith(suffix):
            return dataclasses.replace(recipe_variant(name.removesuffix(suffix)), name=name,
                                       recompute_prologue_output=True, recompute_weight_codes=weights)
    if name.endswith("_sr"):
        base = recipe_variant(name.removesuffix("_sr"))
        sr = qjax.with_stochastic_gradients(base)
        if (sr.dgrad, sr.wgrad) == (base.dgrad, base.wgrad):
            raise ValueError(f"recipe {name!r}: {base.name}'s gradient GEMMs are bf16 or already stochastic, so '_sr' "
                             "would change nothing; drop it")
        return sr
    int8 = qjax.recipe("int8_rowwise")
    variants = {
        "int8_fwd": dataclasses.replace(int8, name="int8_fwd", dgrad=None, wgrad=None),
        "int8_fwd_dgrad": dataclasses.replace(int8, name="int8_fwd_dgrad", wgrad=None),
    }
    return variants.get(name) or qjax.recipe(name)
