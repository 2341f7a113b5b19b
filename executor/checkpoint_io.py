"""Training checkpoints: ``DIR/step-N/``, written with torch.distributed.checkpoint (DCP), complete or absent.

(Not to be confused with checkpointing.py, which is activation checkpointing.)

A checkpoint folder holds DCP's files (``.metadata`` and one ``__R_0.distcp`` per rank) and
``trainer.json``: the step, the data position (samples read), the losses and step times of every
step so far, the plan, the model's parameter names and shapes, the data file, the restart count and
the id of the launch that wrote it (a restarted job resumes from its own latest checkpoint only).
Every rank writes into ``DIR/.step-N.partial/``; once DCP has finished (its metadata is written
after every rank's data), rank 0 writes ``trainer.json`` and renames the folder to ``step-N``: a
folder named ``step-N`` is always complete, a crash leaves at most a ``.partial`` folder that the
next save of that step removes.

What is saved, keyed by whole-model parameter names (FQNs, chunks.py), so a checkpoint reshards:

- ``model.<fqn>``: each chunk's state dict (``get_model_state_dict``: DDP's prefix removed, FSDP2
  and tensor-parallel parameters as DTensors, which DCP saves as shards of the full tensor);
- ``optim.<fqn>.{step,exp_avg,exp_avg_sq}``: the AdamW state of each parameter, shaped and sharded
  like the parameter. The executor's optimizer spans all the chunks of a rank and, under ZeRO-1
  (optim.py), the data-parallel ranks hold pieces of a parameter's state, so the state is gathered
  whole per parameter here (on one rank, one parameter at a time) rather than with
  ``get_optimizer_state_dict`` (one module, one optimizer); a load hands each rank its pieces;
- ``rng.<device>.rank<R>``: each rank's torch RNG state (nothing in a step draws from it today:
  data and initial weights are keyed by seed, step and name; it is kept for models that will).

Loading under another plan (dp2 -> tp2, pp2, ZeRO 0-3) works because every tensor is addressed by
its whole-model name and global shape: DCP reads each rank's shards of what it holds. Tied weights:
a chunk holding both the embedding and the LM head has one parameter under two names and saves
both; a pipeline that splits them holds two copies (tied.py) and loads each from its own name.
Checkpoints are trusted input: DCP's metadata file is a pickle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from paraplan.models import build_model

from .errors import ExecutionError
from .job import Job
from .optim import ShardedOptimizer

STATE_FILE = "trainer.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    """``trainer.json``: everything but the tensors."""

    step: int  # steps trained (the next step to train is step + 1, 1-based)
    samples: int  # data position: samples read by those steps
    losses: list[float]  # one per step, steps 1..step
    step_time_s: list[float]
    plan: dict
    model: str
    parameters: dict[str, list[int]]  # whole-model FQN -> shape: what --resume checks first
    data: dict | None = None  # token_data.TokenFile.describe(), None for the bundled corpus
    world_size: int = 1
    restarts: int = 0
    run_id: str | None = None  # the launch that wrote it (execute draws one per launch)
    format: int = FORMAT
    extra: dict = field(default_factory=dict)


def model_parameters(job: Job) -> dict[str, list[int]]:
    """The whole model's parameter names and shapes (built on the meta device: no memory)."""
    model = build_model(job.spec, "meta")
    return {name: list(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def complete_steps(root: str) -> list[int]:
    """Steps with a complete checkpoint under ``root``, ascending."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    steps = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest(root: str, run_id: str | None = None) -> str | None:
    """The latest complete checkpoint under ``root`` (of run ``run_id`` only, when given: a restarted
    job must not pick up a checkpoint another run left in the same folder, nor one past its own)."""
    for step in reversed(complete_steps(root)):
        folder = step_dir(root, step)
        if run_id is None or _run_id_of(folder) == run_id:
            return folder
    return None


def _run_id_of(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, STATE_FILE)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def resolve(path: str) -> str:
    """``--resume DIR/step-N`` or ``--resume DIR`` (its latest complete checkpoint) -> the step folder."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    if not os.path.isdir(path):
        raise ExecutionError(f"--resume {path}: no such folder")
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        raise ExecutionError(f"--resume {path}: an incomplete checkpoint (no {STATE_FILE})")
    found = latest(path)
    if found is None:
        raise ExecutionError(f"--resume {path}: no complete checkpoint (step-N/ folder) in it")
    return found


def read_state(folder: str) -> TrainerState:
    path = os.path.join(folder, STATE_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
        state = TrainerState(**data)
    except OSError as e:
        raise ExecutionError(f"checkpoint {folder}: {e.strerror}") from None
    except (ValueError, TypeError) as e:
        raise ExecutionError(f"checkpoint {folder}: {STATE_FILE} is not a paraplan checkpoint state ({e})") from None
    if state.format != FORMAT:
        raise ExecutionError(f"checkpoint {folder}: format {state.format}, this paraplan reads format {FORMAT}")
    return state


def check_model(state: TrainerState, job: Job, folder: str) -> None:
    """Refuse a checkpoint of another model (before anything else of it is loaded)."""
    want = model_parameters(job)
    have = {k: list(v) for k, v in state.parameters.items()}
    if have == want:
        return
    what = f"checkpoint {folder} holds model {state.model}, the plan trains {job.spec.name}"
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        raise ExecutionError(f"{what}: the checkpoint lacks parameter {missing[0]}")
    if extra:
        raise ExecutionError(f"{what}: the plan's model has no parameter {extra[0]}")
    name = next(k for k in want if want[k] != have[k])
    raise ExecutionError(f"{what}: {name} is {tuple(have[name])} there, {tuple(want[name])} here")


# ---- the tensors: built per rank, saved and loaded collectively -------------------------------------------------

# what torch's activation-checkpoint wrapper adds to the names of the parameters it wraps (checkpoint_wrapper's
# _CHECKPOINT_PREFIX); the model's state dict leaves it out, and so do the optimizer's checkpoint names
WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def plain_name(name: str) -> str:
    """A parameter's name as the model's state dict has it, whatever recomputation wraps its module: a checkpoint
    resumes under a plan of another recomputation mode (a QA pass found full -> none and none -> mlp refused with
    "lacks optim.layers.0._checkpoint_wrapped_module....step")."""
    return name.replace(WRAPPER_PREFIX, "")


def _chunk_fqns(rm) -> list[tuple[list[str], torch.nn.Parameter]]:
    """(every whole-model name, parameter) of this rank's parameters, in a fixed order (names plain_name's)."""
    seen: dict[int, tuple[list[str], torch.nn.Parameter]] = {}
    for chunk in rm.chunks:
        for name, p in chunk.module.named_parameters(remove_duplicate=False):
            seen.setdefault(id(p), ([], p))[0].append(plain_name(name))
    return list(seen.values())


def _optimizer_states(rm, create: bool) -> tuple[dict[int, dict], list[torch.nn.Parameter]]:
    """(id(parameter) -> its AdamW state, the parameters whose state this rank saves or loads). Plain AdamW:
    the optimizer's own state dicts, so a load fills them in place. ZeRO-1, whose ranks hold pieces of the
    states: whole states gathered for a save (collective), none before a load (:func:`load` hands the
    loaded whole states back to the optimizer)."""
    opt = rm.optimizer
    if isinstance(opt, ShardedOptimizer):
        return ({} if create else opt.whole_states()), opt.saved_params()
    if not isinstance(opt, torch.optim.Optimizer):
        raise ExecutionError("checkpoints are written for AdamW (and ZeRO-1's sharded AdamW) only")
    kept = [p for group in opt.param_groups for p in group["params"]]
    return {id(p): opt.state[p] for p in kept}, kept  # opt.state: a defaultdict, the dicts AdamW reads


def _optimizer_entries(rm, states: dict[int, dict], kept: list[torch.nn.Parameter],
                       create: bool) -> dict[str, torch.Tensor]:
    """``optim.<fqn>.<key>`` -> the state tensors of the ``kept`` parameters. ``create`` makes zero states
    first (before a load: AdamW creates its state lazily at the first step)."""
    kept_ids = {id(p) for p in kept}
    out = {}
    for names, p in _chunk_fqns(rm):
        if id(p) not in kept_ids:
            continue
        state = states.setdefault(id(p), {})
        if create and not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # as AdamW creates it (not capturable)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        for key, value in state.items():
            for name in (names if not create else names[:1]):  # save every name; load from the first
                out[f"optim.{name}.{key}"] = value
    return out


def _model_entries(rm) -> list[dict[str, torch.Tensor]]:
    """Per trained chunk: ``model.<fqn>`` -> its state dict's tensor."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [{f"model.{k}": v for k, v in get_model_state_dict(module).items()} for module in rm.trained]


def _rng_entries(rm) -> dict[str, torch.Tensor]:
    out = {f"rng.cpu.rank{rm.rank}": torch.get_rng_state()}
    if rm.device.type == "cuda":
        out[f"rng.cuda.rank{rm.rank}"] = torch.cuda.get_rng_state(rm.device)
    return out


def save(rm, root: str, state: TrainerState) -> str:
    """Collective: write ``root/step-<state.step>/`` (every rank calls it after the same step)."""
    import torch.distributed.checkpoint as dcp

    final = step_dir(root, state.step)
    partial = os.path.join(root, f".step-{state.step}.partial")
    if rm.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save of this step
        os.makedirs(partial)
    dist.barrier()
    entries = {k: v for chunk in _model_entries(rm) for k, v in chunk.items()}
    entries.update({**_optimizer_entries(rm, *_optimizer_states(rm, create=False), create=False),
                    **_rng_entries(rm)})
    dcp.save(entries, storage_writer=dcp.FileSystemWriter(partial, sync_files=True))  # returns once all wrote
    if rm.rank == 0:
        with open(os.path.join(partial, STATE_FILE), "w") as f:
            json.dump(asdict(state), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        old = None
        if os.path.exists(final):  # the same step saved again (a run resumed from an earlier step)
            old = os.path.join(root, f".step-{state.step}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(partial, final)
        _fsync_dir(root)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load(rm, folder: str) -> TrainerState:
    """Collective: check that ``folder`` holds this plan's model, then load model, optimizer and RNG."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = read_state(folder)
    check_model(state, rm.job, folder)
    reader = dcp.FileSystemReader(folder)
    saved = set(reader.read_metadata().state_dict_metadata)
    chunks = _model_entries(rm)
    entries = {k: v for chunk in chunks for k, v in chunk.items()}
    states, kept = _optimizer_states(rm, create=True)
    optimizer = _optimizer_entries(rm, states, kept, create=True)
    # checkpoints written before the names were plain carry the wrapper's prefix where the module recomputed
    wrapped = {plain_name(k): k for k in saved if WRAPPER_PREFIX in k}
    entries.update({k if k in saved else wrapped.get(k, k): v for k, v in optimizer.items()})
    lacking = [k for k in entries if k not in saved]
    if lacking:
        raise ExecutionError(f"checkpoint {folder} lacks {lacking[0]}")
    rng = {k: v for k, v in _rng_entries(rm).items() if k in saved}  # restored where the rank existed
    entries.update(rng)
    dcp.load(entries, storage_reader=reader)  # in place: parameters, optimizer states, rng tensors
    if isinstance(rm.optimizer, ShardedOptimizer):
        rm.optimizer.load_whole_states(states)  # each rank keeps its pieces
    for module, chunk in zip(rm.trained, chunks, strict=True):
        set_model_state_dict(module, {k.removeprefix("model."): entries[k] for k in chunk})
    if f"rng.cpu.rank{rm.rank}" in rng:
        torch.set_rng_state(entries[f"rng.cpu.rank{rm.rank}"])
    if f"rng.cuda.rank{rm.rank}" in rng:
        torch.cuda.set_rng_state(entries[f"rng.cuda.rank{rm.rank}"], rm.device)
    return state
