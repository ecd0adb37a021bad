"""Velodyne pcap captures (VLP-16, VLP-32C, HDL-32E, HDL-64E, VLS-128), decoded with `velodyne_decoder`.

The index is built from the packets' own fields, without decoding a point: a data packet is a 1206-byte UDP
payload of 12 firing blocks, each opening with a block flag and its azimuth, and a revolution ends where the
first block's azimuth has turned a full circle. Only whole revolutions (an azimuth span of at least `MIN_SWEEP_SPAN_DEG`)
become sweeps. Revolutions are cut at the first packet's azimuth, so a capture of one turn holds one sweep
and only the cut last revolution is left out. A sweep is decoded on demand
from its packets (`velodyne_decoder.ScanDecoder`, with the model named in the packets and, for an HDL-64E,
the calibration it streams). Its stamp is the capture time of its first packet; its rings are the
decoder's laser index sorted by elevation (0 = lowest).

A packet whose factory byte names an HDL-32E but that arrives every ~1.33 ms, as a 16-laser Puck's do (an
HDL-32E's every 0.55 ms), is decoded as a VLP-16 with a note: such captures exist (the shared VLP-16 one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import velodyne_decoder as vd

from lidar.formats import Scan
from lidar.formats.scan import PointCloudError, build_scan
from lidar.recordings.base import ContainerRecording, make_recording
from lidar.recordings.pcap import Datagram, datagrams
from lidar.sensors import Sensor

logger = logging.getLogger(__name__)

PACKET_BYTES = vd.PACKET_SIZE
#: A revolution must sweep at least this much azimuth to be a sweep (a packet covers 2-5 degrees).
MIN_SWEEP_SPAN_DEG = 340.0
#: Block flags: every model's, and the HDL-64E's lower-laser block.
_BLOCK_FLAGS = (b"\xff\xee", b"\xff\xdd")
_HDL32_ID, _VLP16_ID = 0x21, 0x22
#: Median packet interval (s) past which an "HDL-32E" packet stream is a 16-laser Puck's.
_PUCK_INTERVAL_S = 1.0e-3
_COLUMNS = ("x", "y", "z", "intensity", "time", "column", "ring", "return_type")


@dataclass
class _Index:
    """Where each whole revolution's packets lie: a start offset and a packet count per sweep."""

    offsets: list[int]
    counts: list[int]
    stamps_ns: list[int]
    factory: bytes
    interval_s: float
    packets: int
    others: int


def is_velodyne(path: Path) -> bool:
    """True when the first hundred UDP datagrams include a Velodyne data packet."""
    for count, datagram in enumerate(datagrams(path)):
        if _is_data(datagram.payload):
            return True
        if count >= 100:
            return False
    return False


def open_velodyne_pcap(path: Path, sensor: Sensor | None = None) -> ContainerRecording:
    index = _index(path)
    config = vd.Config()
    notes: list[str] = []
    factory = bytearray(index.factory)
    if index.factory[1] == _HDL32_ID and index.interval_s > _PUCK_INTERVAL_S:
        factory[1] = _VLP16_ID
        notes.append(f"packets name an HDL-32E but arrive every {index.interval_s * 1e3:.2f} ms as a VLP-16's do "
                     "(an HDL-32E's: 0.55 ms); decoded as a VLP-16")
    elif _varies(path):
        model, calibration = _hdl64_calibration(path)
        config.model, config.calibration = model, calibration
    patch = bytes(factory) if bytes(factory) != index.factory else None

    def decode(i: int) -> Scan:
        packets = vd.PacketVector([
            vd.VelodynePacket(d.stamp_ns / 1e9, np.frombuffer(d.payload[:-2] + patch if patch else d.payload, np.uint8))
            for d in _packets(path, index.offsets[i], index.counts[i])
        ])
        try:
            _, cloud = vd.ScanDecoder(config).decode(packets)
        except RuntimeError as err:
            raise PointCloudError(f"{path}: sweep {i} cannot be decoded ({err})") from None
        cloud = np.asarray(cloud, dtype=np.float64).reshape(-1, len(_COLUMNS))
        return build_scan(Path(f"{path}#{i}"), "velodyne-pcap", cloud[:, :3], cloud[:, 3], cloud[:, 6].astype(np.int64),
                          columns=_COLUMNS, notes=notes, sensor=sensor)

    logger.info("%s: %d Velodyne data packets, %d other datagrams, %d whole revolutions", path.name, index.packets,
                index.others, len(index.offsets))
    return make_recording(path, "velodyne-pcap", None, index.stamps_ns, decode, label="velodyne")


def _is_data(payload: bytes) -> bool:
    return len(payload) == PACKET_BYTES and payload[:2] in _BLOCK_FLAGS


def _azimuth(payload: bytes) -> int:
    return int.from_bytes(payload[2:4], "little")


def _index(path: Path) -> _Index:
    """One pass over the capture: group the data packets into revolutions by their first azimuth."""
    starts: list[tuple[int, int]] = []  # (offset, stamp) of each revolution's first packet
    counts: list[int] = []
    spans: list[int] = []  # hundredths of a degree turned from each revolution's first packet to its last
    previous, turned, factory, packets, others = -1, 0, b"", 0, 0
    first_stamp = last_stamp = 0
    for d in datagrams(path):
        if not _is_data(d.payload):
            others += 1
            continue
        azimuth = _azimuth(d.payload)
        if azimuth > 35999:
            raise PointCloudError(f"{path}: a Velodyne packet at byte {d.offset:,} has azimuth {azimuth / 100:.2f} deg; "
                                  "expected 0-359.99 (a corrupt capture)")
        if packets == 0:
            factory, first_stamp = d.payload[-2:], d.stamp_ns
        step = (azimuth - previous) % 36000 if previous >= 0 else 0
        if previous < 0 or turned + step >= 36000:  # the first packet's azimuth is where revolutions are cut
            starts.append((d.offset, d.stamp_ns))
            counts.append(0)
            spans.append(0)
            turned = 0
        else:
            turned += step
        counts[-1] += 1
        spans[-1] = turned
        previous, last_stamp = azimuth, d.stamp_ns
        packets += 1
    if packets == 0:
        raise PointCloudError(
            f"{path}: no Velodyne data packets among its {others:,} UDP datagrams (expected 1206-byte packets of "
            "firing blocks, as a VLP-16, VLP-32C, HDL-32E or HDL-64E sends to port 2368)"
        )
    whole = [i for i, span in enumerate(spans) if span >= MIN_SWEEP_SPAN_DEG * 100]
    if not whole:
        raise PointCloudError(f"{path}: {packets:,} Velodyne packets but no whole revolution (the widest covers "
                              f"{max(spans) / 100:.0f} deg); expected at least one full turn")
    interval = (last_stamp - first_stamp) / 1e9 / max(packets - 1, 1)
    return _Index([starts[i][0] for i in whole], [counts[i] for i in whole], [starts[i][1] for i in whole],
                  factory, interval, packets, others)


def _packets(path: Path, offset: int, count: int) -> Iterator[Datagram]:
    """`count` data packets from the record at `offset` on."""
    taken = 0
    for d in datagrams(path, start=offset):
        if _is_data(d.payload):
            yield d
            taken += 1
            if taken == count:
                return


def _varies(path: Path) -> bool:
    """True when the factory bytes of the first five data packets differ: an HDL-64E (others keep them fixed)."""
    seen = []
    for d in datagrams(path):
        if _is_data(d.payload):
            seen.append(d.payload[-2:])
            if len(seen) == 5:
                break
    return len(seen) == 5 and len(set(seen)) > 1


def _hdl64_calibration(path: Path) -> tuple[object, object]:
    """An HDL-64E's model and calibration, streamed in its packets' status bytes."""
    try:
        model, calibration = vd.hdl64e.detect_hdl64e(str(path))
    except (ValueError, KeyError, IndexError) as err:
        raise PointCloudError(f"{path}: an HDL-64E capture whose calibration cannot be read from its status bytes "
                              f"({err}); expected a capture of at least one status cycle (a few seconds)") from None
    return model, calibration
