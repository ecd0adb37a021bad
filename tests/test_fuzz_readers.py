"""Seeded fuzzing of every reader and container: each mutated file ends in a `Scan` or an `InputError`.

A valid small file of each format is mutated (bytes flipped, the file cut short, a run inserted or
deleted, a header field set to an extreme value) a few hundred times, deterministically from a seed, and
each case is read in a guarded subprocess: its address space and CPU are bounded as the server's read
workers bound theirs (`lidar.sandbox.SERVER_LIMITS`), and the parent kills it past a per-case deadline.
So a native abort, a Rust panic, a `MemoryError` or a hang is a failure of the test naming the case, never
of pytest. Many cases share one subprocess (an interpreter that imports the readers takes ~0.4 s); when
one kills it, the next case starts a fresh one.

The default run takes a few hundred cases per format (`FUZZ_CASES`); `-m slow` runs `SLOW_FUZZ_CASES`.
"""

from __future__ import annotations

import io
import json
import os
import random
import select
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import laspy
import lzf
import numpy as np
import pytest

from lidar.errors import MAX_MESSAGE_CHARS, InputError
from lidar.formats import write_points
from tests.helpers import sweep_points

REPO = Path(__file__).resolve().parents[1]
#: Cases per format in the default run, and in the `-m slow` run.
FUZZ_CASES = 150
SLOW_FUZZ_CASES = 2000
#: Points of each seed file: enough for every reader's checks (the sensor-frame test wants 100 far returns).
SEED_POINTS = 400
#: Address space a reading subprocess may map beyond its imports (the server's read workers get 2 GiB).
MEMORY_BYTES = 2 * 2**30
#: Longest one case may take before its subprocess is killed and the case counted as a hang.
CASE_DEADLINE_S = 10.0

#: The guarded reader: limits itself once its imports are loaded, then reads one path per stdin line and
#: answers one JSON line per path, flushed before the next is read, so a death names its case.
_CHILD = r"""
import json, resource, sys, time, traceback
import numpy as np
from lidar.errors import InputError
from lidar.formats import read_points
from lidar.sequence import read_sequence

mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + int(sys.argv[1]),) * 2)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
print("ready", flush=True)
for line in sys.stdin:
    path = line.rstrip("\n")
    start = time.perf_counter()
    try:
        out = read_sequence(path) if path.endswith(".zip") else read_points(path)
        scans = out.scans if hasattr(out, "scans") else [out]
        for scan in scans:
            pts = scan.points
            assert pts.dtype == np.float32 and pts.ndim == 2 and pts.shape[1] == 4 and len(pts), pts.shape
            assert np.isfinite(pts).all() and pts[:, 3].min() >= 0 and pts[:, 3].max() <= 1
        reply = {"outcome": "scan"}
    except InputError as err:
        reply = {"outcome": "input-error", "chars": len(str(err)), "message": str(err)[:300]}
    except BaseException as err:  # a panic, a MemoryError, a bug: each is a finding
        reply = {"outcome": type(err).__name__, "message": traceback.format_exc()[-1500:]}
    reply["seconds"] = time.perf_counter() - start
    print(json.dumps(reply), flush=True)
"""


class _Reader:
    """One guarded subprocess reading cases until it dies or is closed."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(MEMORY_BYTES)], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self._line(60.0) == "ready", "the fuzz reader did not start"

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        return self.proc.stdout.readline().strip()

    def read(self, path: Path) -> dict:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        line = self._line(CASE_DEADLINE_S)
        if line is None:
            self.close()
            return {"outcome": "hang", "seconds": CASE_DEADLINE_S}
        if not line:
            code = self.proc.wait()
            return {"outcome": f"died (exit status {code})", "seconds": 0.0}
        return json.loads(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()


# ----------------------------------------------------------------------------------------------------------
# Seed files: one valid small file per format and container, and the byte ranges worth mutating


@dataclass(frozen=True)
class Seed:
    name: str
    data: bytes
    #: (start, end) byte ranges holding headers, tables and sizes: most mutations land there.
    hot: tuple[tuple[int, int], ...]
    #: Where a text header (PCD, PLY, .npy) ends, or 0: a header edit then replaces one of its words.
    text_header: int = 0


def _points() -> tuple[np.ndarray, np.ndarray]:
    points = sweep_points(3)[:SEED_POINTS].astype(np.float32)
    return points, np.arange(SEED_POINTS, dtype=np.int64) % 32


def _written(folder: Path, name: str, fmt: str | None = None, ring: bool = True) -> bytes:
    points, rings = _points()
    return write_points(folder / name, points, fmt=fmt, ring=rings if ring else None).read_bytes()


def _text_header_end(data: bytes, marker: bytes) -> int:
    return data.index(marker) + len(marker)


def _pcd_compressed() -> bytes:
    points, rings = _points()
    columns = [points[:, k].astype("<f4").tobytes() for k in range(4)] + [rings.astype("<u2").tobytes()]
    raw = b"".join(columns)
    packed = lzf.compress(raw)
    header = ("VERSION 0.7\nFIELDS x y z intensity ring\nSIZE 4 4 4 4 2\nTYPE F F F F U\nCOUNT 1 1 1 1 1\n"
              f"WIDTH {SEED_POINTS}\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\nPOINTS {SEED_POINTS}\nDATA binary_compressed\n")
    return header.encode() + struct.pack("<II", len(packed), len(raw)) + packed


def _laz_layered(folder: Path) -> bytes:
    """Point format 6 (LAS 1.4, layered chunks) with a ring extra byte, in chunks of 100 points."""
    points, rings = _points()
    header = laspy.LasHeader(point_format=6, version="1.4")
    header.add_extra_dim(laspy.ExtraBytesParams(name="ring", type=np.uint8))
    header.scales, header.offsets = np.full(3, 1e-3), np.zeros(3)
    las = laspy.LasData(header)
    las.x, las.y, las.z = (points[:, k].astype(np.float64) for k in range(3))
    las.intensity = (points[:, 3] * 65535).astype(np.uint16)
    las.ring = rings.astype(np.uint8)
    path = folder / "layered.laz"
    las.write(path)
    return path.read_bytes()


def _las_hot(data: bytes) -> tuple[tuple[int, int], ...]:
    """The public header and VLRs, the chunk-table offset, the first chunk's start and the chunk table."""
    point_offset = struct.unpack_from("<I", data, 96)[0]
    hot = [(0, point_offset + 8), (point_offset + 8, min(point_offset + 200, len(data)))]
    table = struct.unpack_from("<q", data, point_offset)[0]
    if point_offset + 8 < table < len(data):
        hot.append((table, len(data)))
    return tuple(hot)


def _zip(folder: Path, method: int) -> bytes:
    points, _ = _points()
    path = folder / f"seq{method}.zip"
    poses = [np.eye(4).tolist(), np.eye(4).tolist()]
    with zipfile.ZipFile(path, "w", method) as zf:
        zf.writestr("000000.bin", points.tobytes())
        zf.writestr("000001.bin", (points * np.float32(1.01)).tobytes())
        zf.writestr("poses.json", json.dumps(poses))
    return path.read_bytes()


def _lzma_npz(folder: Path) -> bytes:
    """The arrays of `write_npz`, as LZMA members (NumPy writes deflate; zipfile and np.load read either)."""
    with np.load(io.BytesIO(_written(folder, "deflated.npz"))) as arrays:
        members = {name: arrays[name] for name in arrays.files}
    path = folder / "lzma.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_LZMA) as zf:
        for name, array in members.items():
            with zf.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, array)
    return path.read_bytes()


def _zip_hot(data: bytes) -> tuple[tuple[int, int], ...]:
    """The first local header and the central directory with its end record."""
    return ((0, 80), (data.find(b"PK\x01\x02"), len(data)))


def make_seeds(folder: Path) -> dict[str, Seed]:
    """Every format and container the readers take, as small valid files."""
    points, _ = _points()
    seeds: dict[str, Seed] = {}
    kitti = points.astype("<f4").tobytes()
    seeds["kitti.bin"] = Seed("kitti.bin", kitti, ((0, 64), (len(kitti) - 64, len(kitti))))
    nus = _written(folder, "nus.pcd.bin")
    seeds["nuscenes.pcd.bin"] = Seed("nuscenes.pcd.bin", nus, ((0, 80),))
    for name, fmt in (("ascii.pcd", "pcd-ascii"), ("binary.pcd", "pcd")):
        data = _written(folder, name, fmt)
        end = _text_header_end(data, b"DATA ")
        seeds[name] = Seed(name, data, ((0, end + 20),), text_header=data.index(b"\n", end) + 1)
    data = _pcd_compressed()
    end = data.index(b"\n", _text_header_end(data, b"DATA ")) + 1
    seeds["compressed.pcd"] = Seed("compressed.pcd", data, ((0, end + 16),), text_header=end)
    for name, fmt in (("ascii.ply", "ply-ascii"), ("binary.ply", "ply")):
        data = _written(folder, name, fmt)
        end = _text_header_end(data, b"end_header\n")
        seeds[name] = Seed(name, data, ((0, end + 16),), text_header=end)
    for name in ("scan.las", "scan.laz"):
        data = _written(folder, name)
        seeds[name] = Seed(name, data, _las_hot(data))
    data = _laz_layered(folder)
    seeds["layered.laz"] = Seed("layered.laz", data, _las_hot(data))
    data = _written(folder, "scan.npy")
    seeds["scan.npy"] = Seed("scan.npy", data, ((0, 128),), text_header=128)
    data = _written(folder, "scan.npz")
    seeds["scan.npz"] = Seed("scan.npz", data, _zip_hot(data))
    data = _lzma_npz(folder)
    seeds["lzma.npz"] = Seed("lzma.npz", data, _zip_hot(data))
    for name, method in (("deflated.zip", zipfile.ZIP_DEFLATED), ("stored.zip", zipfile.ZIP_STORED),
                         ("bzip2.zip", zipfile.ZIP_BZIP2), ("lzma.zip", zipfile.ZIP_LZMA)):
        data = _zip(folder, method)
        seeds[name] = Seed(name, data, _zip_hot(data))
    return seeds


# ----------------------------------------------------------------------------------------------------------
# Mutations

#: Integers that break size arithmetic: zero, one, sign and width boundaries.
_EXTREME_INTS = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
                 2**32, 2**63 - 1, 2**64 - 1)
#: Words that break a text header's numbers and names.
_EXTREME_WORDS = (b"0", b"-1", b"1", b"3", b"64", b"65536", b"2147483647", b"4294967296", b"9223372036854775808",
                  b"1" * 40, b"1e309", b"nan", b"x", b"F", b"U", b"list", b"binary_compressed", b"\xff\xfe")


def _position(rng: random.Random, seed: Seed, size: int) -> int:
    if rng.random() < 0.75:
        start, end = rng.choice(seed.hot)
        end = min(end, size)
        if start < end:
            return rng.randrange(start, end)
    return rng.randrange(size)


def _flip(rng: random.Random, seed: Seed, data: bytearray) -> bytearray:
    for _ in range(rng.randint(1, 4)):
        data[_position(rng, seed, len(data))] ^= rng.randint(1, 255)
    return data


def _truncate(rng: random.Random, seed: Seed, data: bytearray) -> bytearray:
    return data[: rng.randrange(len(data))]


def _splice(rng: random.Random, seed: Seed, data: bytearray) -> bytearray:
    at = _position(rng, seed, len(data))
    if rng.random() < 0.5:
        return data[:at] + data[at + rng.randint(1, 64):]
    return data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) + data[at:]


def _edit_field(rng: random.Random, seed: Seed, data: bytearray) -> bytearray:
    """A header word replaced by an extreme word (text headers), or an integer written over one (binary)."""
    if seed.text_header and rng.random() < 0.8:
        header, body = bytes(data[: seed.text_header]), data[seed.text_header:]
        words = header.split(b" ")
        if rng.random() < 0.15:  # a line repeated many times: a header of thousands of fields or elements
            lines = header.split(b"\n")
            k = rng.randrange(len(lines))
            lines[k:k] = [lines[k]] * rng.choice((2, 100, 5000))
            return bytearray(b"\n".join(lines)) + body
        k = rng.randrange(len(words))
        tail = b"\n" if words[k].endswith(b"\n") else b""
        words[k] = rng.choice(_EXTREME_WORDS) + tail
        return bytearray(b" ".join(words)) + body
    width = rng.choice((1, 2, 4, 8))
    at = min(_position(rng, seed, len(data)), max(len(data) - width, 0))
    value = rng.choice(_EXTREME_INTS) & ((1 << (8 * width)) - 1)
    data[at : at + width] = value.to_bytes(width, "little")[: len(data) - at]
    return data


_MUTATIONS: tuple[Callable[[random.Random, Seed, bytearray], bytearray], ...] = (
    _flip, _flip, _truncate, _splice, _edit_field, _edit_field, _edit_field)


def mutate(seed: Seed, case: int) -> bytes:
    """Case `case` of `seed`: one to three mutations, the same bytes on every run."""
    rng = random.Random(f"{seed.name}:{case}")
    data = bytearray(seed.data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        if not data:
            break
        data = rng.choice(_MUTATIONS)(rng, seed, data)
    return bytes(data)


# ----------------------------------------------------------------------------------------------------------
# The runs


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Seed]:
    return make_seeds(tmp_path_factory.mktemp("seeds"))


def fuzz(seed: Seed, cases: int, folder: Path) -> tuple[list[str], dict[str, int], float]:
    """Read `cases` mutations of `seed`; returns (findings, outcome counts, slowest case in seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    findings: list[str] = []
    counts: dict[str, int] = {}
    slowest = 0.0
    reader = _Reader()
    try:
        for case in range(cases):
            path = folder / f"{case:05d}_{seed.name}"
            path.write_bytes(mutate(seed, case))
            if not reader.alive:
                reader = _Reader()
            reply = reader.read(path)
            outcome = reply["outcome"]
            counts[outcome] = counts.get(outcome, 0) + 1
            slowest = max(slowest, reply["seconds"])
            if outcome not in ("scan", "input-error"):
                findings.append(f"case {case} ({path}): {outcome}: {reply.get('message', '')}")
            elif reply.get("chars", 0) > MAX_MESSAGE_CHARS:
                findings.append(f"case {case} ({path}): a {reply['chars']:,}-character message")
            else:
                path.unlink()
    finally:
        reader.close()
    return findings, counts, slowest


_KINDS = ("kitti.bin", "nuscenes.pcd.bin", "ascii.pcd", "binary.pcd", "compressed.pcd", "ascii.ply", "binary.ply",
          "scan.las", "scan.laz", "layered.laz", "scan.npy", "scan.npz", "lzma.npz", "deflated.zip", "stored.zip", "bzip2.zip",
          "lzma.zip")


def test_every_seed_file_reads(seeds: dict[str, Seed], tmp_path: Path) -> None:
    """The unmutated seeds are valid, so what the fuzz runs refuse is the mutation's doing."""
    assert sorted(seeds) == sorted(_KINDS)
    for seed in seeds.values():
        (tmp_path / seed.name).write_bytes(seed.data)
    reader = _Reader()
    try:
        replies = {name: reader.read(tmp_path / name) for name in _KINDS}
    finally:
        reader.close()
    assert all(r["outcome"] == "scan" for r in replies.values()), replies


def _check(seed: Seed, cases: int, folder: Path) -> None:
    started = time.perf_counter()
    findings, counts, slowest = fuzz(seed, cases, folder)
    print(f"\n{seed.name}: {cases} cases in {time.perf_counter() - started:.1f} s, slowest {slowest * 1e3:.0f} ms: {counts}")
    assert not findings, f"{len(findings)} of {cases} cases neither read nor refused:\n" + "\n".join(findings[:10])


@pytest.mark.parametrize("kind", _KINDS)
def test_mutated_files_end_in_a_scan_or_an_input_error(seeds: dict[str, Seed], tmp_path: Path, kind: str) -> None:
    _check(seeds[kind], FUZZ_CASES, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", _KINDS)
def test_thousands_of_mutated_files_end_in_a_scan_or_an_input_error(seeds: dict[str, Seed], tmp_path: Path,
                                                                    kind: str) -> None:
    _check(seeds[kind], SLOW_FUZZ_CASES, tmp_path)


#: Cases that killed the reading process (SIGABRT: lazrs asked for 4-64 GiB for a chunk table or a layer)
#: or raised a Rust panic, before the LAZ bounds; each must now be the reader's own refusal.
_FORMER_CRASHES = {"scan.laz": (2, 16, 24, 49), "layered.laz": (0, 1, 21, 97)}


@pytest.fixture
def server_workers():
    """`lidar.sandbox`'s pool under the server's limits for one test, then back to the reader's."""
    sandbox = pytest.importorskip("lidar.sandbox")
    yield sandbox, sandbox.configure(sandbox.SERVER_LIMITS)
    sandbox.configure(sandbox.READER_LIMITS)


def test_former_crashes_are_refused_by_the_reader_inside_the_server_worker(seeds, tmp_path, server_workers):
    """Through the worker an abort would come back as `OverLimits` ("could not be read within the server's
    limits"); the bounds make each of these the reader's own `InputError`, with the worker alive to say so."""
    sandbox, _ = server_workers
    for kind, cases in _FORMER_CRASHES.items():
        for case in cases:
            path = tmp_path / f"{case:05d}_{kind}"
            path.write_bytes(mutate(seeds[kind], case))
            with pytest.raises(InputError) as err:
                sandbox.read_points(path)
            assert not isinstance(err.value, sandbox.OverLimits), f"{path}: {err.value}"
