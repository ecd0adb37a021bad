"""The sharded layout: every rank writes its own shards of the model, EMA and optimizer tensors with
torch.distributed.checkpoint (DCP), and any world size, one plain process included, reads them back (DCP
reshards on load).

DCP's FileSystemWriter plans, deduplicates replicated tensors and serialises; `_ShardWriter` changes only what
the generation protocol needs:
  * names: one flat file per rank and part, named after the generation (`layout.shard_name`), so a generation
    stays the set of files sharing its marker's stem in one folder, listed and pruned as a whole;
  * atomicity: each file is written as `<name>.tmp.<pid>`, fsynced, renamed and its directory fsynced, so a
    file is durable before the commit and an overwrite never truncates a file the `ckpt_` backup hard-links;
  * the metadata: written atomically by rank 0 under the part's own name, holding no server path.
The commit (marker, manifest, pointer) stays the checkpointer's.

Reading trusts nothing: the metadata is unpickled with an allow-list of DCP's record classes, every storage
entry must name a shard of the same part (renamed to the reading generation's stem, so the hard-linked backup
of `ckpt_` reads its own files), and an entry that is not a tensor is refused, since DCP loads non-tensor
items with a code-running `torch.load`. Parts therefore hold tensors only; the optimizer's param groups and
other plain values go into rank 0's `_optim.pt`, loaded weights-only.

Imported only when a sharded generation is saved or read: DCP's import costs about half a second.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import pickle
import queue
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult

from checkpointing import layout
from checkpointing.atomic import FileRecord, atomic_write_bytes, fsync_dir, tmp_path_for, without_torch_crc32
from checkpointing.errors import (
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from checkpointing.state import ema_of, module_of
from checkpointing.trust import member_problem
from checkpointing.weights import check_fit, is_plain

logger = logging.getLogger(__name__)
# DCP warns on every save and load without a process group; here that is deliberate (one process alone).
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is .*assuming the intent is to (save|load) in a single process"
)

#: Key of the tensors in the optimizer part (the rest of the optimizer state dict is in `_optim.pt`).
_STATE = "state"


# ------------------------------------------------------------------ writing


class _HashingStream:
    """A file opened for writing that hashes every byte on its way out, so the manifest's sha256 needs no
    second read. DCP writes its files front to back (torch.save into a stream, never a seek)."""

    def __init__(self, file: Any) -> None:
        self._file, self.size, self.digest = file, 0, hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        return self._file.write(view)

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


class _AtomicFileSystem(FileSystem):
    """DCP's local file system, writing each file under a temporary name and renaming it once complete
    and fsynced (DCP fsyncs it: sync_files=True); `records` keeps each file's size and sha256."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, FileRecord] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        tmp = tmp_path_for(path)
        try:
            with open(tmp, mode) as file:
                stream = _HashingStream(file)
                yield stream
            if stream.size != tmp.stat().st_size:
                raise CheckpointError(f"{path}: {tmp.stat().st_size} bytes on disk, {stream.size} written")
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.records[path.name] = FileRecord(path.name, stream.size, stream.digest.hexdigest())


class _ShardWriter(FileSystemWriter):
    """FileSystemWriter with the generation's file names, atomic files and an atomic, path-free metadata file."""

    def __init__(self, directory: Path, marker: str, kind: str) -> None:
        super().__init__(directory, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.fs = _AtomicFileSystem()
        self._directory, self._marker, self.kind = directory, marker, kind
        self.metadata_record: FileRecord | None = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Unlike FileSystemWriter: the folder exists, and replacing a generation is the checkpointer's job."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(layout.shard_name(self._marker, self.kind, rank)))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """One file per rank, even an empty one, so a generation's file set follows from its world size."""
        name = plan.storage_data.prefix
        files: queue.Queue = queue.Queue()
        files.put((self._directory / name, name, plan.items))
        return self._write_data(planner, files)

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(save_id=self.save_id)  # no checkpoint_id: the files must not carry a server path

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        path = self._directory / layout.part_metadata_name(self._marker, self.kind)
        self.metadata_record = atomic_write_bytes(path, pickle.dumps(metadata))


def _failures(e: CheckpointException) -> str:
    """`rank r: error` for every rank DCP reports, without DCP's tracebacks (the log keeps one line)."""
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(e.failures.items()))


def _save_error(e: CheckpointException, kind: str, marker: str) -> CheckpointError | CheckpointWriteError:
    """DCP's failure as the full layout reports it: an OS error keeps its errno (ENOSPC: the disk is full)."""
    message = f"writing the {kind} shards of {marker} failed: {_failures(e)}"
    codes = [exc.errno for exc, _ in e.failures.values() if isinstance(exc, OSError) and exc.errno]
    if not codes:
        return CheckpointError(message)
    hint = " (the disk is full)" if errno.ENOSPC in codes else ""
    return CheckpointWriteError(codes[0], message + hint)


def save_parts(parts: list[tuple[str, dict]], directory: Path, marker: str, group: Any) -> list[_ShardWriter]:
    """Write this rank's shards of every part; collective over `group` (None: this process alone).

    DCP raises a failure of any rank on every rank alike (as CheckpointError here, naming the ranks), so all
    ranks leave together. Files are hashed as they are written; torch's per-record CRC32 is off, as for the
    full layout (the manifest's sha256 covers every byte).
    """
    writers = []
    for kind, state in parts:
        writer = _ShardWriter(directory, marker, kind)
        try:
            with without_torch_crc32():
                dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
        except CheckpointException as e:  # a BaseException: it would slip past `except Exception`
            raise _save_error(e, kind, marker) from None
        writers.append(writer)
    return writers


def part_records(writers: list[_ShardWriter]) -> list[FileRecord]:
    """Size and sha256 of this rank's shard of each part (hashed as written), and of rank 0's metadata files."""
    records = []
    for writer in writers:
        records += writer.fs.records.values()
        if writer.metadata_record is not None:
            records.append(writer.metadata_record)
    return records


def state_parts(model: Any, optimizer: torch.optim.Optimizer | None) -> tuple[list[tuple[str, dict]], dict | None]:
    """(DCP parts, the optimizer state without its tensors): this rank's shards, without gathering anything.

    Every rank holds the same parts with the same keys, which DCP's collective planning needs.
    """
    module = module_of(model)
    parts = [(layout.REG_MODEL, get_model_state_dict(module))]
    ema = ema_of(model)
    if ema is not None:
        parts.append((layout.EMA_MODEL, get_model_state_dict(ema)))
    if optimizer is None:
        return parts, None
    state = get_optimizer_state_dict(module, optimizer)
    tensors = {fqn: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for fqn, s in state[_STATE].items()}
    rest = {fqn: {k: v for k, v in s.items() if not isinstance(v, torch.Tensor)} for fqn, s in state[_STATE].items()}
    parts.append((layout.OPTIM, {_STATE: tensors}))
    return parts, {_STATE: rest, "param_groups": state["param_groups"]}


# ------------------------------------------------------------------ reading

_ALLOWED_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any global outside DCP's record classes is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"the DCP metadata needs the pickle global {module}.{name}, which DCP metadata never holds; "
            "refused, since unpickling it could run code"
        )


def read_part_metadata(directory: Path, marker: str, kind: str) -> Metadata:
    """The checked metadata of one part, its storage entries renamed to this generation's shard files."""
    name = layout.part_metadata_name(marker, kind)
    problem = member_problem(directory, name)
    if problem is not None:
        raise CorruptCheckpointError(f"{directory}: {problem}")
    try:
        with open(directory / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a torn or foreign pickle fails in many ways
        raise CorruptCheckpointError(f"{directory / name} is not DCP metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{directory / name} is not DCP metadata")
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{directory / name}: entry {fqn!r} is not a tensor; sharded parts hold tensors only, and DCP would "
                "load it with a code-running torch.load"
            )
    storage = {}
    for index, info in (metadata.storage_data or {}).items():
        path = info.relative_path if isinstance(info, _StorageInfo) else None
        shard = layout.part_file(path) if isinstance(path, str) else None
        if shard is None or shard[1] != kind or shard[2] is None:
            raise CorruptCheckpointError(f"{directory / name}: a storage entry names {repr(info)[:200]}, not a shard of {kind}")
        storage[index] = dataclasses.replace(info, relative_path=layout.shard_name(marker, kind, shard[2]))
    metadata.storage_data = storage
    return metadata


class _ShardReader(FileSystemReader):
    """FileSystemReader over checked metadata (read_part_metadata) instead of `pickle.load` of `.metadata`."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def _load_part(
    target: dict, directory: Path, marker: str, kind: str, metadata: Metadata, group: Any, partial: bool
) -> None:
    """Fill `target` (this rank's tensors, in any sharding) in place; collective over `group` (None: alone).

    partial: `target` may hold fewer keys than the part (weights already checked by check_fit); without
    it, every key of `target` must be in the part (the optimizer's moments)."""
    try:
        dcp.load(
            target,
            storage_reader=_ShardReader(directory, metadata),
            planner=DefaultLoadPlanner(allow_partial_load=partial),
            process_group=group,
            no_dist=group is None,
        )
    except CheckpointException as e:  # a BaseException: it would slip past `except Exception`
        raise CorruptCheckpointError(f"reading the {kind} shards of {directory / marker} failed: {_failures(e)}") from None


def load_module(
    module: nn.Module, directory: Path, marker: str, kind: str, group: Any, strict: bool
) -> None:
    """Load a weights part into a plain, DDP, FSDP1 or FSDP2 module, reading only that part's files.

    The fit is judged from the metadata's global shapes before any shard is read (strict: raise listing
    every mismatch). A plain module is filled in place, so a plain process never holds a second copy.
    """
    metadata = read_part_metadata(directory, marker, kind)
    shapes = {fqn: tuple(entry.size) for fqn, entry in metadata.state_dict_metadata.items()}
    fitting = check_fit(module, shapes, strict, str(directory / layout.part_metadata_name(marker, kind)))
    plain = is_plain(module)
    state = module.state_dict() if plain else get_model_state_dict(module)
    target = {k: v for k, v in state.items() if k in fitting}
    _load_part(target, directory, marker, kind, metadata, group, partial=True)
    if not plain:
        set_model_state_dict(module, target, options=StateDictOptions(strict=False))


def load_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer, rest: dict, directory: Path, marker: str, group: Any
) -> None:
    """Restore the optimizer: its tensors resharded from the optimizer part, the rest from `_optim.pt`."""
    metadata = read_part_metadata(directory, marker, layout.OPTIM)
    state = get_optimizer_state_dict(module, optimizer)  # this rank's shards, the state initialised
    tensors = {fqn: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for fqn, s in state[_STATE].items()}
    _load_part({_STATE: tensors}, directory, marker, layout.OPTIM, metadata, group, partial=False)
    merged = {fqn: {**rest[_STATE].get(fqn, {}), **values} for fqn, values in tensors.items()}
    set_optimizer_state_dict(module, optimizer, {_STATE: merged, "param_groups": rest["param_groups"]})
