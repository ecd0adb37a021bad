"""What several test modules share, in one place: tiny models and releases, a Hub cache laid out by hand,
a tiny training config, real-scan paths and the app's public surface, crafted hostile files, simulated
sweeps, a one-car world, a brute-force box ray cast and the multi-process checkpointing assertions.

Test modules import from here and never from one another, so a test module can change without breaking
another one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import laspy
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from checkpointing import resolve_generation
from inference.loader import CONFIG_NAME, WEIGHTS_NAME
from inference.network import WorldModel, WorldModelConfig
from lidar.real_scans import real_scans_dir
from lidar.sensors import HDL32, VLP16, Sensor
from lidar.sim.actors import Actor
from lidar.sim.hdmap import HDMap
from lidar.sim.primitives import Shapes
from lidar.sim.roads import RoadGraph
from lidar.sim.world import World
from lidar.vocabulary import MAP_CLASS_INDEX

# ----------------------------------------------------------------------------------------------------------
# Tiny models and releases (loader, pipeline, CLI, measured, observed, evaluation tests)

TINY_SENSOR = Sensor.from_angles(
    "tiny8", np.linspace(10.0, -20.0, 8), width=64, max_range=60.0, mount_height=1.8
)


def tiny_config(**overrides) -> WorldModelConfig:
    """A network of a few thousand parameters on an 8x64 sensor: loads and samples in milliseconds."""
    fields = dict(
        sensor=TINY_SENSOR.to_dict(), base_channels=8, channel_mults=(1, 1, 2, 2), bottleneck_attention=False
    )
    return WorldModelConfig(**{**fields, **overrides})


def tiny_model(seed: int = 0, **overrides) -> WorldModel:
    torch.manual_seed(seed)
    model = WorldModel(tiny_config(**overrides))
    with torch.no_grad():  # zero-initialised output convs would make every seed look alike
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def write_release(folder: Path, model: WorldModel, iteration: int = 123, prefix: str = "") -> Path:
    """A release as docs/design.md lays it out: config.json + model.safetensors (EMA, metadata) + README.md."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2))
    state = {prefix + k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"iteration": str(iteration), "source": "test"})
    (folder / "README.md").write_text("# tiny test model\n")
    return folder


def write_hub_cache(
    cache: Path,
    repo: str,
    release: Path,
    refs: tuple[str, ...] = ("main",),
    files: tuple[str, ...] = (CONFIG_NAME, WEIGHTS_NAME, "README.md"),
) -> str:
    """Lay `release` out as huggingface_hub's cache does after a download; returns the commit hash."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}:{sorted(files)}".encode()).hexdigest()
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for name in files:
        data = (release / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / blob).write_bytes(data)
        os.symlink(Path("..") / ".." / "blobs" / blob, snapshot / name)
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return commit


def tiny_vlp16_model() -> WorldModel:
    """An untrained network on a 16 x 32 VLP-16 (no perturbation: zero-initialised heads, as a fresh job starts)."""
    config = WorldModelConfig(
        sensor=VLP16.with_width(32).to_dict(), base_channels=8, channel_mults=(1, 2), strides=((1, 2),),
        bottleneck_attention=False,
    )
    torch.manual_seed(0)
    return WorldModel(config)


# ----------------------------------------------------------------------------------------------------------
# Training (2-rank jobs and fine-tuning on recordings)

TRAIN_SENSOR = HDL32.with_width(64)
TRAIN_MAX_ITERS = 30


def tiny_train_config(data_root: Path, **overrides) -> dict:
    model = WorldModelConfig(
        sensor=TRAIN_SENSOR.to_dict(), base_channels=8, channel_mults=(1, 2), strides=((1, 2),), norm_groups=4,
        bottleneck_attention=False, keep_gate=False, gap_fill=False,  # a v6-style source: no gate, no gap fill
    ).to_dict()
    cfg = {"model": model, "data_root": str(data_root), "batch_size": 2, "warmup_iters": 5, "max_iters": TRAIN_MAX_ITERS,
           "save_iter": 5, "keep_last_checkpoints": 2, "log_iter": 1, "num_workers": 0, "torch_threads": 1,
           "ema_start_iter": 3, "cache_frames": 2}
    return {**cfg, **overrides}


# ----------------------------------------------------------------------------------------------------------
# The app: real scans, its public endpoints, a tiny release

REAL_SCANS = real_scans_dir()
KITTI_SCAN = REAL_SCANS / "kitti_patchworkpp_000000.bin"
needs_real_scans = pytest.mark.skipif(not KITTI_SCAN.is_file(), reason=f"shared real scans not found at {REAL_SCANS}")

#: The endpoints a visitor may call, and nothing else: exposing another one is a decision made here.
#: With --allow-model-switch, "/reload_model" joins them.
PUBLIC_ENDPOINTS = frozenset({"/generate_world", "/forecast_from_scan", "/forecast_from_scans", "/resimulate", "/upsample",
                              "/model_info"})
#: What the app ships in examples/scans; a fresh clone offers these as forecast examples.
SHIPPED_EXAMPLES = ("kitti_patchworkpp_000000.bin", "nuscenes_ff9eff4389a740848f9a56ad749a4ae8_keyframe.pcd",
                    "ouster_oustersdk_OS-1-128_v2.3.0_1024x10_lb_n3.bin")
#: The recordings the app ships there (a VLP-16 capture), which the Upsample tab offers before the scans.
SHIPPED_RECORDINGS = ("velodyne_vlp16.pcap",)
#: Sources a visitor might try in order to look around the server or make it download.
PROBING_SOURCES = ("/root", "/etc", "../", "lidarverse/lidarverse-default")

APP_SENSOR = Sensor.from_angles("tiny16", np.linspace(10.0, -25.0, 16), width=128, max_range=80.0, mount_height=1.8)


def write_tiny_release(folder: Path, seed: int = 0) -> Path:
    """A release folder holding a randomly initialised network of a few thousand parameters on a 16x128
    sensor: it loads and rolls out in well under a second, so the app's tests exercise the real pipeline
    without depending on the trained weights."""
    return write_release(folder, tiny_model(seed, sensor=APP_SENSOR.to_dict()), iteration=7)


@contextmanager
def app_serving(release: Path) -> Iterator[object]:
    """The app (`app.load_model`) serving `release` on one torch thread, its earlier model and threads back
    afterwards: on a busy 2-core box a tiny model's convolutions run ~10x slower with a thread pool."""
    import app  # the Space's module: only its tests need it

    previous, threads = app.PIPELINE, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield app.load_model(str(release))
    finally:
        app.PIPELINE = previous
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------
# Hostile files: decompression bombs (one per format) and crafted zips

def npz_bomb(path: Path) -> Path:
    """1 MB of zip holding a (16 Mi, 4) float32 'points' member: 256 MiB once inflated (a real, valid zip)."""
    rows, chunk = 16 * 2**20, bytes(2**20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf, \
            zf.open("points.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, 4)})
        for _ in range(rows * 16 // len(chunk)):
            f.write(chunk)
    return path


def pcd_bomb(path: Path) -> Path:
    """A binary_compressed PCD declaring 1,000 points (16,000 bytes) whose 3 MB LZF stream inflates to 264 MB:
    one literal zero, then a million 264-byte back-references to it."""
    header = ("VERSION 0.7\nFIELDS x y z intensity\nSIZE 4 4 4 4\nTYPE F F F F\nCOUNT 1 1 1 1\n"
              "WIDTH 1000\nHEIGHT 1\nPOINTS 1000\nDATA binary_compressed\n")
    stream = b"\x00\x00" + b"\xe0\xff\x00" * 1_000_000
    path.write_bytes(header.encode() + struct.pack("<II", len(stream), 1000 * 16) + stream)
    return path


def laz_bomb(path: Path) -> Path:
    """A real 1,000-point LAZ (point format 10, 67-byte records) whose header promises 4 million points:
    laspy would size a 268 MB point buffer from that count before decompressing."""
    las = laspy.LasData(laspy.LasHeader(point_format=10, version="1.4"))
    las.x, las.y, las.z = np.arange(1000.0), np.zeros(1000), np.zeros(1000)
    las.write(path)
    blob = bytearray(path.read_bytes())
    struct.pack_into("<Q", blob, 247, 4_000_000)  # LAS 1.4 64-bit point count
    path.write_bytes(bytes(blob))
    return path


def laz_corrupt_chunk_table(path: Path) -> Path:
    """A real 5,000-point LAZ with the first byte of its compressed chunk table flipped: lazrs raises a Rust
    panic ("capacity overflow"), a `BaseException` that `except Exception` misses."""
    las = laspy.LasData(laspy.LasHeader(point_format=0, version="1.4"))
    rng = np.random.default_rng(0)
    las.x, las.y, las.z = rng.uniform(-30, 30, 5000), rng.uniform(-30, 30, 5000), rng.uniform(-2, 2, 5000)
    las.write(path)
    blob = bytearray(path.read_bytes())
    table = struct.unpack_from("<q", blob, struct.unpack_from("<I", blob, 96)[0])[0]  # LAZ's chunk-table offset
    blob[table + 8] ^= 0xFF  # after the table's version and chunk count
    path.write_bytes(bytes(blob))
    return path


def ply_bomb(path: Path) -> Path:
    """An ASCII PLY announcing 4 million vertices (under the point limit) followed by 20 MB of one-value lines:
    splitting every line of the body first costs ~25x its size in Python strings."""
    header = b"ply\nformat ascii 1.0\nelement vertex 4000000\nproperty float x\nproperty float y\nproperty float z\nend_header\n"
    path.write_bytes(header + b"12\n" * 6_600_000)
    return path


BOMBS: dict[str, Callable[[Path], Path]] = {"npz": npz_bomb, "pcd": pcd_bomb, "laz": laz_bomb, "ply": ply_bomb}


def laz_chunk_bomb(path: Path) -> Path:
    """A real 50,000-point LAZ whose chunk table claims 0xFFFFFFFF chunks: lazrs reserves 16 bytes for each
    (64 GiB) before reading one, and aborts its process when that fails."""
    las = laspy.LasData(laspy.LasHeader(point_format=0, version="1.2"))
    las.x, las.y, las.z = np.linspace(-20.0, 20.0, 50_000), np.ones(50_000), np.zeros(50_000)
    las.write(path)
    blob = bytearray(path.read_bytes())
    point_offset = struct.unpack_from("<I", blob, 96)[0]
    table = struct.unpack_from("<q", blob, point_offset)[0]
    struct.pack_into("<I", blob, table + 4, 0xFFFFFFFF)
    path.write_bytes(bytes(blob))
    return path


def laz_extra_dims(path: Path, points: int = 300_000, dims: int = 180) -> Path:
    """A LAZ of `points` records with `dims` scaled uint8 extra-byte dimensions, all zero (compressing to a
    few hundred KB): scaling every dimension costs 8 bytes a point each."""
    header = laspy.LasHeader(point_format=6, version="1.4")
    for k in range(dims):
        header.add_extra_dim(laspy.ExtraBytesParams(name=f"e{k}", type=np.uint8, scales=np.array([0.5]),
                                                    offsets=np.array([0.0])))
    las = laspy.LasData(header)
    las.x, las.y, las.z = np.linspace(-20.0, 20.0, points), np.ones(points), np.zeros(points)
    las.write(path)
    return path


def subarray_npz(path: Path, rows: int = 100_000) -> Path:
    """A structured 'points' array whose x, y, z are uint8 sub-arrays of 64: 64 values of x a row, so
    `rows` rows are 64 x `rows` points once flattened (6.4 M by default, over the 5 M limit)."""
    dtype = np.dtype([("x", "u1", (64,)), ("y", "u1", (64,)), ("z", "u1", (64,))])
    np.savez_compressed(path, points=np.zeros(rows, dtype=dtype))
    return path


def subarray_pcd(path: Path, rows: int = 100_000) -> Path:
    """A binary_compressed PCD whose x, y, z fields are COUNT 64 uint8: 6.4 M points' worth of x in ~80 KB."""
    import lzf  # the PCD reader's own LZF codec

    raw = bytes(rows * 192)
    packed = lzf.compress(raw)
    header = (f"VERSION 0.7\nFIELDS x y z\nSIZE 1 1 1\nTYPE U U U\nCOUNT 64 64 64\nWIDTH {rows}\nHEIGHT 1\n"
              f"POINTS {rows}\nDATA binary_compressed\n")
    path.write_bytes(header.encode() + struct.pack("<II", len(packed), len(raw)) + packed)
    return path


def ply_many_properties(path: Path, properties: int = 200_000) -> Path:
    """A binary PLY of one vertex whose element lists `properties` uchar properties after x, y, z."""
    props = "".join(f"property uchar p{k}\n" for k in range(properties))
    header = ("ply\nformat binary_little_endian 1.0\nelement vertex 1\nproperty float x\nproperty float y\n"
              f"property float z\n{props}end_header\n")
    path.write_bytes(header.encode() + bytes(12 + properties))
    return path


def pcd_many_fields(path: Path, fields: int = 200_000) -> Path:
    """A PCD header listing `fields` float fields, none of them x, y or z."""
    names = " ".join(f"f{k}" for k in range(fields))
    header = (f"VERSION 0.7\nFIELDS {names}\nSIZE {' '.join(['4'] * fields)}\nTYPE {' '.join(['F'] * fields)}\n"
              f"COUNT {' '.join(['1'] * fields)}\nWIDTH 1\nHEIGHT 1\nPOINTS 1\nDATA binary\n")
    path.write_bytes(header.encode() + bytes(4 * fields))
    return path


#: Files whose headers promise allocations far past what they hold, each refused from its header.
HOSTILE: dict[str, Callable[[Path], Path]] = {
    "chunks.laz": laz_chunk_bomb, "extra.laz": laz_extra_dims, "subarray.npz": subarray_npz,
    "subarray.pcd": subarray_pcd, "properties.ply": ply_many_properties, "fields.pcd": pcd_many_fields,
}


#: One-file recordings as a hostile visitor uploads them (name, bytes, what the refusal says): a bag whose
#: header length is 1 MiB, an MCAP whose first record claims more than the file holds, a pcap of DNS datagrams.
HOSTILE_RECORDINGS: tuple[tuple[str, bytes, str], ...] = (
    ("bomb.bag", b"#ROSBAG V2.0\n" + struct.pack("<I", 1 << 20), r"bomb.bag"),
    ("noise.mcap", b"\x89MCAP0\r\n" + b"\xff" * 64, r"noise.mcap: a record claims"),
    ("dns.pcap", struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1) + struct.pack("<IIII", 1, 0, 20, 20)
     + bytes(20), r"dns.pcap: no Velodyne data packets"),
)


def broken_zip(path: Path, kind: str) -> Path:
    """A one-sweep sequence zip broken as visitors break them: `long-name` (a 300-character member name),
    `not-utf8` (a name flagged UTF-8 that is not), `lzma-properties` (an LZMA member with bad properties),
    `bzip2-stream` (a bzip2 member whose stream is corrupt), `lzma-dictionary` (an LZMA member asking for a
    4 GiB dictionary, which liblzma allocates before decoding a byte)."""
    sweep = sweep_points(0).astype("<f4").tobytes()
    name = "a" * 296 + ".bin" if kind == "long-name" else "000000.bin"
    method = {"lzma-properties": zipfile.ZIP_LZMA, "lzma-dictionary": zipfile.ZIP_LZMA,
              "bzip2-stream": zipfile.ZIP_BZIP2}.get(kind, zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(path, "w", method) as zf:
        zf.writestr(name, sweep)
    data = bytearray(path.read_bytes())
    start = 30 + len(name)  # the member's data, after its local header
    if kind == "lzma-properties":
        data[start + 4] = 0xFF  # lc, lp and pb past their ranges
    elif kind == "lzma-dictionary":
        data[start + 5 : start + 9] = struct.pack("<I", 0xFFFFFFFF)
    elif kind == "bzip2-stream":
        data[start + 20 : start + 60] = bytes(range(40))
    elif kind == "not-utf8":
        for signature, flag_at, name_at in ((b"PK\x03\x04", 6, 30), (b"PK\x01\x02", 8, 46)):
            at = data.find(signature)
            struct.pack_into("<H", data, at + flag_at, struct.unpack_from("<H", data, at + flag_at)[0] | 0x800)
            data[at + name_at] = 0xFF
    path.write_bytes(bytes(data))
    return path


def sweep_points(seed: int) -> np.ndarray:
    """2,000 random points (x, y, z, intensity) 5-30 m around the origin: a stand-in sweep for file tests."""
    rng = np.random.default_rng(seed)
    az = rng.uniform(-np.pi, np.pi, 2000)
    r = rng.uniform(5, 30, 2000)
    return np.stack([r * np.cos(az), r * np.sin(az), rng.uniform(-1.7, 2.0, 2000), rng.uniform(0, 1, 2000)], 1)


def directory_only_zip(path: Path, entries: int) -> Path:
    """A zip whose central directory lists `entries` empty entries and holds nothing else (zip64 records, as
    past 65,535 entries): 46 bytes an entry, the cheapest way to make `zipfile` parse a huge directory."""
    record = np.zeros(entries, dtype=np.dtype([("sig", "<u4"), ("ver", "<u2", 2), ("flag", "<u2"), ("method", "<u2"),
                                                ("time", "<u2", 2), ("crc", "<u4"), ("sizes", "<u4", 2),
                                                ("lengths", "<u2", 3), ("disk", "<u2"), ("attrs", "<u2"),
                                                ("ext", "<u4"), ("offset", "<u4")]))
    record["sig"], record["ver"] = 0x02014B50, 20
    directory = record.tobytes()
    zip64_end = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, len(directory), 0)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, len(directory), 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    path.write_bytes(directory + zip64_end + locator + end)
    return path


def patched_zip(path: Path, member: bytes, flag: int = 0, method: int | None = None, corrupt: bool = False) -> Path:
    """A one-member zip with the member's flag bits or compression method changed in both of its headers
    (zipfile writes neither encrypted nor unknown-method members), or its deflate stream damaged."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("000000.bin", member)
    data = bytearray(path.read_bytes())
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.find(signature)
        data[at + flag_at : at + flag_at + 2] = struct.pack("<H", flag)
        if method is not None:
            data[at + flag_at + 2 : at + flag_at + 4] = struct.pack("<H", method)
    if corrupt:
        start = 30 + len("000000.bin")
        data[start : start + 40] = bytes(range(200, 240))
    path.write_bytes(bytes(data))
    return path


# ----------------------------------------------------------------------------------------------------------
# Worlds and ray casts

def flat_hdmap() -> HDMap:
    """An all-road map on the plane z = 0: every beam below the horizon meets ground within range."""
    return HDMap(layers={}, raster=np.full((200, 200), MAP_CLASS_INDEX["road"], np.uint8), origin=(-100.0, -100.0),
                 resolution=1.0, terrain=np.zeros((3, 3), np.float32), terrain_origin=(-200.0, -200.0),
                 terrain_resolution=200.0)


FLAT = flat_hdmap()


def car_world(speed: float = 0.0) -> World:
    """A flat world with one car 12 m ahead of the origin, facing +x (driving at `speed` m/s along x)."""
    path = np.array([[12.0, 0.0], [200.0, 0.0]]) if speed else None
    car = Actor(id=1, cls="car", size=(4.5, 1.9, 1.6), parts=Shapes.empty(), x=12.0, y=0.0, yaw=0.0, path=path,
                speed=speed, s_stop=100.0)
    graph = RoadGraph(nodes=np.zeros((0, 2)), roads=[], style="test")
    return World(seed=0, style="test", hdmap=FLAT, graph=graph, actors=[car], scenery=Shapes.empty())


def brute_force_view(boxes: np.ndarray, pose: np.ndarray, sensor: Sensor) -> tuple[np.ndarray, np.ndarray]:
    """Every pixel's ray against every box, in the world frame: nearest entry in [min, max] range, else 0 / -1.

    A ray that starts inside a box does not see that box (the sensor sees out of it).
    """
    o = pose[:3, 3]
    d = sensor.ray_directions().reshape(-1, 3) @ pose[:3, :3].T
    best = np.full(len(d), np.inf)
    index = np.full(len(d), -1)
    for i, (cx, cy, cz, length, width, height, yaw) in enumerate(np.asarray(boxes, np.float64)):
        c, s = np.cos(yaw), np.sin(yaw)
        rot = np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]])  # world -> box frame
        lo_, do = rot @ (o - [cx, cy, cz]), d @ rot.T
        half = np.array([length, width, height]) / 2
        if (np.abs(lo_) <= half).all():
            continue
        t_near, t_far = np.full(len(d), -np.inf), np.full(len(d), np.inf)
        for axis in range(3):
            parallel = do[:, axis] == 0
            with np.errstate(divide="ignore"):
                ta = (-half[axis] - lo_[axis]) / do[:, axis]
                tb = (half[axis] - lo_[axis]) / do[:, axis]
            t_near = np.where(parallel, t_near, np.maximum(t_near, np.minimum(ta, tb)))
            t_far = np.where(parallel, t_far, np.minimum(t_far, np.maximum(ta, tb)))
            if abs(lo_[axis]) > half[axis]:
                t_far = np.where(parallel, -np.inf, t_far)
        t = np.where((t_near <= t_far) & (t_near > 0), t_near, np.inf)
        t = np.where((t >= sensor.min_range) & (t <= sensor.max_range), t, np.inf)
        nearer = t < best
        best[nearer], index[nearer] = t[nearer], i
    rng = np.where(np.isfinite(best), best, 0.0)
    return rng.reshape(sensor.shape), index.reshape(sensor.shape)


# ----------------------------------------------------------------------------------------------------------
# Ring-by-ring sweeps of a known scene (upsampling tests and its evaluation)

#: The scene `ring_sweep` draws: flat ground this far below the sensor, a round wall at this distance, and a
#: box face across the road ahead (x, half width, top height) when `box` is asked for.
SCENE_GROUND_M = 1.7
SCENE_WALL_M = 25.0
SCENE_BOX = (10.0, 2.0, 0.5)


def scene_ranges(elevations_deg: np.ndarray, azimuths: np.ndarray, wall: bool = True, box: bool = True) -> np.ndarray:
    """(H, W) range (m, 0 = no return) of each ray (beam elevation by azimuth, rad) into the scene."""
    el = np.radians(np.asarray(elevations_deg, dtype=np.float64))[:, None]
    az = np.asarray(azimuths, dtype=np.float64)
    shape = np.broadcast_shapes(el.shape, az.shape)
    out = np.full(shape, np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(el < 0, SCENE_GROUND_M / np.sin(-el), out)
        if wall:
            out = np.minimum(out, SCENE_WALL_M / np.cos(el))
        if box:
            ahead, half, top = SCENE_BOX
            hit = ahead / (np.cos(el) * np.cos(az))
            y, z = hit * np.cos(el) * np.sin(az), hit * np.sin(el)
            out = np.where((np.cos(az) > 0) & (np.abs(y) <= half) & (z <= top) & (hit < out), hit, out)
    return np.where(np.isfinite(out), out, 0.0)


def ring_sweep(elevations_deg: np.ndarray, width: int, seed: int = 0, drop: float = 0.05, wall: bool = True,
               box: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A sweep of the scene (`scene_ranges`) on the given beams (highest first) and `width` firings a turn, each
    firing a little off its column's centre, a share `drop` of rays without a return, stored ring by ring from
    behind the sensor: (N, 4) float32 points and (N,) ring (0 = the highest beam)."""
    rng = np.random.default_rng(seed)
    height = len(elevations_deg)
    az = np.pi * (1.0 - (2.0 * np.arange(width) + 1.0) / width) + rng.uniform(-0.2, 0.2, (height, width)) * np.pi / width
    ranges = scene_ranges(elevations_deg, az, wall, box)
    ranges[rng.random(ranges.shape) < drop] = 0.0
    el = np.radians(np.asarray(elevations_deg, dtype=np.float64))[:, None]
    xyz = np.stack(np.broadcast_arrays(ranges * np.cos(el) * np.cos(az), ranges * np.cos(el) * np.sin(az),
                                       ranges * np.sin(el)), axis=-1)
    keep = ranges > 0
    ring = np.broadcast_to(np.arange(height)[:, None], keep.shape)[keep]
    points = np.concatenate([xyz[keep], rng.uniform(0.0, 1.0, (int(keep.sum()), 1))], axis=1)
    return points.astype(np.float32), ring.astype(np.int64)


# ----------------------------------------------------------------------------------------------------------
# Multi-process checkpointing runs (checkpointing.crashtest and tests/ckpt_worker.py)

def rank_outputs(out: Path, world_size: int) -> list[dict]:
    """What each rank of a run observed (<out>/rank<k>.pt)."""
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def assert_same_tree(a, b, where: str = "") -> None:
    """Equal nested dicts / lists of tensors and values, naming the first path that differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"differs at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"keys differ at {where}: {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"lengths differ at {where}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"differs at {where}: {a!r} vs {b!r}"


def assert_crash_trials(summary: dict, trials: int) -> None:
    """Every trial resumed a whole generation no older than the last published one (`crash_trials`' summary)."""
    assert summary["died_before_resuming"] == 0, "a run died before resuming; see stderr"
    assert summary["resumes"] == trials
    assert summary["torn"] == []
    assert summary["went_back"] == []
    assert summary["last_published"] > trials  # the loop really saved between kills
    assert resolve_generation(summary["job"]).generation.iteration >= summary["last_published"]


def run_cli_with_a_bug(module: str, replaced: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `module.main(argv)` in a fresh interpreter with `module.replaced` raising a RuntimeError (a bug, not
    bad input), and return the finished process: a CLI must show it as a traceback with exit status 1."""
    code = (f"import sys, {module} as cli\n"
            "def boom(*_, **__): raise RuntimeError('a bug, not bad input')\n"
            f"cli.{replaced} = boom\n"
            f"sys.exit(cli.main({argv!r}))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "RuntimeError: a bug, not bad input" in result.stderr
    return result
