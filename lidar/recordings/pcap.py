"""The UDP payloads of a classic pcap capture, read record by record within fixed bounds.

A sensor's pcap is what `tcpdump` or Wireshark saved from its Ethernet port: one record per frame, each an
Ethernet (or Linux cooked, or raw IP) frame holding an IPv4 datagram. LiDARs send UDP; a datagram larger
than the link's MTU (an Ouster lidar packet of 8-25 KB) arrives as IP fragments, reassembled here.

Bounded by construction: every record's stated length is checked against the file and `MAX_FRAME_BYTES`
before it is read, the records are counted against `MAX_PCAP_RECORDS`, and at most
`MAX_OPEN_FRAGMENTS` datagrams may wait for their missing fragments at once. pcapng is refused by name.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lidar.formats.scan import PointCloudError

#: Most records a capture may hold: an HDL-64E sends ~3,500 packets a second, so this is about 95 minutes of
#: one (records are streamed, so the bound is on time: ~2 s a million).
MAX_PCAP_RECORDS = 20_000_000
#: Largest frame a pcap record may hold (an IPv4 datagram is at most 64 KB; jumbo frames 9 KB).
MAX_FRAME_BYTES = 1 << 17
#: Datagrams whose fragments may be pending at once; older ones are dropped unassembled.
MAX_OPEN_FRAGMENTS = 64
_MAGIC = {
    b"\xd4\xc3\xb2\xa1": ("<", 1_000), b"\xa1\xb2\xc3\xd4": (">", 1_000),  # microsecond stamps
    b"\x4d\x3c\xb2\xa1": ("<", 1), b"\xa1\xb2\x3c\x4d": (">", 1),  # nanosecond stamps
}
_PCAPNG = b"\x0a\x0d\x0d\x0a"
#: Link types: Ethernet, raw IPv4 (two numbers), Linux cooked capture v1.
_ETHERNET, _RAW, _RAW_IPV4, _LINUX_SLL = 1, 101, 228, 113


@dataclass
class _Fragments:
    """The fragments of one datagram seen so far, by offset; `total` is known once the last one arrives."""

    parts: dict[int, bytes]
    total: int | None = None
    held: int = 0


@dataclass(frozen=True)
class Datagram:
    """One UDP payload and where it came from: capture time (ns), ports, and the file offset of its record."""

    stamp_ns: int
    src_port: int
    dst_port: int
    payload: bytes
    offset: int


def is_pcap(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(4)
    return head in _MAGIC or head == _PCAPNG


def datagrams(path: Path, start: int | None = None) -> Iterator[Datagram]:
    """The UDP datagrams of `path` in capture order, from the record at byte `start` (default: the first)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        endian, ns_per_tick, link = _header(path, f.read(24))
        pending: dict[tuple[bytes, int], _Fragments] = {}
        records = 0
        if start is not None:
            f.seek(start)
        while True:
            offset = f.tell()
            head = f.read(16)
            if len(head) < 16:
                return
            seconds, ticks, stored, _ = struct.unpack(endian + "IIII", head)
            if stored > MAX_FRAME_BYTES or offset + 16 + stored > size:
                raise PointCloudError(
                    f"{path}: the record at byte {offset:,} claims {stored:,} bytes, past the end of the file or the "
                    f"{MAX_FRAME_BYTES:,}-byte frame limit; expected a pcap of network frames"
                )
            records += 1
            if records > MAX_PCAP_RECORDS:
                raise PointCloudError(f"{path}: over {MAX_PCAP_RECORDS:,} records; a capture may hold at most that "
                                      "(split it: editcap -c)")
            frame = f.read(stored)
            datagram = _udp(frame, link, pending)
            if datagram is not None:
                src, dst, payload = datagram
                yield Datagram(seconds * 1_000_000_000 + ticks * ns_per_tick, src, dst, payload, offset)


def _header(path: Path, head: bytes) -> tuple[str, int, int]:
    if head[:4] == _PCAPNG:
        raise PointCloudError(f"{path}: a pcapng capture; expected a classic pcap (save it as pcap: editcap -F pcap)")
    if len(head) < 24 or head[:4] not in _MAGIC:
        raise PointCloudError(f"{path}: not a pcap capture (no pcap magic number); expected a sensor's pcap")
    endian, ns_per_tick = _MAGIC[head[:4]]
    link = struct.unpack(endian + "I", head[20:24])[0] & 0x0FFFFFFF
    if link not in (_ETHERNET, _RAW, _RAW_IPV4, _LINUX_SLL):
        raise PointCloudError(f"{path}: link type {link}; expected Ethernet, Linux cooked or raw IPv4 frames")
    return endian, ns_per_tick, link


def _udp(frame: bytes, link: int, pending: dict[tuple[bytes, int], _Fragments]) -> tuple[int, int, bytes] | None:
    """(source port, destination port, payload) of a frame's UDP datagram, once all its fragments are in."""
    ip = _ipv4(frame, link)
    if ip is None or len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 17:  # IPv4 carrying UDP
        return None
    header = (ip[0] & 0x0F) * 4
    total = min(struct.unpack(">H", ip[2:4])[0], len(ip))
    flags_offset = struct.unpack(">H", ip[6:8])[0]
    more, fragment_offset = flags_offset & 0x2000, (flags_offset & 0x1FFF) * 8
    body = ip[header:total]
    if more or fragment_offset:
        body = _reassemble(ip, fragment_offset, bool(more), body, pending)
        if body is None:
            return None
    if len(body) < 8:
        return None
    src, dst, length = struct.unpack(">HHH", body[:6])
    return src, dst, body[8:max(8, min(length, len(body)))]


def _ipv4(frame: bytes, link: int) -> bytes | None:
    if link == _ETHERNET:
        start, ethertype = 14, frame[12:14]
        while ethertype == b"\x81\x00" and len(frame) >= start + 4:  # VLAN tags
            ethertype, start = frame[start + 2:start + 4], start + 4
        return frame[start:] if ethertype == b"\x08\x00" else None
    if link == _LINUX_SLL:
        return frame[16:] if frame[14:16] == b"\x08\x00" else None
    return frame


def _reassemble(ip: bytes, offset: int, more: bool, body: bytes, pending: dict[tuple[bytes, int], _Fragments]) -> bytes | None:
    """The whole datagram once its last fragment is in and no gap is left; None while parts are missing."""
    key = (ip[12:20], struct.unpack(">H", ip[4:6])[0])  # source, destination and identification
    entry = pending.setdefault(key, _Fragments({}))
    entry.parts[offset] = body
    entry.held += len(body)
    if not more:
        entry.total = offset + len(body)
    if entry.held > 2 * MAX_FRAME_BYTES:  # overlapping fragments past any real datagram
        del pending[key]
        return None
    if len(pending) > MAX_OPEN_FRAGMENTS:
        del pending[next(k for k in pending if k != key)]
    if entry.total is None or not _contiguous(entry.parts, entry.total):
        return None
    del pending[key]
    return b"".join(entry.parts[k] for k in sorted(entry.parts))


def _contiguous(parts: dict[int, bytes], total: int) -> bool:
    position = 0
    for start in sorted(parts):
        if start != position:
            return False
        position += len(parts[start])
    return position == total
