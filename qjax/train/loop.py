"""`train(config, workdir)`: the whole run: data, model, optimizer, resume, steps, eval, checkpoints, metrics.

  result = train(config, "runs/llama_int8")    # resumes from runs/llama_int8/checkpoints if a checkpoint is there

Workdir layout (created only once the config, data and model checks pass): config.json (the config of the latest
start), metrics.jsonl (appended) beside TensorBoard event files, checkpoints/<step>/ (the newest few), best/<step>/
with best.json (the state of the lowest eval loss so far; `qjax.train.checkpoint.BestCheckpoint`).
A run restarted in the same workdir continues from its newest checkpoint that restores (an unreadable one is moved
aside, see qjax.train.checkpoint) and, because batches, RNG keys and the LR schedule are pure functions of the step,
computes what the uninterrupted run would have (bit for bit on a CPU; a GPU's steps are not bit-reproducible, see
docs/training.md); the metrics rows written after that checkpoint are dropped, and the config fields changed since
the last start are listed in one line.
`stop_at` ends this invocation early at a given step (saving a checkpoint there) without changing the run itself:
the schedule still ends at `config.steps`. So does SIGINT / SIGTERM at the step in flight (`Interrupted`; a second
signal exits at once, see qjax.train.stopping), and `stop_event` set from another thread (a time limit). A checkpoint is
written only when its step's loss, grad norm, eval loss and params are finite: a diverged run stops with
FloatingPointError and keeps its last good checkpoint.
"""

import contextvars
import os
import sys
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qjax import health as health_lib
from qjax.models import layer_recipes, num_params
from qjax.train import mesh as mesh_lib
from qjax.train.checkpoint import BestCheckpoint, Checkpointer, abstract_like, set_aside_previous_run
from qjax.train.config import (ConfigError, check_batch_size, check_config, check_resume, config_changes,
                               read_saved_config, write_config)
from qjax.train.metrics import (DIVERGED_FIX, ProgressMeter, check_finite, quantizes_nothing, read_metrics,
                                recipe_summary, rounds_params_to_nearest, truncate_metrics)
from qjax.train.step import TrainState, check_fits, make_eval_step, make_train_step, train_state_shardings
from qjax.train.stopping import Interrupted, StopRequest
from qjax.train.task import make_dataset, make_task_for_data

# Eval keys come from the seed and this constant, not from the step key: every eval sees the same "quant" keys.
_EVAL_KEY_SALT = 0x5EED


class TrainResult(NamedTuple):
    """state: the final TrainState. train_metrics / eval_metrics: the last records written (None if none)."""

    state: TrainState
    train_metrics: dict | None
    eval_metrics: dict | None


def _make_workdir(workdir: str) -> None:
    """Creates `workdir`; ConfigError naming it and the fix when it cannot be written."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write-test-{os.getpid()}")
        with open(probe, "w"):  # os.access says yes to root on a read-only mount; writing tells
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"cannot write to the workdir {workdir} ({e.strerror or e}): pass --workdir=<a directory "
                          "you can write>") from None


def _origin(config, resumed: bool, start: int) -> str:
    """Where the run's state comes from, for the start-up header."""
    if resumed:
        return f"resumed at step {start}"
    return f"initialized from {config.init_from}" if config.get("init_from") else "from scratch"


@jax.jit
def _all_finite(params) -> jax.Array:
    """True if every float entry of `params` is finite: an update can overflow params while the loss it was
    computed from was finite, and such a state must not become the newest checkpoint."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def _mean_metrics(pending: list[dict]) -> dict:
    """Averages per-step metrics over a log interval ("lr": the last step's)."""
    values = jax.device_get(pending)
    out = {key: float(np.mean([v[key] for v in values])) for key in values[0] if key != "lr"}
    out["lr"] = float(values[-1]["lr"])
    return out


def evaluate(eval_step, params, batches: list[dict], key_data: jax.Array) -> dict:
    """Mean of eval_step's metrics over `batches` (all the same size, so a plain mean is the per-example mean)."""
    results = jax.device_get([eval_step(params, batch, key_data) for batch in batches])
    return {key: float(np.mean([r[key] for r in results])) for key in results[0]}


def _compiled(jitted, *args, meter: ProgressMeter):
    """`jitted` compiled for `args` (jax.stages.Compiled) when first needed, its compile time left out of the meter's
    throughput as the first step's is: the health and eval steps first run mid-way, and so does the plain step when
    a resumed process starts on a health step."""
    jax.block_until_ready(args)  # the steps still queued run now, not during the compile whose time is dropped
    began = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    meter.skip(time.perf_counter() - began)
    return compiled


class _CompileAhead:
    """`jitted` lowered for `abstract_args` (ShapeDtypeStructs) and compiled in a background thread while the run's
    first step compiles the train step, so the health and eval steps' compiles overlap it instead of each pausing the
    run when first needed (the health step's compile takes as long as the train step's). Without GPU autotuning
    (AHEAD_OPTIONS: XLA's default GEMM algorithms for steps that run once every N): autotuning at the same time as
    the train step's compile would disturb the timings that pick the train step's algorithms. The thread runs in the
    caller's context variables (qjax's settings, e.g. qjax.dispatch.force); JAX's own context managers
    (jax.default_matmul_precision, ...) are thread-local and do not carry over. `get` waits for the result, that
    wait left out of the meter's throughput, and raises what the compile raised."""

    def __init__(self, jitted, abstract_args, compiler_options: dict | None = None):
        self._compiled, self._error = None, None
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._compile, jitted, abstract_args,
                                                                  compiler_options),
                                        daemon=True, name="qjax-compile-ahead")  # train's `finally` waits for it
        self._thread.start()

    def _compile(self, jitted, abstract_args, compiler_options):
        try:
            self._compiled = jitted.lower(*abstract_args).compile(compiler_options)
        except Exception as e:  # noqa: BLE001 (re-raised in the caller's thread by get)
            self._error = e

    def wait(self) -> None:
        self._thread.join()

    def get(self, meter: ProgressMeter) -> jax.stages.Compiled:
        began = time.perf_counter()
        self.wait()
        meter.skip(time.perf_counter() - began)
        if self._error is not None:
            raise self._error
        return self._compiled


def _compiles_ahead(mesh) -> bool:
    """Whether the health and eval steps compile beside the first step (`_CompileAhead`): on GPUs. A CPU run's
    compiles and steps share the same cores."""
    return mesh.devices.flat[0].platform == "gpu"


AHEAD_OPTIONS = {"xla_gpu_autotune_level": 0}  # `_CompileAhead`'s XLA options on a GPU


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                       weak_type=x.weak_type), tree)


def _ready(step, *args, meter: ProgressMeter):
    """`step` (a jitted step, its `_CompileAhead` or its Compiled) compiled: waited for, compiled now for `args`
    (`_compiled`), or as it is."""
    if isinstance(step, _CompileAhead):
        jax.block_until_ready(args)  # as `_compiled`: the queued steps run now, not in the wait left out of the meter
        return step.get(meter)
    return step if isinstance(step, jax.stages.Compiled) else _compiled(step, *args, meter=meter)


def train(config, workdir, *, stop_at: int | None = None, stream=None,
          stop_event: threading.Event | None = None) -> TrainResult:
    """Trains per `config` in `workdir` (module docstring) and returns the final state and last metrics.

    Args:
      config: a training ConfigDict (configs/*.py); checked first (ConfigError for a bad field).
      workdir: directory for checkpoints and metrics; created if missing, once the checks pass.
      stop_at: stop after this global step (None: run to config.steps), e.g. to split a run into pieces.
      stream: where progress lines go (default stdout).
      stop_event: a `threading.Event` another thread may set (a time limit, an orchestrator): the run then stops as
        on SIGTERM, after the step in flight, saved (`Interrupted` with signum None).

    Raises:
      ConfigError: a bad config field or missing data (the message says how to fix it).
      FloatingPointError: the loss, gradient norm, eval loss or params became NaN/Inf (nothing is saved from that
        point on; the message names the newest checkpoint, which is kept).
      Interrupted: SIGINT / SIGTERM (main thread only) or `stop_event` stopped the run after the step in flight,
        saved as a checkpoint; re-running resumes there.
      A signal that came during the last step does not stop the run: once it is saved, `train` raises the signal
      again for the handler there was before (`StopRequest.pass_on`; Ctrl-C: KeyboardInterrupt).
    """
    # The checks, each once, before anything is built or written (qjax.train.config's docstring); the builders
    # below take the checked config (check=False).
    check_config(config)
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 1):
        raise ConfigError(f"stop_at must be a positive int step or None, got {stop_at!r}: pass --stop_at=N with N >= 1")
    if stop_event is not None and not callable(getattr(stop_event, "is_set", None)):
        raise TypeError(f"stop_event must be a threading.Event (or None), got {stop_event!r}")
    stream = sys.stdout if stream is None else stream
    workdir = os.path.abspath(os.fspath(workdir))
    try:
        mesh_lib.initialize_distributed()  # several hosts: only where a cluster's environment variables are set
        mesh = mesh_lib.mesh_from_config(config.mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_batch_size(config, mesh)
    if not mesh_lib.is_main_process():  # several processes: process 0 prints for all (they compute the same)
        stream = open(os.devnull, "w")

    dataset = make_dataset(config)
    task = make_task_for_data(config, dataset)
    init_state, train_step = make_train_step(config, task, mesh, check=False)
    health_every = config.get("health_every") or 0  # 0: the plain step only, nothing of qjax.health traced
    health_step = make_train_step(config, task, mesh, health=True, check=False)[1] if health_every else None
    abstract_state = jax.eval_shape(init_state)
    # Before anything compiles: a run that cannot fit fails now, with the fix, not after minutes in XLA.
    memory_estimate = check_fits(config, task, abstract_state, mesh)
    eval_step = make_eval_step(task, mesh)
    eval_batches = []
    if config.eval_every and config.eval_batches:
        try:
            eval_batches = [mesh_lib.put_batch(b, mesh) for b in dataset.eval_batches(config.eval_batches)]
        except ValueError as e:
            raise ConfigError(f"config.eval_batches: {e}") from None
    eval_key = jax.random.key_data(jax.random.fold_in(jax.random.key(config.seed), _EVAL_KEY_SALT))
    abstract = abstract_like(abstract_state, train_state_shardings(abstract_state, mesh))

    # Only now: a run that fails a check above leaves no (empty) workdir behind.
    _make_workdir(workdir)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), config.keep_checkpoints)
    best = meter = None
    say = lambda line: print(line, file=stream, flush=True)  # noqa: E731
    stop = StopRequest().install()  # SIGINT / SIGTERM: finish the step in flight, save it, raise Interrupted
    stop_requested = lambda: stop.signal is not None or (stop_event is not None and stop_event.is_set())  # noqa: E731
    try:
        state = checkpointer.restore_latest(abstract, report=say)
        resumed = state is not None
        state = init_state() if state is None else state
        start = int(state.step)
        end = config.steps if stop_at is None else min(stop_at, config.steps)
        if resumed:
            check_resume(config, start, checkpointer.directory)
            changes = config_changes(read_saved_config(workdir), config)
            if changes:
                say(f"config changed since the last start: {', '.join(changes)}")
            dropped = truncate_metrics(workdir, start)
            if dropped:
                say(f"metrics.jsonl: dropped {dropped} rows after step {start}, where this start resumes (they are "
                    "recomputed)")
        else:
            previous = set_aside_previous_run(workdir)
            if previous:
                say(f"no checkpoint to resume from: the metrics and best checkpoint of an earlier start in this "
                    f"workdir were moved to {previous}")
        write_config(workdir, config)
        mesh_lib.sync_processes("workdir")  # the others read metrics.jsonl (best loss) once process 0 has set it up
        best = BestCheckpoint(workdir)

        units_per_step = config.batch_size * task.units_per_example
        meter = ProgressMeter(workdir, config.steps, task.unit, units_per_step, task.flops_per_unit,
                              mesh.devices.flat, stream, start_step=start)
        devices = mesh.devices.size
        recipe = getattr(config.recipe, "name", config.recipe)  # a name, or a Recipe (benchmarks' variants)
        print(f"{config.task}: {type(task.model).__name__} {config.model.size} ({num_params(state.params) / 1e6:.2f}M "
              f"params), recipe {recipe}, optimizer {config.optimizer.name}, batch {config.batch_size}"
              + (f" x seq {config.seq_len}" if config.task == "lm" else "")
              + f", {devices} {jax.devices()[0].platform} device{'s' * (devices > 1)}"
              + (" (data x fsdp x tensor = {data} x {fsdp} x {tensor})".format(**mesh.shape) if devices > 1 else "")
              + "; "
              + f"{_origin(config, resumed, start)}, running to step {end}/{config.steps}",
              file=stream, flush=True)
        print(f"  recipes: {recipe_summary(task.model_config)}", file=stream)
        print(f"  memory: {memory_estimate.summary()}", file=stream)
        print(f"  workdir: {workdir}", file=stream, flush=True)
        for warning in (quantizes_nothing(task.model_config), rounds_params_to_nearest(config)):
            if warning:
                print(warning, file=stream, flush=True)
        if task.init_note and not resumed:  # a resumed run's params come from its checkpoint, not init_from
            print(f"  {task.init_note}", file=stream, flush=True)

        monitor = saturation = None
        if health_every:  # a resumed run's amax growth stays relative to the run's first measurement
            monitor = health_lib.HealthMonitor(config.health_saturation_warn, config.health_amax_growth_warn,
                                               health_lib.initial_amax(read_metrics(workdir)),
                                               health_lib.ternary_operands(layer_recipes(task.model_config)))
        train_record = eval_record = None
        pending: list[Any] = []
        if stop_requested() and start < end:  # a signal while starting up: no step to finish
            raise Interrupted(start, stop.signal, saved=False)
        for step in range(start, end):
            batch = mesh_lib.put_batch(dataset.batch(step), mesh)  # this process's rows of the global batch
            done = step + 1
            if step == start and _compiles_ahead(mesh):  # the first step compiles now: the others beside it
                first_health = (start // health_every + 1) * health_every if health_every else end + 1
                if done < first_health <= end:
                    health_step = _CompileAhead(health_step, _abstract((state, batch)), AHEAD_OPTIONS)
                if eval_batches and (end == config.steps or (start // config.eval_every + 1) * config.eval_every
                                     <= end):
                    eval_step = _CompileAhead(eval_step, _abstract((state.params, eval_batches[0], eval_key)),
                                              AHEAD_OPTIONS)
            if health_every and done % health_every == 0:
                health_step = _ready(health_step, state, batch, meter=meter)
                state, metrics = health_step(state, batch)
                stats = jax.device_get(metrics.pop("health"))
                row, warning = monitor.update(done, health_lib.flatten(stats["sown"], stats["probes"]))
                meter.health(done, row)
                saturation = row["health_saturation_max"]
                if warning:
                    say(warning)
            else:
                train_step = _ready(train_step, state, batch, meter=meter)  # a first step may be a health step
                state, metrics = train_step(state, batch)
            pending.append(metrics)
            if done == start + 1:  # time from here on: the first step includes compilation
                jax.block_until_ready(metrics)
                meter.mark(done)
            if done % config.log_every == 0 or done == end:
                means = _mean_metrics(pending)
                if saturation is not None:  # the latest health measurement's worst operand, for the progress line
                    means["health_saturation_max"] = saturation
                train_record = meter.train(done, means)
                pending = []
                check_finite(done, "loss", train_record["loss"])
                check_finite(done, "grad_norm", train_record["grad_norm"])
            if eval_batches and (done % config.eval_every == 0 or done == config.steps):
                eval_step = _ready(eval_step, state.params, eval_batches[0], eval_key, meter=meter)
                eval_record = meter.eval(done, evaluate(eval_step, state.params, eval_batches, eval_key))
                check_finite(done, "eval_loss", eval_record["eval_loss"])  # finite but huge params: not saved
                best.update(done, eval_record["eval_loss"], state)
            stopping = stop_requested() and done < end  # at the end, the run is done: nothing to resume
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == end or stopping:
                last = jax.device_get(metrics)
                check_finite(done, "loss", float(last["loss"]))
                check_finite(done, "grad_norm", float(last["grad_norm"]))
                if not _all_finite(state.params):
                    raise FloatingPointError(f"params are not finite after step {done}: training diverged. "
                                             + DIVERGED_FIX)
                checkpointer.save(done, state)  # the same atomic save for a periodic and an interrupt checkpoint
            if stopping:
                raise Interrupted(done, stop.signal, saved=True)
    except FloatingPointError as e:  # name the checkpoint that is kept (nothing is saved from the bad step on)
        newest = checkpointer.latest_step()
        kept = (f" The newest checkpoint, step {newest}, is kept in {checkpointer.directory}" if newest is not None
                else " No checkpoint was saved before it")
        raise FloatingPointError(f"{e}{kept}.") from None
    finally:
        try:
            checkpointer.close()  # waits for the last save; a second signal meanwhile still exits at once
            for step_fn in (health_step, eval_step):  # a run stopped early: let a compile in flight end before the
                if isinstance(step_fn, _CompileAhead):  # process exits (JAX tears its backends down at exit)
                    step_fn.wait()
            for closing in (best, meter):
                if closing is not None:
                    closing.close()
        finally:
            stop.uninstall()
    summary = best.summary()
    if summary and end == config.steps:  # the run is over: name the model to use
        say(summary)
    stop.pass_on()  # a signal during the last step: the run is done and saved, the caller stops now
    return TrainResult(state, train_record, eval_record)
