"""FSDPCheckpointer: the one manager that saves and resumes a training job, seed API and layout.

A save is: take this rank's share (the full layout gathers full state on rank 0, collective; the sharded
layout takes each rank's own shards, `sharded`) -> stage a private copy when asynchronous -> write every
file atomically (`atomic`, DCP for shards) -> record sizes and hashes (`manifest`) -> rank 0 commits the
marker, manifest and pointer once every rank's files are durable -> prune.
A resume is: validate the pointer -> pick the newest valid generation (`generations`) -> restore
weights, optimizer, scheduler, grad scaler and per-rank RNG (`state`; a sharded generation resharded to
this world size), loading only weights-only pickles (`safe_load`) and checked DCP metadata.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.tensor import DTensor

from checkpointing import collectives, layout
from checkpointing.atomic import (
    FileRecord,
    atomic_torch_save,
    atomic_torch_save_all,
    atomic_write_text,
    fsync_dir,
    remove_stale_tmp_files,
    tensor_bytes,
)
from checkpointing.callbacks import CallBackGroup
from checkpointing.config import CheckpointConfig, JobConfig
from checkpointing.errors import AsyncSaveError, CheckpointError, CheckpointWriteError
from checkpointing.generations import (
    delete_generation,
    generation_problems,
    list_generations,
    prune_plan,
    resolve_latest,
    state_layout_of,
)
from checkpointing.manifest import FORMAT_VERSION, Manifest
from checkpointing.safe_load import safe_torch_load
from checkpointing.state import (
    GRAD_SCALER,
    ITERATION,
    OPTIMIZER,
    RNG,
    SCHEDULER,
    WORLD_SIZE,
    ema_of,
    gather_model_states,
    gather_optimizer_state,
    is_seed_protocol,
    module_of,
    restore_optimizer,
    rng_state,
    save_role,
    set_rng_state,
)
from checkpointing.weights import load_weights_into, read_weights

logger = logging.getLogger(__name__)


@dataclass
class _Source:
    """Where this job's state comes from, decided once per checkpointer and shared by all ranks."""

    marker_path: Path  # a generation's marker, or load_path as configured
    resume: bool  # restore the training state too, not just the weights
    state_layout: str = layout.FULL  # the layout its manifest records (seed-era and release files: full)


@dataclass
class _SaveJob:
    """Everything the writer needs for one generation on this rank."""

    iteration: int
    marker: str
    pinned: bool
    primary: bool  # rank 0: commits the generation (marker, manifest, pointer)
    state_layout: str
    files: list[tuple[str, Any]]  # (file name, object) this rank torch.saves whole, the marker excluded
    parts: list[tuple[str, dict]] = field(default_factory=list)  # sharded: (kind, this rank's shards) for DCP
    marker_state: dict[str, Any] | None = None  # rank 0 only: written after every rank's files are durable


class _StagingBuffers:
    """Reusable CPU copies of the state, so an async save owns its bytes while training goes on.

    Buffers are kept between saves: allocating (page-faulting) fresh memory costs far more than
    copying into memory that is already mapped.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, obj: Any, path: tuple = ()) -> Any:
        if isinstance(obj, DTensor):  # FSDP2: this rank's shard, same mesh and placements
            local = self.stage(obj.to_local(), path)
            return DTensor.from_local(
                local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
            )
        if isinstance(obj, ShardedTensor):  # FSDP1's sharded state: this rank's shards, same global metadata
            shards = [Shard(self.stage(s.tensor, (*path, i)), s.metadata) for i, s in enumerate(obj.local_shards())]
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, obj.metadata(), process_group=obj._process_group
            )
        if isinstance(obj, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
                self._buffers[path] = buffer
            buffer.copy_(obj.detach())
            return buffer
        if isinstance(obj, dict):
            return {k: self.stage(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.stage(v, (*path, i)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)


class FSDPCheckpointer:
    """Crash-safe checkpoints of a (possibly FSDP2/FSDP1/DDP-wrapped) model, seed-compatible.

    Every rank constructs it and calls save()/load()/finalize() together: they are collective.
    """

    def __init__(
        self,
        config_checkpoint: CheckpointConfig,
        config_job: JobConfig,
        callbacks: CallBackGroup | None = None,
    ) -> None:
        self.config = config_checkpoint
        self.callbacks = callbacks if callbacks is not None else CallBackGroup()
        self.checkpoint_dir_local = Path(config_job.path_local) / layout.CHECKPOINTS_DIRNAME
        self.strict_resume = config_checkpoint.strict_resume
        self.load_path = config_checkpoint.load_path
        self.load_training_state = config_checkpoint.load_training_state
        self.save_thread: threading.Thread | None = None
        self._failure: BaseException | None = None  # the last save's failure (this rank's own exception)
        self._failure_message = ""  # the same failure as every rank describes it
        self._group = collectives.new_checkpoint_group(
            config_checkpoint.replica_timeout_s
        )  # None: no dist yet
        self._staging = _StagingBuffers()
        self._source_decided = False
        self._source: _Source | None = None
        self._restored: set[str] = set()  # "reg", "ema", "optim": already loaded from _source
        if collectives.rank() == 0:
            remove_stale_tmp_files(self.checkpoint_dir_local)

    # ------------------------------------------------------------------ resume

    def _decide_source(self) -> _Source | None:
        """Resume priority (seed): latest_checkpoint.txt, then load_path, then from scratch.

        Rank 0 validates and every rank gets its answer (or its error), so all ranks load the same
        generation and verification hashes the files once.
        """
        if self._source_decided:
            return self._source
        self._join()
        self._ensure_group()
        outcome: _Source | BaseException | None = None
        if collectives.rank() == 0:
            try:
                resolution = resolve_latest(self.checkpoint_dir_local, self.config.verify)
                if resolution is not None:
                    manifest = resolution.generation.manifest
                    outcome = _Source(resolution.marker_path, True, manifest.state_layout if manifest else layout.FULL)
                    logger.info("resuming from %s", resolution.marker_path)
                elif self.load_path:
                    path = self._checked_load_path()
                    outcome = _Source(path, self.load_training_state, state_layout_of(path))
                    logger.info(
                        "starting from load_path %s (training state: %s)",
                        self.load_path,
                        self.load_training_state,
                    )
                else:
                    logger.info(
                        "no checkpoint in %s and no load_path: starting at iteration 0 with the model's current "
                        "weights",
                        self.checkpoint_dir_local,
                    )
            except Exception as e:  # handed to every rank below
                outcome = e
        outcome = collectives.broadcast_from_rank0(outcome, self._group)
        if isinstance(outcome, BaseException):
            raise outcome
        self._source, self._source_decided = outcome, True
        return outcome

    def _ensure_group(self) -> None:
        """Create the checkpoint group if the process group appeared after construction (collective
        like the save/load that calls it); the writer thread must never use the default group."""
        if self._group is None and collectives.initialized():
            self._group = collectives.new_checkpoint_group(self.config.replica_timeout_s)

    def _checked_load_path(self) -> Path:
        path = Path(self.load_path)
        if not path.is_file():
            raise FileNotFoundError(f"CheckpointConfig.load_path={self.load_path!r} does not exist")
        if self.load_training_state:
            try:
                layout.parse_marker(path.name)
            except ValueError as e:
                raise ValueError(
                    f"CheckpointConfig.load_training_state=True needs load_path to name a checkpoint marker "
                    f"(iter_000000100.pt or ckpt_.pt, with its _optim.pt sibling), got {self.load_path!r}"
                ) from e
        return path

    def _sibling(self, source: _Source, kind: str, postfix: str = "") -> Path:
        marker = source.marker_path.name
        if postfix:
            marker = layout.replica_marker(marker, int(postfix.removeprefix("_RANK")))
        return source.marker_path.with_name(layout.sibling_name(marker, kind))

    def _weights_file(self, source: _Source, is_ema: bool, ema_id: int) -> Path:
        """The file holding the requested weights; a bare release file stands for itself (seed)."""
        if not source.marker_path.name.endswith(".pt"):
            return source.marker_path
        reg = self._sibling(source, layout.REG_MODEL)
        if not is_ema:
            path = reg
        else:
            path = self._sibling(source, layout.EMA_MODEL)
            replica = self._sibling(source, layout.EMA_MODEL, f"_RANK{ema_id}") if ema_id > 0 else None
            if replica is not None and replica.is_file():
                return replica
            if replica is not None:
                logger.warning("EMA replica %s not found; using %s", replica, path)
            if not path.is_file() and reg.is_file():
                logger.warning("%s not found; initialising the EMA from the regular weights %s", path, reg)
                return reg
        if not path.is_file():
            logger.warning(
                "%s not found; loading %s itself as weights (a release checkpoint)", path, source.marker_path
            )
            return source.marker_path
        return path

    def _load_weights(self, module: nn.Module, source: _Source, is_ema: bool, ema_id: int = 0) -> None:
        start = time.perf_counter()
        if source.state_layout == layout.SHARDED:
            path = self._load_sharded_weights(module, source, is_ema)
        else:
            path = self._weights_file(source, is_ema, ema_id)
            state = read_weights(path, trusted=self.config.trust_legacy_pickle)
            load_weights_into(module, state, strict=self.strict_resume, source=str(path))
        self._restored.add("ema" if is_ema else "reg")
        logger.info(
            "loaded %s weights from %s in %.2f s",
            "EMA" if is_ema else "model",
            path,
            time.perf_counter() - start,
        )

    def _load_sharded_weights(self, module: nn.Module, source: _Source, is_ema: bool) -> Path:
        """Reshard a weights part into `module` (collective); the EMA part, else the regular one. Returns
        the metadata file read, for the log."""
        from checkpointing import sharded

        directory, marker = source.marker_path.parent, source.marker_path.name
        kind = layout.REG_MODEL
        if is_ema:
            if (directory / layout.part_metadata_name(marker, layout.EMA_MODEL)).is_file():
                kind = layout.EMA_MODEL
            else:
                logger.warning("%s has no EMA part; initialising the EMA from the regular weights", marker)
        sharded.load_module(module, directory, marker, kind, self._group, self.strict_resume)
        return directory / layout.part_metadata_name(marker, kind)

    def _load_optim_file(self, source: _Source) -> dict[str, Any]:
        path = self._sibling(source, layout.OPTIM)
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: cannot restore the optimizer/scheduler of {source.marker_path}"
            )
        state = safe_torch_load(path, trusted=self.config.trust_legacy_pickle, mmap=True)
        if not isinstance(state, dict) or OPTIMIZER not in state:
            raise CheckpointError(f"{path} does not hold an {{'optimizer', 'scheduler'}} dict")
        return state

    def _restore_optim(
        self, model: Any, optimizer: Any, scheduler: Any, state: dict[str, Any], source: _Source
    ) -> None:
        if optimizer is not None and state.get(OPTIMIZER) is not None:
            if source.state_layout == layout.SHARDED:
                from checkpointing import sharded

                directory, marker = source.marker_path.parent, source.marker_path.name
                sharded.load_optimizer(module_of(model), optimizer, state[OPTIMIZER], directory, marker, self._group)
            else:
                restore_optimizer(model, optimizer, state[OPTIMIZER])
        if scheduler is not None and state.get(SCHEDULER) is not None:
            scheduler.load_state_dict(state[SCHEDULER])
        self._restored.add("optim")

    def load_model_during_init(self, model: Any, is_ema: bool = False, ema_id: int = 0) -> None:
        """Load regular (or EMA, or EMA replica `ema_id`) weights into a freshly built model."""
        if ema_id > 0 and not is_ema:
            raise ValueError(f"ema_id={ema_id} needs is_ema=True")
        source = self._decide_source()
        if source is None:
            logger.info("is_ema=%s: no checkpoint to load weights from", is_ema)
            return
        module = model if isinstance(model, nn.Module) else (ema_of(model) if is_ema else module_of(model))
        if module is None:
            raise TypeError(f"is_ema=True but {type(model).__name__} has no EMA module")
        self._load_weights(module, source, is_ema, ema_id)

    def load_optim_scheduler_during_init(self, fsdp_model: Any, optimizer: Any, scheduler: Any) -> None:
        """Restore optimizer and scheduler when resuming (the seed returned before the scheduler)."""
        source = self._decide_source()
        if source is None or not source.resume:
            return
        self._restore_optim(fsdp_model, optimizer, scheduler, self._load_optim_file(source), source)

    def load(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        grad_scaler: Any = None,
    ) -> int:
        """Restore everything not restored yet and return the iteration to continue from (0: fresh)."""
        self.callbacks.on_load_checkpoint_start(model)
        source = self._decide_source()
        iteration = 0
        if source is not None:  # else the model keeps the weights it has: a fresh init, or a fine-tuning start
            # 1. the marker: iteration, per-rank RNG and whatever callbacks stored
            has_marker = source.marker_path.name.endswith(".pt") and source.resume
            marker_state = (
                safe_torch_load(source.marker_path, trusted=self.config.trust_legacy_pickle)
                if has_marker
                else {}
            )
            # 2. weights not already loaded during init
            if "reg" not in self._restored:
                self._load_weights(module_of(model), source, is_ema=False)
            ema_module = ema_of(model)
            if ema_module is not None and "ema" not in self._restored:
                self._load_weights(ema_module, source, is_ema=True)
            # 3. training state
            if source.resume:
                iteration = int(marker_state[ITERATION])
                need_optim = "optim" not in self._restored and (
                    optimizer is not None or scheduler is not None
                )
                if need_optim or grad_scaler is not None:
                    optim_state = self._load_optim_file(source)
                    if need_optim:
                        self._restore_optim(model, optimizer, scheduler, optim_state, source)
                    if grad_scaler is not None and optim_state.get(GRAD_SCALER):
                        grad_scaler.load_state_dict(optim_state[GRAD_SCALER])
                self._restore_rng(marker_state)
            self.callbacks.on_load_checkpoint(model, state_dict=marker_state)
            logger.info("loaded checkpoint %s: continuing from iteration %d", source.marker_path, iteration)
        self.callbacks.on_load_checkpoint_end(model)
        return iteration

    def _restore_rng(self, marker_state: dict[str, Any]) -> None:
        states = marker_state.get(RNG)
        rank = collectives.rank()
        if not states:
            logger.warning(
                "the checkpoint holds no RNG state (written by the seed?); RNG streams are not restored"
            )
        elif rank < len(states):
            set_rng_state(states[rank])
        else:
            logger.warning(
                "the checkpoint was saved on %d ranks; rank %d keeps its current RNG state", len(states), rank
            )

    # ------------------------------------------------------------------ save

    def save(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        grad_scaler: Any,
        iteration: int,
        async_saving: bool = True,
    ) -> None:
        """Save a generation. Collective. With async saving, returns once this rank's share is copied; a
        failure of that write is raised by the next save() or finalize() on every rank."""
        # 1. finish the previous save and surface its failure everywhere
        self._finish_inflight()
        self._ensure_group()
        self.callbacks.on_save_checkpoint_start(model, iteration)
        # 2. decide what this rank writes: the full layout gathers on rank 0 (collective), the sharded one
        #    takes this rank's own shards
        marker = layout.marker_name(iteration, "", self.config.is_numbered(iteration))
        others = {
            SCHEDULER: scheduler.state_dict() if scheduler is not None else None,
            GRAD_SCALER: grad_scaler.state_dict() if grad_scaler is not None else None,
        }
        if self.config.state_layout == layout.SHARDED:
            job = self._sharded_job(model, optimizer, others, iteration, marker)
        else:
            job = self._full_job(model, optimizer, others, iteration, marker)
        # 3. one exchange: every rank's RNG state and any rank's lack of disk space
        self.checkpoint_dir_local.mkdir(parents=True, exist_ok=True)
        exchanged = collectives.all_gather(
            {"rng": rng_state(), "disk": self._disk_shortfall(job)}, self._group
        )
        shortfalls = [e["disk"] for e in exchanged if e["disk"]]
        if shortfalls:
            raise CheckpointWriteError(errno.ENOSPC, "; ".join(shortfalls))
        marker_state: dict[str, Any] = {
            ITERATION: iteration,
            layout.FORMAT: FORMAT_VERSION,
            WORLD_SIZE: collectives.world_size(),
            RNG: [e["rng"] for e in exchanged],
        }
        self.callbacks.on_save_checkpoint(model, state_dict=marker_state)
        job.marker_state = marker_state if job.primary else None
        # 4. write, in the background when allowed
        if async_saving and self.config.async_saving:
            start = time.perf_counter()
            self._stage(job)
            logger.debug(
                "staged iteration %d for async save in %.3f s", iteration, time.perf_counter() - start
            )
            self.save_thread = threading.Thread(
                target=self._write_generation, args=(job,), name="ckpt-writer"
            )
            self.save_thread.start()
        else:
            self._write_generation(job)
            self._finish_inflight(asynchronous=False)
        self.callbacks.on_save_checkpoint_end(model=None, iteration=iteration)

    def _full_job(
        self, model: Any, optimizer: Any, others: dict[str, Any], iteration: int, marker: str
    ) -> _SaveJob:
        """The full layout: full state gathered to rank 0 (collective), which writes it; EMA replica ranks
        write their EMA."""
        role = save_role(model)
        reg, ema = gather_model_states(model)
        optim = gather_optimizer_state(model, optimizer)
        files: list[tuple[str, Any]] = []
        if role.primary:
            if collectives.rank() != 0:
                raise ValueError(
                    f"rank {collectives.rank()} claims to be the primary checkpoint writer; only rank 0 may"
                )
            if reg is not None:
                files.append((layout.sibling_name(marker, layout.REG_MODEL), reg))
            if ema is not None:
                files.append((layout.sibling_name(marker, layout.EMA_MODEL), ema))
            files.append((layout.sibling_name(marker, layout.OPTIM), {OPTIMIZER: optim, **others}))
        elif role.writes_ema and ema is not None:
            replica = layout.marker_name(iteration, role.postfix, self.config.is_numbered(iteration))
            files.append((layout.sibling_name(replica, layout.EMA_MODEL), ema))
        return _SaveJob(iteration, marker, iteration in self.config.save_at_iters, role.primary, layout.FULL, files)

    def _sharded_job(
        self, model: Any, optimizer: Any, others: dict[str, Any], iteration: int, marker: str
    ) -> _SaveJob:
        """The sharded layout: every rank's own shards (nothing gathered); rank 0 also writes `_optim.pt`
        with what is not a tensor (param groups, scheduler, grad scaler), the marker and the manifest."""
        if is_seed_protocol(model):
            raise ValueError(
                "CheckpointConfig.state_layout='sharded' needs an nn.Module or a ModelWithEMA; the seed's model "
                "protocol hands over full state dicts, so save it with state_layout='full'"
            )
        from checkpointing import sharded  # DCP's import costs seconds; only sharded saves pay it

        parts, optim_rest = sharded.state_parts(model, optimizer)
        primary = collectives.rank() == 0
        files = [(layout.sibling_name(marker, layout.OPTIM), {OPTIMIZER: optim_rest, **others})] if primary else []
        job = _SaveJob(iteration, marker, iteration in self.config.save_at_iters, primary, layout.SHARDED, files)
        job.parts = parts
        return job

    def _stage(self, job: _SaveJob) -> None:
        """Copy what this rank writes into reused buffers, so training may change the live state meanwhile."""
        job.files = [(name, self._staging.stage(obj, ("file", i))) for i, (name, obj) in enumerate(job.files)]
        job.parts = [(kind, self._staging.stage(state, ("part", kind))) for kind, state in job.parts]
        job.marker_state = self._staging.stage(job.marker_state, ("marker",))

    def _disk_shortfall(self, job: _SaveJob) -> str | None:
        """A message if the generation would not fit; estimated from what this rank writes (times the world
        size for the sharded layout, whose ranks all write into this folder) and the previous generation."""
        estimate = tensor_bytes(job.files) + tensor_bytes(job.parts)
        if job.state_layout == layout.SHARDED:
            estimate *= collectives.world_size()
        basis = "the state being saved"
        if job.primary:
            previous = [g for g in list_generations(self.checkpoint_dir_local) if g.manifest is not None]
            if previous and previous[-1].total_bytes > estimate:
                estimate, basis = previous[-1].total_bytes, f"the previous generation {previous[-1].marker}"
        needed = int(estimate * self.config.disk_headroom)
        free = shutil.disk_usage(self.checkpoint_dir_local).free
        if free >= needed:
            return None
        return (
            f"not enough free disk space in {self.checkpoint_dir_local} to save iteration {job.iteration} on rank "
            f"{collectives.rank()}: need about {needed / 1e9:.3f} GB ({self.config.disk_headroom}x the size of "
            f"{basis}), {free / 1e9:.3f} GB free; nothing was written. Free disk space or lower keep_last_checkpoints."
        )

    def _write_generation(self, job: _SaveJob) -> None:
        """Write one rank's files and, on rank 0, commit the generation once every rank succeeded.

        The commit (marker, complete manifest, pointer) starts only after every rank has reported its
        files durable, so a rank that fails or dies before then leaves no marker: the generation can
        never pass for a finished one. Never raises: the outcome (identical on every rank) is kept
        for _finish_inflight.
        """
        rank = collectives.rank()
        start = time.perf_counter()
        failure: BaseException | None = None
        try:
            # 1. rank 0 marks an existing generation incomplete before any of its files is replaced
            error = None
            if job.primary:
                try:
                    self._mark_replaced(job)
                except Exception as e:
                    failure, error = e, f"rank {rank}: {e}"
            errors = [e for e in collectives.all_gather(error, self._group) if e]
            # 2. every writer writes its own files (the marker is not among them) and reports them
            records, error = [], None
            if not errors:
                try:
                    records = self._write_own_files(job)
                except Exception as e:
                    failure, error = e, f"rank {rank}: {e}"
            gathered = collectives.all_gather((records, error), self._group)
            errors += [e for _, e in gathered if e]
            # 3. every rank's files are durable: rank 0 commits, then prunes
            error = None
            if job.primary and not errors:
                try:
                    self._commit(job, [r for rank_records, _ in gathered for r in rank_records])
                except Exception as e:
                    failure, error = e, f"rank {rank}: {e}"
                else:
                    self._prune()
            published_error = collectives.broadcast_from_rank0(error, self._group)
            errors += [published_error] if published_error else []
        except Exception as e:  # a collective failed: a peer died or timed out
            failure, errors = e, [f"rank {rank}: {e}"]
        if errors:
            message = f"checkpoint save of iteration {job.iteration} failed: " + "; ".join(errors)
            logger.error("%s", message)
            self._failure = failure if failure is not None else CheckpointError(message)
            self._failure_message = message
            return
        logger.info(
            "saved checkpoint %s (iteration %d) on rank %d in %.2f s",
            job.marker,
            job.iteration,
            rank,
            time.perf_counter() - start,
        )
        if job.files:
            self.callbacks.on_save_checkpoint_success(iteration=job.iteration)

    def _write_own_files(self, job: _SaveJob) -> list[FileRecord]:
        """This rank's files, durable, with their records. The sharded parts come first: they are collective,
        and DCP raises a failure of any rank on every rank alike, so no rank leaves while others still wait in
        them; what may fail on one rank alone (its whole files) runs after the last collective."""
        directory = self.checkpoint_dir_local
        records = []
        if job.parts:
            from checkpointing import sharded

            writers = sharded.save_parts(job.parts, directory, job.marker, self._group)
            records = sharded.part_records(writers)
        return records + atomic_torch_save_all([(obj, directory / name) for name, obj in job.files])

    def _mark_replaced(self, job: _SaveJob) -> None:
        """Before an existing generation's files are overwritten (ckpt_.pt, or a repeated iteration),
        back ckpt_.pt up and mark its manifest incomplete, so a torn overwrite is never loaded."""
        directory = self.checkpoint_dir_local
        if layout.parse_marker(job.marker) is None:
            self._link_backup(job.marker)
        manifest_path = directory / layout.sibling_name(job.marker, layout.MANIFEST)
        if manifest_path.exists() or (directory / job.marker).exists():
            Manifest(job.iteration, complete=False, world_size=collectives.world_size()).write(manifest_path)

    def _commit(self, job: _SaveJob, records: list[FileRecord]) -> None:
        """Rank 0's commit, in order: the marker, the complete manifest (every rank's files and the
        marker), then the pointer. A crash between marker and manifest leaves a marker whose format
        key, without a complete manifest, makes the generation invalid (generations.py)."""
        directory = self.checkpoint_dir_local
        self._remove_strays(job.marker, {r.name for r in records})
        records = [*records, atomic_torch_save(job.marker_state, directory / job.marker)]
        manifest = Manifest.from_records(
            job.iteration, records, collectives.world_size(), job.pinned, job.state_layout
        )
        manifest.write(directory / layout.sibling_name(job.marker, layout.MANIFEST))
        atomic_write_text(directory / layout.POINTER_NAME, f"{job.marker}\n")

    def _remove_strays(self, marker: str, written: set[str]) -> None:
        """Delete files of `marker`'s generation this save did not write (an earlier save of the same name
        with other files, a failed attempt), so the manifest lists exactly the generation's files. The
        generation is not committed at this point: no complete manifest names it."""
        keep = {*written, marker, layout.sibling_name(marker, layout.MANIFEST)}
        strays = [
            name
            for name in os.listdir(self.checkpoint_dir_local)
            if layout.generation_of(name) == marker and name not in keep
        ]
        for name in strays:
            (self.checkpoint_dir_local / name).unlink(missing_ok=True)
        if strays:
            fsync_dir(self.checkpoint_dir_local)
            logger.info("removed %d file(s) of an earlier save of %s: %s", len(strays), marker, strays)

    def _link_backup(self, marker: str) -> None:
        """Before `ckpt_.pt` is overwritten in place, hard-link its committed files as `iter_<its iteration>`.

        Files cannot all be replaced in one atomic step, so a crash mid-overwrite leaves `ckpt_.pt`
        torn; the links give the resume a whole generation to fall back to, at no disk cost. They are
        removed once the new `ckpt_.pt` is committed.
        """
        directory = self.checkpoint_dir_local
        generations = {g.marker: g for g in list_generations(directory)}
        current = generations.get(marker)
        if current is None or current.manifest is None or generation_problems(directory, current, "size"):
            return
        backup = layout.marker_name(current.manifest.iteration, "", numbered=True)
        existing = generations.get(backup)
        if existing is not None:
            if not generation_problems(directory, existing, "size"):
                return  # a committed generation of that iteration already stands in for ckpt_.pt
            delete_generation(directory, existing)  # the leftover of a save killed before its commit
        old_stem, new_stem = layout.stem_of(marker), layout.stem_of(backup)
        files = {new_stem + name[len(old_stem) :]: entry for name, entry in current.manifest.files.items()}
        for name in sorted(current.manifest.files, key=lambda n: n == marker):  # the marker link last
            target = directory / (new_stem + name[len(old_stem) :])
            target.unlink(missing_ok=True)
            os.link(directory / name, target)
        fsync_dir(directory)
        replace(current.manifest, files=files, backup=True, pinned=False).write(
            directory / layout.sibling_name(backup, layout.MANIFEST)
        )

    def _prune(self) -> None:
        """Retention after the pointer moved (backups of ckpt_.pt go first); a failure never fails the save."""
        try:
            for generation in list_generations(self.checkpoint_dir_local):
                if generation.manifest is not None and generation.manifest.backup:
                    delete_generation(self.checkpoint_dir_local, generation)
            if self.config.keep_last_checkpoints <= 0:
                return
            for generation in prune_plan(
                self.checkpoint_dir_local,
                self.config.keep_last_checkpoints,
                self.config.save_at_iters,
                "size",
            ):
                delete_generation(self.checkpoint_dir_local, generation)
        except Exception as e:
            logger.warning(
                "pruning old checkpoints in %s failed (the save itself succeeded): %s",
                self.checkpoint_dir_local,
                e,
            )

    def _join(self) -> None:
        if self.save_thread is not None:
            self.save_thread.join()
            self.save_thread = None

    def _finish_inflight(self, asynchronous: bool = True) -> None:
        self._join()
        failure, self._failure = self._failure, None
        if failure is None:
            return
        if not asynchronous:
            raise failure
        raise AsyncSaveError(f"an earlier asynchronous save failed: {self._failure_message}") from failure

    def finalize(self) -> None:
        """Wait for the in-flight save; raise its failure (on every rank)."""
        self._finish_inflight()
