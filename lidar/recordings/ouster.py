"""Ouster pcap captures with the sensor's metadata json, decoded with NumPy.

The metadata json (what the sensor serves at `/api/v1/sensor/metadata`, saved beside every recording) gives
the packet layout (`udp_profile_lidar`, columns per packet and frame, pixels per column) and the beam
geometry (altitude and azimuth per beam, the beam-origin offset, the lidar-to-sensor transform). Both the
flat layout of firmware 2.0-2.3 and the nested one of 2.4+ are read. Packets are decoded in the three
single-return profiles: LEGACY, RNG19_RFL8_SIG16_NIR16 and RNG15_RFL8_NIR8 (low bandwidth).

Points follow Ouster's published XYZ model (the firmware user manual, "Lidar Range to XYZ"): for the pixel
of beam u at measurement id m, with encoder angle 2*pi*(1 - m/W), the return lies at range minus the
beam-origin offset along the beam and the offset along the encoder's direction, then moves by
lidar_to_sensor; everything in mm until the end. Rings are beam rows (0 = the highest beam); reflectivity
is the intensity (0-255). A frame is a sweep once every column of its column window arrived valid; the
stamp of a sweep is its first column's timestamp (the sensor's clock, ns).

`ouster-sdk` would do this too, but every release pins psutil < 6, click < 8.2, flask 3.0 and rosbags
0.9.23, which the app's and the bag reader's own dependencies outgrew.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lidar.formats import Scan
from lidar.formats.scan import PointCloudError, build_scan
from lidar.recordings.base import ContainerRecording, make_recording
from lidar.recordings.pcap import datagrams
from lidar.sensors import Sensor
from lidar.sequence import parse_json, read_text_file

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """Byte layout of one lidar packet profile: packet header/footer, column header, pixel and its fields."""

    packet_header: int
    column_header: int
    pixel: int
    column_footer: int
    packet_footer: int
    #: (byte offset in the pixel, dtype, mask, scale to mm) of the range.
    range_field: tuple[int, str, int, int]
    #: (byte offset in the pixel, dtype) of the reflectivity.
    reflectivity: tuple[int, str]


PROFILES = {
    "LEGACY": Profile(0, 16, 12, 4, 0, (0, "<u4", 0xFFFFF, 1), (4, "<u2")),
    "RNG19_RFL8_SIG16_NIR16": Profile(32, 12, 12, 0, 32, (0, "<u4", 0x7FFFF, 1), (4, "u1")),
    "RNG15_RFL8_NIR8": Profile(32, 12, 4, 0, 32, (0, "<u2", 0x7FFF, 8), (2, "u1")),
}
_COLUMNS = ("x", "y", "z", "reflectivity", "ring")


@dataclass
class Metadata:
    """What decoding needs from the metadata json."""

    profile_name: str
    profile: Profile
    height: int
    width: int
    columns_per_packet: int
    column_window: tuple[int, int]
    altitude_deg: np.ndarray
    azimuth_deg: np.ndarray
    beam_to_lidar: np.ndarray
    lidar_to_sensor: np.ndarray
    lidar_port: int | None
    product: str

    @property
    def packet_bytes(self) -> int:
        p = self.profile
        return p.packet_header + self.columns_per_packet * (p.column_header + self.height * p.pixel + p.column_footer) + \
            p.packet_footer

    @property
    def columns_in_window(self) -> int:
        first, last = self.column_window
        return (last - first) % self.width + 1


def find_metadata(pcap: Path) -> Path | None:
    """The metadata json beside `pcap`: the one whose stem begins the capture's name (longest first), else
    the only json in its folder."""
    candidates = sorted(pcap.parent.glob("*.json"))
    named = [j for j in candidates if pcap.stem.startswith(j.stem)]
    if named:
        return max(named, key=lambda j: len(j.stem))
    return candidates[0] if len(candidates) == 1 else None


def read_metadata(path: Path) -> Metadata:
    data = parse_json(read_text_file(path, "Ouster metadata json", "the sensor's metadata json"), str(path))
    if not isinstance(data, dict):
        raise PointCloudError(f"{path}: not an Ouster metadata json (expected an object)")
    try:
        return _metadata(data)
    except (KeyError, TypeError, ValueError) as err:
        raise PointCloudError(f"{path}: not an Ouster sensor metadata json ({type(err).__name__}: {err}); expected "
                              "beam_altitude_angles, beam_azimuth_angles and a data format") from None


def _metadata(data: dict[str, Any]) -> Metadata:
    beams = data.get("beam_intrinsics", data)
    fmt = data.get("lidar_data_format", data.get("data_format"))
    config = data.get("config_params", {})
    name = str(fmt.get("udp_profile_lidar", config.get("udp_profile_lidar", "LEGACY")))
    if name not in PROFILES:
        raise ValueError(f"udp_profile_lidar {name}; supported: {', '.join(PROFILES)}")
    height, width = int(fmt["pixels_per_column"]), int(fmt["columns_per_frame"])
    altitude = np.asarray(beams["beam_altitude_angles"], dtype=np.float64)
    azimuth = np.asarray(beams["beam_azimuth_angles"], dtype=np.float64)
    if altitude.shape != (height,) or azimuth.shape != (height,) or not 0 < width <= 4096 or not 0 < height <= 256:
        raise ValueError(f"{height} pixels per column and {width} columns with {altitude.size} beam angles")
    if "beam_to_lidar_transform" in beams:
        beam_to_lidar = np.asarray(beams["beam_to_lidar_transform"], dtype=np.float64).reshape(4, 4)
    else:
        beam_to_lidar = np.eye(4)
        beam_to_lidar[0, 3] = float(beams["lidar_origin_to_beam_origin_mm"])
    intrinsics = data.get("lidar_intrinsics", data)
    lidar_to_sensor = np.asarray(intrinsics["lidar_to_sensor_transform"], dtype=np.float64).reshape(4, 4)
    window = fmt.get("column_window", [0, width - 1])
    port = config.get("udp_port_lidar", data.get("udp_port_lidar"))
    product = data.get("sensor_info", data).get("prod_line", "Ouster")
    meta = Metadata(name, PROFILES[name], height, width, int(fmt["columns_per_packet"]), (int(window[0]), int(window[1])),
                    altitude, azimuth, beam_to_lidar, lidar_to_sensor, int(port) if port else None, str(product))
    if not 0 < meta.columns_per_packet <= width or not np.isfinite(
            np.concatenate([altitude, azimuth, beam_to_lidar.ravel(), lidar_to_sensor.ravel()])).all():
        raise ValueError("columns per packet or beam geometry out of range")
    return meta


def open_ouster_pcap(path: Path, metadata: Path, sensor: Sensor | None = None) -> ContainerRecording:
    meta = read_metadata(metadata)
    frames: list[tuple[int, list[int]]] = []  # (frame id, record offsets of its packets)
    others = 0
    for d in datagrams(path):
        if len(d.payload) != meta.packet_bytes or (meta.lidar_port is not None and d.dst_port != meta.lidar_port):
            others += 1
            continue
        frame_id = _frame_id(d.payload, meta)
        if not frames or frames[-1][0] != frame_id:
            frames.append((frame_id, []))
        frames[-1][1].append(d.offset)
    if not frames:
        raise PointCloudError(
            f"{path}: no Ouster lidar packets of {meta.packet_bytes:,} bytes ({meta.product}, {meta.profile_name}, "
            f"{meta.height}x{meta.width} as {metadata.name} describes) among its {others:,} UDP datagrams"
        )
    lut = _xyz_lut(meta)
    wanted = -(-meta.columns_in_window // meta.columns_per_packet)
    whole = [offsets for _, offsets in frames if len(offsets) >= wanted]
    if not whole:
        raise PointCloudError(f"{path}: {len(frames)} Ouster frames, none whole (expected {wanted} packets a frame)")
    stamps = [_first_stamp(path, offsets, meta) for offsets in whole]  # from each frame's first packet alone

    def decode(i: int) -> Scan:
        rng, refl, valid = _decode_frame(path, whole[i], meta)
        keep = valid & (rng > 0)
        xyz = (lut[0][keep] * rng[keep][:, None] + lut[1][keep]) / 1000.0
        ring = np.broadcast_to(np.arange(meta.height)[:, None], rng.shape)[keep]
        return build_scan(Path(f"{path}#{i}"), "ouster-pcap", xyz, refl[keep], ring, columns=_COLUMNS, sensor=sensor)

    logger.info("%s: %d whole Ouster frames (%s, %s), %d other datagrams", path.name, len(whole), meta.product,
                meta.profile_name, others)
    return make_recording(path, "ouster-pcap", None, stamps, decode, label="ouster")


def _frame_id(payload: bytes, meta: Metadata) -> int:
    if meta.profile.packet_header:
        return int.from_bytes(payload[2:4], "little")
    return int.from_bytes(payload[10:12], "little")  # LEGACY: in the first column's header


def _columns(payload: bytes, meta: Metadata) -> np.ndarray:
    """The packet's columns as (columns, column bytes) uint8, after the packet header."""
    p = meta.profile
    step = p.column_header + meta.height * p.pixel + p.column_footer
    body = np.frombuffer(payload, np.uint8, count=meta.columns_per_packet * step, offset=p.packet_header)
    return body.reshape(meta.columns_per_packet, step)


def _column_fields(cols: np.ndarray, meta: Metadata) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(timestamp ns, measurement id, valid) per column."""
    stamp = cols[:, :8].copy().view("<u8").ravel()
    mid = cols[:, 8:10].copy().view("<u2").ravel().astype(np.int64)
    if meta.profile_name == "LEGACY":
        valid = cols[:, -4:].copy().view("<u4").ravel() == 0xFFFFFFFF
    else:
        valid = (cols[:, 10] & 0x01).astype(bool)
    return stamp, mid, valid & (mid < meta.width)


def _first_stamp(path: Path, offsets: list[int], meta: Metadata) -> int:
    for d in _packets(path, offsets[:1], meta):
        stamp, _, valid = _column_fields(_columns(d, meta), meta)
        if valid.any():
            return int(stamp[valid][0])
    raise PointCloudError(f"{path}: an Ouster frame whose first packet has no valid column")


def _packets(path: Path, offsets: list[int], meta: Metadata) -> Iterator[bytes]:
    for offset in offsets:
        for d in datagrams(path, start=offset):
            yield d.payload
            break


def _decode_frame(path: Path, offsets: list[int], meta: Metadata) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(range mm, reflectivity, valid) images of shape (height, width), staggered as measured."""
    p = meta.profile
    rng = np.zeros((meta.height, meta.width), dtype=np.float64)
    refl = np.zeros_like(rng)
    valid = np.zeros(rng.shape, dtype=bool)
    r_off, r_type, r_mask, r_scale = p.range_field
    f_off, f_type = p.reflectivity
    for payload in _packets(path, offsets, meta):
        cols = _columns(payload, meta)
        _, mid, ok = _column_fields(cols, meta)
        pixels = cols[ok, p.column_header:p.column_header + meta.height * p.pixel].reshape(-1, meta.height, p.pixel)
        size = np.dtype(r_type).itemsize
        raw = pixels[:, :, r_off:r_off + size].copy().view(r_type)[..., 0]
        rng[:, mid[ok]] = ((raw & r_mask).astype(np.float64) * r_scale).T
        size = np.dtype(f_type).itemsize
        refl[:, mid[ok]] = pixels[:, :, f_off:f_off + size].copy().view(f_type)[..., 0].astype(np.float64).T
        valid[:, mid[ok]] = True
    return rng, refl, valid


def _xyz_lut(meta: Metadata) -> tuple[np.ndarray, np.ndarray]:
    """(direction, offset), each (height, width, 3) in the sensor frame: xyz_mm = direction * range + offset."""
    encoder = 2 * np.pi * (1.0 - np.arange(meta.width) / meta.width)
    azimuth = -np.radians(meta.azimuth_deg)[:, None]
    altitude = np.radians(meta.altitude_deg)[:, None]
    direction = np.stack([np.cos(encoder + azimuth) * np.cos(altitude), np.sin(encoder + azimuth) * np.cos(altitude),
                          np.broadcast_to(np.sin(altitude), (meta.height, meta.width))], axis=-1)
    bx, bz = meta.beam_to_lidar[0, 3], meta.beam_to_lidar[2, 3]
    n = np.hypot(bx, bz)
    offset = np.stack([np.broadcast_to(np.cos(encoder) * bx, (meta.height, meta.width)),
                       np.broadcast_to(np.sin(encoder) * bx, (meta.height, meta.width)),
                       np.full((meta.height, meta.width), bz)], axis=-1) - direction * n
    rot, shift = meta.lidar_to_sensor[:3, :3], meta.lidar_to_sensor[:3, 3]
    return direction @ rot.T, offset @ rot.T + shift
