"""Untrusted files are read, and sweeps registered, in a worker process with bounded memory, CPU and time.

The readers and KISS-ICP run native code on the bytes they are given: a LAZ chunk table claiming 4 billion
chunks makes the decoder ask for 64 GiB and abort its process (SIGABRT), a corrupt one raises a Rust panic,
and a cloud of random points keeps KISS-ICP busy, holding the GIL, for tens of seconds. None of that may
happen in a server's process, nor end a command line in a signal. So each read runs in a worker, a fresh
interpreter (`python -m lidar.sandbox`) that
- sets `RLIMIT_AS` (memory beyond what its interpreter and imports hold), `RLIMIT_CPU`, `RLIMIT_FSIZE` and
  no core files before it touches the input, while its caller kills it at a wall-clock deadline and when
  the request is cancelled (`lidar.cancel`);
- sends its stderr (where a native decoder prints its backtrace) to its task folder and, cut short, to
  the caller's log, never to the user;
- hands back plain arrays, one `.npy` per array in a private task folder, loaded without pickle, and a
  JSON reply on a pipe;
- serves one task and exits, so one visitor's file never shares a process with the next one's.

A worker that crashes, runs out of memory or out of time raises `OverLimits`, an `InputError` naming the
input ("kitti.laz could not be read within the server's limits (...)"). An `InputError` in the worker
comes back as the same type with the same message; any other exception is a bug, raised as `WorkerBug`
with the worker's traceback.

Why a fresh interpreter: multiprocessing's spawn and forkserver start methods re-import the caller's main
script in every child (the app's builds its whole page and imports torch and Gradio), and fork is unsafe
in a threaded server. An interpreter that imports the readers starts in ~0.3 s (~0.6 s with KISS-ICP), so
a server keeps `spares` workers started ahead (`configure`) and a visitor's read pays only the hand-over;
bench/worker_bench.py measures it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from lidar.cancel import checkpoint
from lidar.errors import InputError, shown
from lidar.formats.scan import PointCloudError, Scan, max_points, point_limit
from lidar.recordings.base import ContainerRecording
from lidar.sensors import Sensor
from lidar.sequence import Recording, SweepSequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLimits:
    """What one worker may spend on one task."""

    #: Whose limits they are, as a refusal names them: "server's" or "reader's".
    owner: str
    #: Address space the worker may map beyond what its interpreter and imports hold (`RLIMIT_AS`).
    memory_bytes: int
    #: CPU seconds the task may use (`RLIMIT_CPU`; KISS-ICP runs on one thread).
    cpu_seconds: int
    #: Wall-clock seconds from the hand-over to the reply; past them the caller kills the worker.
    wall_seconds: float
    #: Largest file the worker may write: an extracted zip member, one result array (`RLIMIT_FSIZE`).
    file_bytes: int

    def describe(self) -> str:
        return f"{_size(self.memory_bytes)} of memory, {self.cpu_seconds} s of CPU, {self.wall_seconds:g} s"


def _size(count: int) -> str:
    return f"{count / 2**30:g} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


#: The command lines and library callers: a user's own files, up to the readers' 5 M points a cloud and four
#: such clouds a sequence (20 M points, ~0.5 GB of arrays, several times that while decoding and registering).
READER_LIMITS = WorkerLimits("reader's", memory_bytes=8 * 2**30, cpu_seconds=1800, wall_seconds=3600.0,
                             file_bytes=2 * 2**30)
#: A public server reading a visitor's upload (1 M points a sweep, 4 M a scene): the largest legitimate
#: upload needs ~0.5 GiB and ~20 s (50 KITTI-sized sweeps registered), so these leave room without letting
#: one visitor hold the machine.
SERVER_LIMITS = WorkerLimits("server's", memory_bytes=2 * 2**30, cpu_seconds=60, wall_seconds=90.0,
                             file_bytes=512 * 2**20)
#: How often a waiting caller checks for cancellation and the deadline (seconds).
POLL_S = 0.05
#: Most bytes of a worker's JSON reply (a message is capped far below; a bigger reply is a broken worker).
MAX_REPLY_BYTES = 1 << 20
#: Most characters of a dead worker's stderr that go to the log.
MAX_LOGGED_STDERR = 2000
#: Most sweeps of a recording one worker decodes for `WorkerContainer.sweeps`: every task starts an
#: interpreter and re-indexes the container (~0.5 s), so a conversion reads its sweeps in batches; a batch
#: waits on disk in its task folder (16 KITTI sweeps: ~35 MB) and in the caller's memory once loaded.
SWEEPS_PER_TASK = 16
#: Most characters of the names a refusal lists for a sequence of files.
MAX_LABEL_CHARS = 200
#: Environment of every worker: native thread pools of one thread (the task is bounded by `RLIMIT_CPU`, which
#: counts every thread, and a server's cores are the visitors'), and a native panic in one line.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "RAYON_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "RUST_BACKTRACE": "0"}
#: The input-error types a worker's refusal comes back as (by name, so the reply stays plain JSON).
_INPUT_ERRORS: dict[str, type[InputError]] = {"InputError": InputError, "PointCloudError": PointCloudError}


class OverLimits(InputError):
    """An input that could not be read within the worker's limits: it crashed the reader, or needed more
    memory, CPU or time than the limits give. The message names the input and which limit."""


class WorkerBug(RuntimeError):
    """A worker raised something other than an `InputError`: a bug, with the worker's traceback."""


# ----------------------------------------------------------------------------------------------------------
# What crosses between the caller and the worker: JSON, with arrays as .npy files in the task folder.


class _Arrays:
    """Arrays of one task as `.npy` files in its folder, referred to in JSON as {"npy": name}."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder, self.prefix, self.count = folder, prefix, 0

    def put(self, array: np.ndarray | None) -> dict[str, str] | None:
        if array is None:
            return None
        name = f"{self.prefix}{self.count}.npy"
        self.count += 1
        np.save(self.folder / name, np.ascontiguousarray(array), allow_pickle=False)
        return {"npy": name}

    def get(self, ref: dict[str, str] | None) -> np.ndarray | None:
        if ref is None:
            return None
        name = Path(ref["npy"]).name  # never a path out of the folder
        return np.load(self.folder / name, allow_pickle=False)


#: The `Scan` fields that are arrays, a path and a tuple; every other field crosses as its JSON value, so a
#: field added to `Scan` crosses too (or fails loudly, if JSON cannot hold it).
_SCAN_ARRAYS, _SCAN_PATHS, _SCAN_TUPLES = ("points", "ring"), ("path",), ("columns",)


#: What crosses between the processes of a `Scan`: what it is made with, not what was measured of it since.
_SCAN_FIELDS = tuple(f.name for f in fields(Scan) if f.init)


def _scan_out(scan: Scan, arrays: _Arrays) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _SCAN_FIELDS:
        value = getattr(scan, name)
        if name in _SCAN_ARRAYS:
            value = arrays.put(value)
        elif name in _SCAN_PATHS:
            value = None if value is None else str(value)
        elif name in _SCAN_TUPLES:
            value = list(value)
        out[name] = value
    return out


def _scan_in(data: dict[str, Any], arrays: _Arrays) -> Scan:
    values: dict[str, Any] = {}
    for name in _SCAN_FIELDS:
        value = data[name]
        if name in _SCAN_ARRAYS:
            value = arrays.get(value)
        elif name in _SCAN_PATHS:
            value = None if value is None else Path(value)
        elif name in _SCAN_TUPLES:
            value = tuple(value)
        values[name] = value
    return Scan(**values)


_REGISTRATION_FIELDS = ("poses", "fitness", "rmse", "sigma", "seconds")


def _registration_out(registration: Any, arrays: _Arrays) -> dict[str, Any] | None:
    if registration is None:
        return None
    return {name: arrays.put(getattr(registration, name)) for name in _REGISTRATION_FIELDS}


def _registration_in(data: dict[str, Any] | None, arrays: _Arrays) -> Any:
    if data is None:
        return None
    from lidar.registration import Registration

    return Registration(**{name: arrays.get(data[name]) for name in _REGISTRATION_FIELDS})


def _sequence_out(seq: SweepSequence, arrays: _Arrays) -> dict[str, Any]:
    return {"scans": [_scan_out(scan, arrays) for scan in seq.scans], "names": list(seq.names),
            "poses": arrays.put(seq.poses), "times": arrays.put(seq.times)}


def _sequence_in(data: dict[str, Any], arrays: _Arrays) -> SweepSequence:
    return SweepSequence([_scan_in(scan, arrays) for scan in data["scans"]], [str(n) for n in data["names"]],
                         arrays.get(data["poses"]), arrays.get(data["times"]))


def _sensor_out(sensor: Sensor | None) -> dict[str, Any] | None:
    return None if sensor is None else sensor.to_dict()


def _sensor_in(data: dict[str, Any] | None) -> Sensor | None:
    return None if data is None else Sensor.from_dict(data)


# ----------------------------------------------------------------------------------------------------------
# The tasks, as the worker runs them: JSON arguments and the task's arrays in, JSON and arrays out.


def _task_read_points(args: dict[str, Any], inputs: list[np.ndarray], out: _Arrays) -> dict[str, Any]:
    from lidar.formats import read_points

    return _scan_out(read_points(args["path"], _sensor_in(args["sensor"])), out)


def _task_read_sequence(args: dict[str, Any], inputs: list[np.ndarray], out: _Arrays) -> dict[str, Any]:
    """Read a sequence, then register it when asked to (`register` True) or when it came without poses and
    holds several sweeps (`register` None): one task, so the sweeps cross back once."""
    from lidar.registration import register_sweeps
    from lidar.sequence import read_sequence

    seq = read_sequence(args["source"], sensor=_sensor_in(args["sensor"]), poses=args["poses"], topic=args["topic"])
    register = args["register"]
    registration = None
    if register or (register is None and seq.poses is None and len(seq.scans) > 1):
        registration = register_sweeps(seq.scans, names=seq.names)
    return {"sequence": _sequence_out(seq, out), "registration": _registration_out(registration, out)}


def _task_register(args: dict[str, Any], inputs: list[np.ndarray], out: _Arrays) -> dict[str, Any]:
    from lidar.registration import register_sweeps

    return _registration_out(register_sweeps(inputs, names=args["names"]), out)


def _names_out(names: Sequence[str], arrays: _Arrays) -> dict[str, str] | None:
    """A list of names as a string array (a drive lists 100,000 sweeps: more than a JSON reply may hold)."""
    return arrays.put(np.array(list(names), dtype=str))


def _names_in(ref: dict[str, str] | None, arrays: _Arrays) -> list[str]:
    names = arrays.get(ref)
    return [] if names is None else [str(name) for name in names.tolist()]


def _open_in_worker(args: dict[str, Any]) -> Recording:
    from lidar.sequence import open_recording

    return open_recording(args["source"], sensor=_sensor_in(args["sensor"]), topic=args["topic"])


def _task_open_recording(args: dict[str, Any], inputs: list[np.ndarray], out: _Arrays) -> dict[str, Any]:
    """A recording's index: its files, poses and times, and for a container its sweeps' names, stamps,
    kind and topic."""
    from lidar.recordings import ContainerRecording

    rec = _open_in_worker(args)
    reply: dict[str, Any] = {"files": _names_out([str(f) for f in rec.files], out), "poses": out.put(rec.poses),
                             "times": out.put(rec.times), "container": None}
    if isinstance(rec, ContainerRecording):
        reply["container"] = {"labels": _names_out(rec.labels, out), "stamps_ns": out.put(rec.stamps_ns),
                              "kind": rec.kind, "topic": rec.topic}
    return reply


def _task_recording_sweeps(args: dict[str, Any], inputs: list[np.ndarray], out: _Arrays) -> dict[str, Any]:
    """Sweeps `indices` of a recording, re-opened here: each is written out as it is decoded, so the worker
    holds one sweep at a time."""
    rec = _open_in_worker(args)
    return {"scans": [_scan_out(rec[int(i)], out) for i in args["indices"]]}


_TASKS: dict[str, Callable[[dict[str, Any], list[np.ndarray], _Arrays], dict[str, Any]]] = {
    "read_points": _task_read_points,
    "read_sequence": _task_read_sequence,
    "register": _task_register,
    "open_recording": _task_open_recording,
    "recording_sweeps": _task_recording_sweeps,
}


# ----------------------------------------------------------------------------------------------------------
# The worker process.


def _limit_self(limits: dict[str, Any]) -> None:
    """Bound this process before it reads: memory beyond what it maps now, CPU beyond what it used, the size
    of any file it writes, no core file when it aborts."""
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime) + int(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_AS, (mapped + int(limits["memory_bytes"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))  # SIGXCPU, then SIGKILL if it is ignored
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["file_bytes"]),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _failure(err: BaseException) -> dict[str, Any]:
    """The reply for a task that raised: an input error, memory, a native panic, or a bug."""
    if _out_of_memory(err):
        return {"error": "memory"}
    if isinstance(err, InputError):
        kind = type(err).__name__ if type(err).__name__ in _INPUT_ERRORS else "InputError"
        return {"error": "input", "type": kind, "message": str(err)}
    if not isinstance(err, Exception):  # a pyo3 PanicException and kin: native code gave up on these bytes
        return {"error": "panic", "type": type(err).__name__, "message": str(err)[:200]}
    return {"error": "bug", "type": type(err).__name__, "traceback": traceback.format_exc()[-8000:]}


def _out_of_memory(err: BaseException | None) -> bool:
    """Whether `err`, or what it was raised from, is the memory limit: a MemoryError, or a map or read the
    kernel refused (ENOMEM). A reader that reports it as a file it cannot read was stopped by the limit,
    not by the file."""
    while err is not None:
        if isinstance(err, MemoryError) or (isinstance(err, OSError) and err.errno == errno.ENOMEM):
            return True
        err = err.__cause__
    return False


def _serve(tasks: Connection, replies: Connection, warm: bool) -> None:
    """The worker: wait for one task, bound itself, run it, reply, exit."""
    if warm:  # a spare imports everything a task may need while it waits
        import lidar.formats
        import lidar.registration
        import lidar.sequence  # noqa: F401
    try:
        task = json.loads(tasks.recv_bytes())
    except EOFError:  # the caller went away before handing over a task
        return
    folder = Path(task["folder"])
    err_file = os.open(folder / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(err_file, 2)
    tempfile.tempdir = str(folder)  # zip members are extracted here, and go with the folder when it is removed
    _limit_self(task["limits"])
    inputs = _Arrays(folder, "in")
    try:
        with point_limit(int(task["point_limit"])):
            loaded = [inputs.get({"npy": f"in{i}.npy"}) for i in range(int(task["inputs"]))]
            reply: dict[str, Any] = {"result": _TASKS[task["name"]](task["args"], loaded, _Arrays(folder, "out"))}
    except BaseException as err:  # everything goes back as a reply; only a crash has none
        reply = _failure(err)
    replies.send_bytes(json.dumps(reply).encode())


# ----------------------------------------------------------------------------------------------------------
# The caller's side.


@dataclass
class _Worker:
    process: subprocess.Popen
    tasks: Connection
    replies: Connection

    @classmethod
    def start(cls, warm: bool) -> _Worker:
        """A worker in its own session (a terminal's Ctrl-C reaches its caller, which kills it) that finds
        this package wherever its caller did."""
        task_r, task_w = os.pipe()
        reply_r, reply_w = os.pipe()
        package_root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "lidar.sandbox", str(task_r), str(reply_w), *(["--warm"] if warm else [])]
        try:
            process = subprocess.Popen(argv, pass_fds=(task_r, reply_w), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, start_new_session=True,
                                       env={**os.environ, **WORKER_ENV, "PYTHONPATH": path})
        finally:
            os.close(task_r)
            os.close(reply_w)
        return cls(process, Connection(task_w, readable=False), Connection(reply_r, writable=False))

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        self.tasks.close()
        self.replies.close()


class WorkerPool:
    """Workers for one process: started on demand, or `spares` of them ahead of time; each serves one task."""

    def __init__(self, limits: WorkerLimits = READER_LIMITS, spares: int = 0) -> None:
        self.limits, self.spares = limits, spares
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._top_up()

    @contextlib.contextmanager
    def run(self, name: str, args: dict[str, Any], label: str,
            inputs: Sequence[np.ndarray] = ()) -> Iterator[tuple[dict[str, Any], _Arrays]]:
        """Run task `name` with `args` and `inputs` (arrays) in a worker; yields its JSON result and its
        arrays, which are removed with the task folder when the block ends.

        Raises the worker's `InputError`, `OverLimits` naming `label`, or `WorkerBug`; a `Cancelled` (or any
        other interruption of the caller) kills the worker on its way out.
        """
        folder = Path(tempfile.mkdtemp(prefix="lidarverse-worker-"))
        try:
            staged = _Arrays(folder, "in")
            for array in inputs:
                staged.put(np.asarray(array))
            reply = self._exchange(name, args, len(inputs), folder, label)
            if "result" not in reply:
                raise self._error(reply, label)
            yield reply["result"], _Arrays(folder, "out")
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _exchange(self, name: str, args: dict[str, Any], inputs: int, folder: Path, label: str) -> dict[str, Any]:
        """Hand the task to a worker and wait for its reply, the deadline or a cancellation; the worker is
        killed whatever happens, and a spare started in its place."""
        task = json.dumps({"name": name, "args": args, "inputs": inputs, "folder": str(folder),
                           "point_limit": max_points(), "limits": {"memory_bytes": self.limits.memory_bytes,
                                                                   "cpu_seconds": self.limits.cpu_seconds,
                                                                   "file_bytes": self.limits.file_bytes}}).encode()
        worker = self._take()
        try:
            try:
                worker.tasks.send_bytes(task)
            except OSError:  # a spare that died before the hand-over (killed from outside): a fresh one
                worker.kill()
                worker = _Worker.start(warm=False)
                worker.tasks.send_bytes(task)
            deadline = time.monotonic() + self.limits.wall_seconds
            while not worker.replies.poll(POLL_S):
                checkpoint()  # a cancelled request stops here, and the `finally` kills its worker
                if time.monotonic() > deadline:
                    raise self._over(label, f"it took longer than {self.limits.wall_seconds:g} s", _stderr(folder))
            try:
                return json.loads(worker.replies.recv_bytes(MAX_REPLY_BYTES))
            except (EOFError, OSError):  # it died without a reply (or sent one too long to be a worker's)
                worker.process.wait()
                stderr = _stderr(folder)
                raise self._over(label, self._death(worker.process.returncode, stderr), stderr) from None
        finally:
            worker.kill()
            self._top_up()

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop(0)
                if worker.alive():
                    return worker
                worker.kill()
        return _Worker.start(warm=False)

    def _top_up(self) -> None:
        """Start spares until `spares` wait (a fork and exec each; their imports run in the children)."""
        with self._lock:
            while len(self._idle) < self.spares:
                self._idle.append(_Worker.start(warm=True))

    def close(self) -> None:
        """Stop the spares (a spare also exits by itself when its caller's end of the pipe closes)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _death(self, code: int | None, stderr: str) -> str:
        """Why a worker died without replying, in the user's terms."""
        if code == -signal.SIGXCPU:
            return f"it needed more than {self.limits.cpu_seconds} s of CPU"
        if code == -signal.SIGXFSZ:
            return f"it would write a file over {_size(self.limits.file_bytes)}"
        if "memory allocation" in stderr or "MemoryError" in stderr or "bad_alloc" in stderr:
            return self._memory()
        if code is not None and code < 0:
            return f"the reader crashed with {signal.Signals(-code).name}"
        return f"the reader ended without an answer (exit status {code})"

    def _memory(self) -> str:
        return f"it needed more than {_size(self.limits.memory_bytes)} of memory"

    def _over(self, label: str, reason: str, stderr: str = "") -> OverLimits:
        """The refusal of `label` for `reason`, logged with the worker's stderr (a native backtrace)."""
        logger.info("a worker failed on %s: %s (limits: %s)%s", label, reason, self.limits.describe(),
                       f"; its stderr ends:\n{stderr[-MAX_LOGGED_STDERR:]}" if stderr.strip() else "")
        return OverLimits(f"{label} could not be read within the {self.limits.owner} limits ({reason})")

    def _error(self, reply: dict[str, Any], label: str) -> Exception:
        """The exception a worker's failure reply stands for."""
        kind = reply.get("error")
        if kind == "input":
            return _INPUT_ERRORS.get(str(reply.get("type")), InputError)(str(reply.get("message", "")))
        if kind == "memory":
            return self._over(label, self._memory())
        if kind == "panic":
            return self._over(label, f"the reader gave up: {reply.get('type')}: {reply.get('message')}")
        return WorkerBug(f"a worker raised {reply.get('type')}:\n{reply.get('traceback', '')}")


def _stderr(folder: Path) -> str:
    """The end of a worker's stderr."""
    with contextlib.suppress(OSError), (folder / "stderr.txt").open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * MAX_LOGGED_STDERR))
        return f.read().decode("utf-8", errors="replace")
    return ""


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> WorkerPool:
    """This process's workers: `READER_LIMITS` and none started ahead, unless `configure`d."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = WorkerPool()
        return _POOL


def configure(limits: WorkerLimits, spares: int = 0) -> WorkerPool:
    """Use `limits` for every later task of this process, with `spares` workers started ahead (a server)."""
    global _POOL
    with _POOL_LOCK:
        old, _POOL = _POOL, WorkerPool(limits, spares)
    if old is not None:
        old.close()
    return _POOL


# ----------------------------------------------------------------------------------------------------------
# The library's readers, each run in a worker.


def _label(sources: Sequence[str | Path]) -> str:
    """How a refusal names its input: the path of one, the names of several (cut short)."""
    names = [str(p) for p in sources] if len(sources) == 1 else [Path(p).name for p in sources]
    label = ", ".join(names)
    return label if len(label) <= MAX_LABEL_CHARS else f"{label[:MAX_LABEL_CHARS]}… ({len(names)} files)"


def read_points(path: str | Path, sensor: Sensor | None = None) -> Scan:
    """`lidar.formats.read_points` in a worker: the same `Scan`, or the same `InputError`, or `OverLimits`."""
    with pool().run("read_points", {"path": str(path), "sensor": _sensor_out(sensor)}, _label([path])) as (data, out):
        return _scan_in(data, out)


def read_sequence(source: str | Path | Sequence[str | Path], *, sensor: Sensor | None = None,
                  poses: str | Path | None = None, register: bool | None = False,
                  topic: str | None = None) -> tuple[SweepSequence, Any]:
    """`lidar.sequence.read_sequence` in a worker, and in the same worker `lidar.registration.register_sweeps`
    when `register` is True, or None and the sweeps came without poses and are several.

    Returns the `SweepSequence` and the `Registration` (None when nothing was registered).
    """
    sources = [source] if isinstance(source, str | Path) else list(source)
    args = {"source": str(source) if isinstance(source, str | Path) else [str(p) for p in sources],
            "sensor": _sensor_out(sensor), "poses": None if poses is None else str(poses), "register": register,
            "topic": topic}
    with pool().run("read_sequence", args, _label(sources)) as (data, out):
        return _sequence_in(data["sequence"], out), _registration_in(data["registration"], out)


def register_sweeps(sweeps: Sequence[np.ndarray | Scan], *, names: Sequence[str] | None = None) -> Any:
    """`lidar.registration.register_sweeps` (its default configuration) in a worker; the sweeps' points
    cross as arrays."""
    inputs = [np.asarray(s.points if isinstance(s, Scan) else s) for s in sweeps]
    label = _label(list(names)) if names else f"{len(inputs)} sweeps"
    with pool().run("register", {"names": None if names is None else list(names)}, label, inputs) as (data, out):
        return _registration_in(data, out)


@dataclass
class WorkerRecording(Recording):
    """A `lidar.sequence.Recording` of sweep files whose sweeps are read in a worker, one task a sweep."""

    def sweep(self, index: int) -> Scan:
        return read_points(self.files[index], self.sensor)


@dataclass
class WorkerContainer(ContainerRecording):
    """A container's recording (a bag's topic, a pcap, a dataset log) as `lidar.recordings.open_container`
    gives it in process, with the same names, stamps, poses, kind and topic, but indexed in a worker and
    with its sweeps decoded in workers: one task a sweep when indexed, `SWEEPS_PER_TASK` a task through
    `sweeps`. Each task opens the container afresh, on its own topic."""

    def sweeps(self, indices: Iterable[int]) -> Iterator[Scan]:
        chosen = [self.position(i) for i in indices]
        for start in range(0, len(chosen), SWEEPS_PER_TASK):
            yield from _recording_sweeps(self.files[0], self.sensor, self.topic, chosen[start:start + SWEEPS_PER_TASK])


def _recording_args(source: str | Path, sensor: Sensor | None, topic: str | None) -> dict[str, Any]:
    return {"source": str(source), "sensor": _sensor_out(sensor), "topic": topic}


def _recording_sweeps(source: Path, sensor: Sensor | None, topic: str | None, indices: list[int]) -> list[Scan]:
    args = {**_recording_args(source, sensor, topic), "indices": indices}
    with pool().run("recording_sweeps", args, _label([source])) as (data, out):
        return [_scan_in(scan, out) for scan in data["scans"]]


def open_recording(source: str | Path, *, sensor: Sensor | None = None,
                   topic: str | None = None) -> WorkerRecording | WorkerContainer:
    """`lidar.sequence.open_recording` in a worker: a folder's poses and times files, or a container's index
    (its `topic` where it holds several), parsed there, and each sweep decoded in a worker when read."""
    with pool().run("open_recording", _recording_args(source, sensor, topic), _label([source])) as (data, out):
        files = [Path(f) for f in _names_in(data["files"], out)]
        poses, times, container = out.get(data["poses"]), out.get(data["times"]), data["container"]
        if container is None:
            return WorkerRecording(files, poses, times, sensor)
        labels, stamps, topic = _names_in(container["labels"], out), out.get(container["stamps_ns"]), container["topic"]
    rec = WorkerContainer(files, poses, times, sensor, labels=labels, stamps_ns=stamps, kind=str(container["kind"]),
                          topic=topic)
    rec.decode = lambda index: _recording_sweeps(files[0], sensor, topic, [index])[0]
    return rec


def one_sweep(source: Path, index: int = 0, *, topic: str | None = None,
              sensor: Sensor | None = None) -> tuple[Scan, str | None]:
    """One sweep, read in a bounded worker: `source` itself (a sweep file), or sweep `index` of the recording,
    folder or zip it names (a lab's sensor records pcaps and bags, not sweep files), with that sweep's name.
    The refusals name the flags a command line gives these as (`--sweep`, `--topic`)."""
    from lidar.recordings import is_container

    if not source.exists():
        raise InputError(f"{source}: no such file or folder; expected a sweep file, a recording, a folder or a zip "
                         "of sweeps")
    container = source.is_dir() or is_container(source)
    if topic is not None and not container:
        raise InputError(f"--topic {shown(topic)}: {source} is no recording; --topic picks a bag's stream")
    if source.suffix.lower() == ".zip" and not container:
        sweeps = read_sequence(source, sensor=sensor)[0]
        return _chosen(source, index, sweeps.scans, sweeps.names)
    if container:
        recording = open_recording(source, sensor=sensor, topic=topic)
        return _chosen(source, index, recording, recording.names)
    if index:
        raise InputError(f"--sweep {index}: {source} is one sweep file; --sweep picks a sweep of a recording, a "
                         "folder or a zip")
    return read_points(source, sensor), None


def _chosen(source: Path, index: int, sweeps: Sequence[Scan], names: list[str]) -> tuple[Scan, str]:
    """Sweep `index` of `sweeps` (read when indexed) and its name, or the refusal naming how many there are."""
    if not 0 <= index < len(sweeps):
        held = f"{len(sweeps)} sweep{'s' if len(sweeps) != 1 else ''}"
        raise InputError(f"--sweep {index}: {source} holds {held}; expected 0 to {len(sweeps) - 1}")
    return sweeps[index], names[index]


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
           warm="--warm" in sys.argv[3:])
