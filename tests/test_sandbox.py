"""lidar.sandbox: files read, and sweeps registered, in worker processes with bounded memory, CPU and time.

Real workers throughout (`python -m lidar.sandbox`, started by the pool): each test checks what the caller
sees (the same result as an in-process read, or one clear error naming the file) and what happened to the
worker (gone, replaced, its task folder removed). The slow input is a 4.5 M-point KITTI-style .bin, ~4 s
to read here, which each test stops after well under a second.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import psutil
import pytest

from lidar import sandbox
from lidar.cancel import Cancelled, stop_when
from lidar.formats import PointCloudError, read_points, write_points
from lidar.registration import RegistrationError, register_sweeps
from lidar.sequence import read_sequence
from tests.helpers import (
    KITTI_SCAN,
    laz_chunk_bomb,
    laz_corrupt_chunk_table,
    needs_real_scans,
    sweep_points,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED_KITTI = REPO / "examples" / "scans" / "kitti_patchworkpp_000000.bin"
OUSTER_PCAP = REPO.parent / "shared" / "data" / "recordings" / "ouster_os1_128_pcap" / "OS-1-128_v2.3.0_1024x10_lb_n3.pcap"
pytestmark = pytest.mark.multiprocess


@contextlib.contextmanager
def limits(**changes) -> Iterator[sandbox.WorkerPool]:
    """This process's workers under the reader's limits with `changes`, then as they were."""
    before = sandbox.pool()
    spares = changes.pop("spares", 0)
    try:
        yield sandbox.configure(replace(sandbox.READER_LIMITS, **changes), spares=spares)
    finally:
        sandbox.configure(before.limits, before.spares)


def workers() -> list[psutil.Process]:
    """This process's live workers."""
    return [p for p in psutil.Process().children() if "lidar.sandbox" in " ".join(p.cmdline()) and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def task_folders() -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob("lidarverse-worker-*"))


@pytest.fixture(autouse=True)
def own_task_folders(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's task folders go to a temp dir of its own: another test run on the machine makes its own in
    the system's, and `task_folders` sees only this test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tasks")))


@pytest.fixture(scope="module")
def slow_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4.5 M points 5-50 m around the sensor as a KITTI .bin (72 MB): seconds of reading."""
    rng = np.random.default_rng(0)
    n = 4_500_000
    az, r = rng.uniform(-np.pi, np.pi, n), rng.uniform(5, 50, n)
    points = np.stack([r * np.cos(az), r * np.sin(az), rng.uniform(-1.7, 2.0, n), rng.uniform(0, 1, n)], 1)
    path = tmp_path_factory.mktemp("slow") / "slow.bin"
    points.astype("<f4").tofile(path)
    return path


def _in_thread(call) -> tuple[threading.Thread, dict]:
    """Run `call` on a thread; the dict gets its "error" (or "result") and "seconds"."""
    outcome: dict = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            outcome["result"] = call()
        except BaseException as err:  # the test reads what the caller would have seen
            outcome["error"] = err
        outcome["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _started_worker(timeout: float = 10.0) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while not (found := workers()):
        assert time.monotonic() < deadline, "no worker started"
        time.sleep(0.01)
    return found[0]


def _gone(process: psutil.Process, timeout: float = 2.0) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        process.wait(timeout)
    return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE


def test_a_read_in_a_worker_is_the_read_in_process(tmp_path):
    ring = np.arange(2000) % 16
    las = write_points(tmp_path / "sweep.laz", sweep_points(0), ring=ring)
    for path in (SHIPPED_KITTI, las):
        here, there = read_points(path), sandbox.read_points(path)
        np.testing.assert_array_equal(there.points, here.points)
        assert (there.ring is None) == (here.ring is None)
        if here.ring is not None:
            np.testing.assert_array_equal(there.ring, here.ring)
        for field in fields(here):
            if field.name not in ("points", "ring"):
                assert getattr(there, field.name) == getattr(here, field.name), field.name
    assert task_folders() == [] and workers() == []


def test_a_file_the_reader_refuses_comes_back_as_the_same_error(tmp_path):
    garbage = tmp_path / "garbage.pcd"
    garbage.write_bytes(b"VERSION 0.7\nFIELDS a b\n" + bytes(100))
    with pytest.raises(PointCloudError) as here:
        read_points(garbage)
    with pytest.raises(PointCloudError) as there:
        sandbox.read_points(garbage)
    assert str(there.value) == str(here.value) and "garbage.pcd" in str(there.value)


@pytest.mark.parametrize("make", [laz_chunk_bomb, laz_corrupt_chunk_table])
def test_the_hostile_laz_files_end_in_one_error_naming_the_file(tmp_path, make):
    """0xFFFFFFFF chunks aborted the reading process (SIGABRT), one corrupt byte raised a Rust panic."""
    path = make(tmp_path / "hostile.laz")
    start = time.perf_counter()
    with pytest.raises(PointCloudError) as err:
        sandbox.read_points(path)
    assert "hostile.laz" in str(err.value) and len(str(err.value)) < 300
    assert time.perf_counter() - start < 5.0


def test_a_worker_that_dies_by_a_signal_is_one_clear_message_and_the_caller_carries_on(slow_bin):
    """What an abort in native code looks like from outside: the worker is gone, the caller gets a message
    naming the file, and the next read works."""
    with limits():  # the reader's, whatever an earlier import (the app's: the server's) configured
        thread, outcome = _in_thread(lambda: sandbox.read_points(slow_bin))
        worker = _started_worker()
        time.sleep(0.3)
        os.kill(worker.pid, signal.SIGABRT)
        thread.join(10)
    err = outcome["error"]
    assert isinstance(err, sandbox.OverLimits), err
    assert str(err) == f"{slow_bin} could not be read within the reader's limits (the reader crashed with SIGABRT)"
    assert _gone(worker) and task_folders() == []
    assert sandbox.read_points(SHIPPED_KITTI).num_points == 124_668


def test_a_read_past_the_memory_limit_names_the_limit(slow_bin):
    with limits(memory_bytes=32 * 2**20):
        with pytest.raises(sandbox.OverLimits, match=r"slow\.bin could not be read within the reader's limits "
                                                     r"\(it needed more than 32 MiB of memory\)"):
            sandbox.read_points(slow_bin)
        assert sandbox.read_points(SHIPPED_KITTI).num_points == 124_668  # 2 MB of points fit


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def test_a_read_past_the_cpu_limit_is_stopped_by_the_kernel(slow_bin):
    """The read needs ~4 s of CPU; the worker gets its imports' (rounded up to a second) and 1 s more."""
    with limits(cpu_seconds=1):
        before = _children_cpu()
        with pytest.raises(sandbox.OverLimits, match=r"it needed more than 1 s of CPU"):
            sandbox.read_points(slow_bin)
    assert _children_cpu() - before < 2.5


def test_a_read_past_the_deadline_is_killed(slow_bin):
    with limits(wall_seconds=0.8):
        thread, outcome = _in_thread(lambda: sandbox.read_points(slow_bin))
        worker = _started_worker()
        thread.join(10)
    assert isinstance(outcome["error"], sandbox.OverLimits) and "it took longer than 0.8 s" in str(outcome["error"])
    assert outcome["seconds"] < 1.5 and _gone(worker) and task_folders() == []


def test_a_cancelled_read_kills_its_worker_at_once(slow_bin):
    """The app cancels a request by setting its stop event (`lidar.cancel`): the waiting caller raises
    `Cancelled` within one poll and the worker, still reading, is killed with it."""
    stop = threading.Event()

    def read() -> None:
        with stop_when(stop):
            sandbox.read_points(slow_bin)

    thread, outcome = _in_thread(read)
    worker = _started_worker()
    time.sleep(0.5)
    stopped = time.perf_counter()
    stop.set()
    thread.join(10)
    assert isinstance(outcome["error"], Cancelled)
    assert time.perf_counter() - stopped < 0.5
    assert _gone(worker, timeout=0.5) and task_folders() == []


def test_a_bug_in_a_worker_is_a_bug_with_the_workers_traceback():
    with pytest.raises(sandbox.WorkerBug, match=r"KeyError: 'path'"), sandbox.pool().run("read_points", {}, "x"):
        pass


def test_spares_wait_started_and_each_serves_one_task():
    with limits(spares=1):
        spare = _started_worker()
        assert sandbox.read_points(SHIPPED_KITTI).num_points == 124_668
        assert _gone(spare), "a worker serves one task"
        assert [p.pid for p in workers()] != [spare.pid] and len(workers()) == 1, "a fresh spare waits"
    assert workers() == [] and task_folders() == []


def test_a_sequence_folder_with_poses_reads_as_in_process(tmp_path):
    for i in range(3):
        write_points(tmp_path / f"{i:06d}.bin", sweep_points(i))
    poses = np.tile(np.eye(4), (3, 1, 1))
    poses[:, 0, 3] = [0.0, 1.0, 2.0]
    (tmp_path / "poses.txt").write_text("".join(" ".join(map(str, p[:3].ravel())) + "\n" for p in poses))
    here = read_sequence(tmp_path)
    there, registration = sandbox.read_sequence(tmp_path, register=None)
    assert registration is None and there.names == here.names
    np.testing.assert_array_equal(there.poses, here.poses)
    for a, b in zip(there.scans, here.scans, strict=True):
        np.testing.assert_array_equal(a.points, b.points)


def test_a_recording_reads_its_sweeps_in_workers(tmp_path):
    for i in range(2):
        write_points(tmp_path / f"{i:06d}.bin", sweep_points(i))
    rec = sandbox.open_recording(tmp_path)
    assert rec.names == ["000000.bin", "000001.bin"] and rec.poses is None
    np.testing.assert_array_equal(rec[1].points, read_points(tmp_path / "000001.bin").points)
    assert isinstance(rec, sandbox.WorkerRecording) and task_folders() == []


@pytest.mark.skipif(not OUSTER_PCAP.is_file(), reason=f"shared Ouster capture not found at {OUSTER_PCAP}")
def test_a_containers_index_and_its_sweeps_are_read_within_the_limits():
    pattern = rf"{OUSTER_PCAP.name} could not be read within the reader's limits \(it needed more than 8 MiB of memory\)"
    with limits(memory_bytes=8 * 2**20), pytest.raises(sandbox.OverLimits, match=pattern):
        sandbox.open_recording(OUSTER_PCAP)
    rec = sandbox.open_recording(OUSTER_PCAP)
    assert isinstance(rec, sandbox.WorkerContainer) and len(rec) == 3
    with limits(memory_bytes=8 * 2**20), pytest.raises(sandbox.OverLimits, match=pattern):
        rec[0]
    assert rec[0].num_points > 0 and workers() == [] and task_folders() == []


@needs_real_scans
def test_a_zip_of_sweeps_is_read_and_registered_in_one_worker_as_in_process(tmp_path):
    sweeps = [KITTI_SCAN.with_name(f"kitti_patchworkpp_{i:06d}.bin") for i in (0, 2, 4)]
    archive = tmp_path / "drive.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sweeps:
            zf.write(path, path.name)
    seq, registration = sandbox.read_sequence(archive, register=None)
    expected = register_sweeps([read_points(p) for p in sweeps], names=[p.name for p in sweeps])
    np.testing.assert_allclose(registration.poses, expected.poses, atol=1e-9)
    np.testing.assert_allclose(sandbox.register_sweeps(seq.scans, names=seq.names).poses, expected.poses, atol=1e-9)
    assert seq.names == [p.name for p in sweeps] and task_folders() == []


def test_registration_refuses_clouds_of_random_points_before_icp():
    """Two sweeps of 150 k random points kept KISS-ICP busy for 25 s here; now refused from their keypoints."""
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    with pytest.raises(RegistrationError, match=r"sweep 0 \(a\.bin\) has [\d,]+ registration points after 1\.5 m voxels"):
        register_sweeps([rng.uniform(-50, 50, (150_000, 3)) for _ in range(2)], names=["a.bin", "b.bin"])
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "lidar", "info", "{file}"],
    [sys.executable, "-m", "inference", "forecast", "--prefix", "{file}", "--out", "{out}"],
    pytest.param([sys.executable, "-m", "inference", "resimulate", "--scan", "{file}", "{file}", "--out", "{out}"],
                 marks=pytest.mark.slow),  # the same path as forecast; each inference CLI imports torch (~5 s)
])
def test_the_command_lines_end_a_hostile_laz_with_one_error_line(tmp_path, command):
    path = laz_chunk_bomb(tmp_path / "hostile.laz")
    argv = [part.format(file=path, out=tmp_path / "out") for part in command]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "error:" in lines[0] and "hostile.laz" in lines[0] and len(lines[0]) < 400
