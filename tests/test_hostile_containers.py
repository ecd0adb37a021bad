"""Hostile recording containers get one clear `InputError`, fast and within bounded memory: records and
chunks that lie about their sizes, compression bombs, a million tiny messages, unknown message types,
PointCloud2 messages that lie about their layout, and pcaps of packets no LiDAR sends.

The containers are crafted here byte by byte (or written with rosbags where the container itself is valid),
and each is opened the way an upload is (`lidar.sequence.read_sequence`). The bombs run in a fresh process
whose peak memory is measured. The command lines read them in their bounded workers and end in one
`error:` line with exit status 2.
"""

from __future__ import annotations

import bz2
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_types_from_msg, get_typestore

from lidar import cli
from lidar.errors import InputError
from lidar.recordings.base import MAX_CONTAINER_MESSAGES
from lidar.sequence import read_sequence

REPO = Path(__file__).resolve().parents[1]
#: A refusal takes at most this long (s) and, in its own process, this much more memory than a bare read.
FAST_S = 5.0
BOUNDED_BYTES = 150 * 2**20


def refused(path: Path, match: str, **kwargs) -> None:
    start = time.perf_counter()
    with pytest.raises(InputError, match=match):
        read_sequence(path, **kwargs)
    assert time.perf_counter() - start < FAST_S


# --- ROS 1 bags, byte by byte ------------------------------------------------------------------------------


def ros1_record(fields: dict[str, bytes], data: bytes, data_len: int | None = None) -> bytes:
    header = b"".join(struct.pack("<I", len(k) + 1 + len(v)) + k.encode() + b"=" + v for k, v in fields.items())
    return struct.pack("<I", len(header)) + header + struct.pack("<I", len(data) if data_len is None else data_len) + data


def ros1_bag(path: Path, *records: bytes) -> Path:
    head = ros1_record({"op": b"\x03", "index_pos": struct.pack("<Q", 0), "conn_count": struct.pack("<I", 0),
                        "chunk_count": struct.pack("<I", 0)}, b" " * 16)
    path.write_bytes(b"#ROSBAG V2.0\n" + head + b"".join(records))
    return path


def test_ros1_record_claiming_more_than_the_file(tmp_path):
    path = ros1_bag(tmp_path / "lie.bag", ros1_record({"op": b"\x07", "conn": b"\0\0\0\0"}, b"x" * 10, 4_000_000_000))
    refused(path, r"lie.bag: a record claims 4,000,000,000 bytes of data past the end of the file")


def test_ros1_bz2_bomb_stops_at_its_claimed_size(tmp_path):
    compressor, zeros = bz2.BZ2Compressor(9), bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(64)) + compressor.flush()  # 64 MB in ~2 KB
    chunk = ros1_record({"op": b"\x05", "compression": b"bz2", "size": struct.pack("<I", 4096)}, bomb)
    path = ros1_bag(tmp_path / "bomb.bag", chunk)
    refused(path, r"bomb.bag: a compressed chunk inflates to more than the 4,096 bytes it claims")


def test_ros1_chunk_claiming_a_huge_size(tmp_path):
    chunk = ros1_record({"op": b"\x05", "compression": b"lz4", "size": struct.pack("<I", 4_000_000_000)}, b"\0" * 64)
    refused(ros1_bag(tmp_path / "huge.bag", chunk), r"a chunk of 4,000 MB, over the 200 MB")


def test_ros1_index_of_a_million_tiny_messages(tmp_path):
    count = MAX_CONTAINER_MESSAGES + 1
    index = ros1_record({"op": b"\x04", "ver": struct.pack("<I", 1), "conn": struct.pack("<I", 0),
                         "count": struct.pack("<I", count)}, bytes(12 * count))
    refused(ros1_bag(tmp_path / "tiny.bag", index), r"lists 1,000,001 messages; a recording may list at most 1,000,000")


def test_ros1_chunk_info_pointing_at_no_chunk(tmp_path):
    info = ros1_record({"op": b"\x06", "ver": struct.pack("<I", 1), "chunk_pos": struct.pack("<Q", 13),
                        "start_time": bytes(8), "end_time": bytes(8), "count": struct.pack("<I", 1)},
                       struct.pack("<II", 0, 1))
    refused(ros1_bag(tmp_path / "stray.bag", info), r"a chunk info points at no chunk")


# --- MCAP, byte by byte --------------------------------------------------------------------------------------

MCAP_MAGIC = b"\x89MCAP0\r\n"


def mcap_record(op: int, body: bytes) -> bytes:
    return struct.pack("<BQ", op, len(body)) + body


def mcap_string(text: str) -> bytes:
    return struct.pack("<I", len(text)) + text.encode()


def mcap_file(path: Path, *records: bytes) -> Path:
    header = mcap_record(0x01, mcap_string("ros2") + mcap_string("crafted"))
    footer = mcap_record(0x02, bytes(20))
    path.write_bytes(MCAP_MAGIC + header + b"".join(records) + footer + MCAP_MAGIC)
    return path


def test_mcap_zstd_bomb_stops_at_its_claimed_size(tmp_path):
    try:
        from compression import zstd
    except ImportError:
        from backports import zstd
    bomb = zstd.compress(bytes(64 << 20))
    body = struct.pack("<QQQI", 0, 0, 4096, 0) + mcap_string("zstd") + struct.pack("<Q", len(bomb)) + bomb
    refused(mcap_file(tmp_path / "bomb.mcap", mcap_record(0x06, body)),
            r"bomb.mcap: a compressed chunk inflates to more than the 4,096 bytes it claims")


def test_mcap_record_claiming_more_than_the_file(tmp_path):
    path = mcap_file(tmp_path / "lie.mcap", struct.pack("<BQ", 0x05, 2**40) + b"x" * 32)
    refused(path, r"lie.mcap: a record claims 1,099,511,627,776 bytes past the end of the file")


def test_mcap_of_a_million_tiny_messages(tmp_path):
    message = mcap_record(0x05, struct.pack("<HIQQ", 1, 0, 0, 0) + b"\0")
    path = mcap_file(tmp_path / "tiny.mcap", message * (MAX_CONTAINER_MESSAGES + 1))
    refused(path, r"tiny.mcap: lists 1,000,001 messages; a recording may list at most 1,000,000")


# --- valid containers of the wrong things --------------------------------------------------------------------


def ros2_bag(path: Path, topic: str, msgtype: str, messages: list[bytes], store) -> Path:
    with Writer(path.with_suffix(""), version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        connection = writer.add_connection(topic, msgtype, typestore=store)
        for i, raw in enumerate(messages):
            writer.write(connection, 1_000_000_000 + i, raw)
    next(path.with_suffix("").glob("*.mcap")).rename(path)
    return path


def test_unknown_message_type(tmp_path):
    store = get_typestore(Stores.ROS2_HUMBLE)
    store.register(get_types_from_msg("uint8[] payload", "acme_msgs/msg/Blob"))
    blob = store.types["acme_msgs/msg/Blob"](payload=np.zeros(16, dtype=np.uint8))
    path = ros2_bag(tmp_path / "blob.mcap", "/blob", "acme_msgs/msg/Blob",
                    [store.serialize_cdr(blob, "acme_msgs/msg/Blob")], store)
    refused(path, r"blob.mcap: no sensor_msgs/msg/PointCloud2 topic; it holds /blob \(acme_msgs/msg/Blob\)")
    refused(path, r"/blob carries acme_msgs/msg/Blob; expected sensor_msgs/msg/PointCloud2", topic="/blob")


def lying_cloud(store, width: int, point_step: int, data: int, fields: int = 4) -> bytes:
    types = store.types
    header = types["std_msgs/msg/Header"](stamp=types["builtin_interfaces/msg/Time"](sec=1, nanosec=0), frame_id="x")
    names = ["x", "y", "z", "intensity"] + [f"f{k}" for k in range(fields - 4)]
    declared = [types["sensor_msgs/msg/PointField"](name=n, offset=0, datatype=7, count=1) for n in names]
    msg = types["sensor_msgs/msg/PointCloud2"](header=header, height=1, width=width, fields=declared,
                                               is_bigendian=False, point_step=point_step, row_step=width * point_step,
                                               data=np.zeros(data, dtype=np.uint8), is_dense=True)
    return store.serialize_cdr(msg, "sensor_msgs/msg/PointCloud2")


@pytest.mark.parametrize(("width", "step", "data", "fields", "message"), [
    (1_000, 16, 160, 4, r"1 x 1000 points of 16 bytes \(rows of 16000\) need 16,000 bytes; the message holds 160"),
    (300_000_000, 8, 16, 4, r"300,000,000 points is over the"),
    (10, 16, 160, 70, r"70 fields; a PointCloud2 has at most 64"),
    (10, 2, 20, 4, r"field 'x' at byte 0 runs past the 2-byte point"),
])
def test_pointcloud2_lying_about_its_layout(tmp_path, width, step, data, fields, message):
    store = get_typestore(Stores.ROS2_HUMBLE)
    raw = lying_cloud(store, width, step, data, fields)
    path = ros2_bag(tmp_path / "cloud.mcap", "/points", "sensor_msgs/msg/PointCloud2", [raw], store)
    refused(path, message)


# --- pcaps --------------------------------------------------------------------------------------------------


def udp_frame(payload: bytes, port: int) -> bytes:
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + 8 + len(payload), 1, 0, 64, 17, 0, bytes(4), bytes(4))
    return bytes(12) + b"\x08\x00" + ip + struct.pack(">HHHH", 5353, port, 8 + len(payload), 0) + payload


def pcap(path: Path, frames: list[bytes], claimed: int | None = None) -> Path:
    records = b"".join(struct.pack("<IIII", 1, 0, claimed or len(f), len(f)) + f for f in frames)
    path.write_bytes(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1) + records)
    return path


def test_pcap_of_packets_no_lidar_sends(tmp_path):
    path = pcap(tmp_path / "dns.pcap", [udp_frame(b"\x12\x34" + bytes(60), 53)] * 2000)
    refused(path, r"dns.pcap: no Velodyne data packets among its first datagrams and no Ouster metadata json")


def test_pcap_with_ouster_metadata_but_no_lidar_packets(tmp_path):
    meta = {"beam_altitude_angles": [0.0] * 16, "beam_azimuth_angles": [0.0] * 16,
            "lidar_origin_to_beam_origin_mm": 15.8, "lidar_to_sensor_transform": np.eye(4).ravel().tolist(),
            "data_format": {"pixels_per_column": 16, "columns_per_frame": 512, "columns_per_packet": 16,
                            "udp_profile_lidar": "RNG15_RFL8_NIR8"}}
    (tmp_path / "os.json").write_text(json.dumps(meta))
    path = pcap(tmp_path / "os.pcap", [udp_frame(bytes(100), 7502)] * 50)
    refused(path, r"no Ouster lidar packets of 1,280 bytes \(Ouster, RNG15_RFL8_NIR8, 16x512 as os.json describes\) "
                  r"among its 50 UDP datagrams")


def test_pcap_record_claiming_a_huge_frame(tmp_path):
    path = pcap(tmp_path / "lie.pcap", [udp_frame(bytes(10), 2368)], claimed=2**31)
    refused(path, r"the record at byte 24 claims 2,147,483,648 bytes")


def test_pcap_of_a_million_tiny_packets_is_refused_quickly(tmp_path):
    path = pcap(tmp_path / "tiny.pcap", [udp_frame(b"", 2368)] * 1_000_000)
    refused(path, r"tiny.pcap: no Velodyne data packets")


@pytest.mark.parametrize(("name", "data", "message"), [
    ("noise.bag", b"#ROSBAG V2.0\n" + bytes(range(256)) * 8, r"noise.bag: a record header of"),
    ("noise.mcap", MCAP_MAGIC + b"\xff" * 64, r"noise.mcap: a record claims"),
    ("noise.db3", b"SQLite format 3\x00" + bytes(200), r"noise.db3: not a readable sqlite3 ROS 2 bag"),
    ("noise.pcap", b"\x00" * 64, r"noise.pcap: not a recording container"),
    ("text.bag", b"hello world, not a bag at all\n", r"text.bag: not a recording container"),
])
def test_garbage_under_a_container_name(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    refused(path, message)


# --- memory: the bombs, each in a fresh process ---------------------------------------------------------------

_PEAK = """
import resource, sys
from lidar.errors import InputError
from lidar.sequence import read_sequence
import lidar.recordings.rosbag, lidar.recordings.velodyne, lidar.recordings.ouster  # imports, then the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_sequence(sys.argv[1])
except InputError as err:
    print(type(err).__name__, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


@pytest.mark.parametrize("make", ["bz2", "zstd", "tiny-mcap"])
def test_bombs_are_refused_within_bounded_memory(tmp_path, make):
    if make == "bz2":
        compressor = bz2.BZ2Compressor(9)
        bomb = b"".join(compressor.compress(bytes(1 << 20)) for _ in range(512)) + compressor.flush()  # 512 MB
        path = ros1_bag(tmp_path / "b.bag", ros1_record({"op": b"\x05", "compression": b"bz2",
                                                         "size": struct.pack("<I", 100_000_000)}, bomb))
    elif make == "zstd":
        try:
            from compression import zstd
        except ImportError:
            from backports import zstd
        bomb = zstd.compress(bytes(1 << 30))  # 1 GB in ~32 KB
        body = struct.pack("<QQQI", 0, 0, 100_000_000, 0) + mcap_string("zstd") + struct.pack("<Q", len(bomb)) + bomb
        path = mcap_file(tmp_path / "b.mcap", mcap_record(0x06, body))
    else:
        message = mcap_record(0x05, struct.pack("<HIQQ", 1, 0, 0, 0) + b"\0")
        path = mcap_file(tmp_path / "t.mcap", message * (MAX_CONTAINER_MESSAGES + 1))
    done = subprocess.run([sys.executable, "-c", _PEAK, str(path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    kind, grown = done.stdout.split()
    assert kind == "PointCloudError", done.stderr
    assert int(grown) < BOUNDED_BYTES


# --- the command lines, which read containers in their bounded workers ----------------------------------------


def bz2_bomb_bag(path: Path) -> Path:
    compressor = bz2.BZ2Compressor(9)
    bomb = b"".join(compressor.compress(bytes(1 << 20)) for _ in range(64)) + compressor.flush()
    return ros1_bag(path, ros1_record({"op": b"\x05", "compression": b"bz2", "size": struct.pack("<I", 4096)}, bomb))


def blob_mcap(path: Path) -> Path:
    store = get_typestore(Stores.ROS2_HUMBLE)
    store.register(get_types_from_msg("uint8[] payload", "acme_msgs/msg/Blob"))
    blob = store.types["acme_msgs/msg/Blob"](payload=np.zeros(16, dtype=np.uint8))
    return ros2_bag(path, "/blob", "acme_msgs/msg/Blob", [store.serialize_cdr(blob, "acme_msgs/msg/Blob")], store)


HOSTILE = {
    "bz2-bomb.bag": (bz2_bomb_bag, "a compressed chunk inflates to more than the 4,096 bytes it claims"),
    "lie.mcap": (lambda p: mcap_file(p, struct.pack("<BQ", 0x05, 2**40) + b"x" * 32), "a record claims"),
    "blob.mcap": (blob_mcap, "no sensor_msgs/msg/PointCloud2 topic"),
    "dns.pcap": (lambda p: pcap(p, [udp_frame(b"\x12\x34" + bytes(60), 53)] * 2000), "no Velodyne data packets"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_lidar_info_and_convert_refuse_a_hostile_container_from_the_worker(tmp_path, name, monkeypatch, capsys):
    make, message = HOSTILE[name]
    path = make(tmp_path / name)

    def in_the_caller(*args, **kwargs):
        raise AssertionError("a container was opened in the caller's process, not in a worker")

    monkeypatch.setattr("lidar.recordings.open_container", in_the_caller)
    for argv in (["info", str(path)], ["convert", str(path), str(tmp_path / "out.mcap")]):
        start = time.perf_counter()
        assert cli.main(argv) == 2
        assert time.perf_counter() - start < FAST_S
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"lidar: error: {path}: ") and message in lines[0]
    assert not (tmp_path / "out.mcap").exists()


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "lidar", "info", "{file}"],
    [sys.executable, "-m", "inference", "forecast", "--prefix", "{file}", "--frames", "2", "--out", "{out}"],
])
def test_the_command_lines_end_a_container_bomb_in_one_error_line(tmp_path, command):
    path = bz2_bomb_bag(tmp_path / "bomb.bag")
    argv = [part.format(file=path, out=tmp_path / "out") for part in command]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "error: " in lines[0] and "bomb.bag: a compressed chunk inflates" in lines[0] and len(lines[0]) < 400
