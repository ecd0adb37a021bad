"""Bounds checks of a ROS 1 bag, an MCAP file or a ROS 2 sqlite3 bag, before `rosbags` reads it.

`rosbags` trusts what a container says about itself: it inflates a compressed chunk whole, whatever it
expands to, and builds an index entry for every message. So each container is walked first, reading only
record headers (a few bytes each, seeking over the data):

- every record's stated length must fit in the file, and a record's data in `MAX_RECORD_BYTES`;
- every compressed chunk is inflated once, by a streaming decompressor told to stop one byte past the size
  the chunk claims, so a bomb or a lying size is refused after at most that many bytes;
- the messages the indexes list are counted against `MAX_CONTAINER_MESSAGES` before any is read;
- an index pointing anywhere but at a chunk that was checked is refused (a forged chunk inside a message).

A ROS 2 sqlite3 bag is asked for its message count and its largest message through SQL.
"""

from __future__ import annotations

import bz2
import struct
from pathlib import Path
from typing import Any, BinaryIO

import apsw
import lz4.frame

try:
    from compression import zstd
except ImportError:  # Python < 3.14
    from backports import zstd

from lidar.formats.scan import PointCloudError
from lidar.recordings.base import check_message_count, check_record_size

ROS1_MAGIC = b"#ROSBAG V2.0\n"
MCAP_MAGIC = b"\x89MCAP0\r\n"
SQLITE_MAGIC = b"SQLite format 3\x00"
#: Largest header a ROS 1 record may have (a connection's header holds only its topic and id).
MAX_ROS1_HEADER = 1 << 16
#: Bytes inflated at a time while a compressed chunk is checked.
_STEP = 1 << 22


def check_container(path: Path) -> str:
    """The container's kind ("ros1-bag", "mcap" or "ros2-sqlite3") once it passed its checks."""
    with path.open("rb") as f:
        head = f.read(16)
        if head.startswith(ROS1_MAGIC):
            _check_ros1(path, f)
            return "ros1-bag"
        if head.startswith(MCAP_MAGIC):
            _check_mcap(path, f)
            return "mcap"
    if head.startswith(SQLITE_MAGIC):
        _check_sqlite(path)
        return "ros2-sqlite3"
    raise PointCloudError(f"{path}: not a ROS 1 bag, an MCAP file or a ROS 2 sqlite3 bag (no magic number of any)")


def _refuse(path: Path, offset: int, what: str) -> PointCloudError:
    return PointCloudError(f"{path}: {what} at byte {offset:,}; the container is corrupt or crafted")


def _read(f: BinaryIO, size: int, path: Path, offset: int, what: str) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise _refuse(path, offset, f"{what} runs past the end of the file")
    return data


# ROS 1 ------------------------------------------------------------------------------------------------------


def _ros1_fields(header: bytes, path: Path, offset: int) -> dict[str, bytes]:
    fields, at = {}, 0
    while at < len(header):
        if at + 4 > len(header):
            raise _refuse(path, offset, "a record header field runs past its header")
        (length,) = struct.unpack_from("<I", header, at)
        field = header[at + 4:at + 4 + length]
        if len(field) != length or b"=" not in field:
            raise _refuse(path, offset, "a record header field is malformed")
        name, _, value = field.partition(b"=")
        fields[name.decode("latin1")] = value
        at += 4 + length
    return fields


def _check_ros1(path: Path, f: BinaryIO) -> None:
    size = path.stat().st_size
    offset = len(ROS1_MAGIC)
    chunks: set[int] = set()
    listed = indexed = 0
    chunk_positions: list[tuple[int, int]] = []
    while offset < size:
        f.seek(offset)
        (header_len,) = struct.unpack("<I", _read(f, 4, path, offset, "a record"))
        if header_len > MAX_ROS1_HEADER:
            raise _refuse(path, offset, f"a record header of {header_len:,} bytes (at most {MAX_ROS1_HEADER:,})")
        fields = _ros1_fields(_read(f, header_len, path, offset, "a record header"), path, offset)
        (data_len,) = struct.unpack("<I", _read(f, 4, path, offset, "a record"))
        data_at = offset + 8 + header_len
        if data_at + data_len > size:
            raise _refuse(path, offset, f"a record claims {data_len:,} bytes of data past the end of the file")
        check_record_size(path, data_len, "a record")
        op = fields.get("op", b"\x00")[:1]
        if op == b"\x05":
            _check_ros1_chunk(path, f, fields, data_at, data_len)
            chunks.add(offset)
        elif op == b"\x04":
            indexed += _ros1_count(fields, "count", path, offset)
        elif op == b"\x06":
            counts = _read(f, data_len, path, offset, "a chunk info")  # (connection, count) pairs
            listed += sum(struct.unpack_from("<I", counts, at)[0] for at in range(4, data_len - 3, 8))
            chunk_positions.append((offset, _ros1_count(fields, "chunk_pos", path, offset, "<Q")))
        elif op == b"\x02":
            indexed += 1
        check_message_count(path, max(listed, indexed))
        offset = data_at + data_len
    stray = [at for at, pos in chunk_positions if pos not in chunks]
    if stray:
        raise _refuse(path, stray[0], "a chunk info points at no chunk")


def _ros1_count(fields: dict[str, bytes], name: str, path: Path, offset: int, fmt: str = "<I") -> int:
    value = fields.get(name, b"")
    if len(value) != struct.calcsize(fmt):
        raise _refuse(path, offset, f"a record without a {name} field")
    return int(struct.unpack(fmt, value)[0])


def _check_ros1_chunk(path: Path, f: BinaryIO, fields: dict[str, bytes], data_at: int, data_len: int) -> None:
    compression = fields.get("compression", b"").decode("latin1")
    claimed = _ros1_count(fields, "size", path, data_at)
    check_record_size(path, claimed, "a chunk")
    if compression == "none":
        if claimed != data_len:
            raise _refuse(path, data_at, f"an uncompressed chunk of {data_len:,} bytes claims {claimed:,}")
        return
    if compression == "bz2":
        decompressor: Any = bz2.BZ2Decompressor()
    elif compression == "lz4":
        decompressor = lz4.frame.LZ4FrameDecompressor()
    else:
        raise _refuse(path, data_at, f"a chunk compressed with {compression!r} (expected none, bz2 or lz4)")
    f.seek(data_at)
    _inflate_bounded(path, f, data_len, claimed, decompressor, data_at)


# MCAP -------------------------------------------------------------------------------------------------------

_CHUNK, _MESSAGE_INDEX, _CHUNK_INDEX, _MESSAGE, _FOOTER = 0x06, 0x07, 0x08, 0x05, 0x02


def _check_mcap(path: Path, f: BinaryIO) -> None:
    size = path.stat().st_size
    offset = len(MCAP_MAGIC)
    chunks: dict[int, int] = {}  # chunk offset -> its checked uncompressed size
    messages = 0
    indexed: list[tuple[int, int, int]] = []  # (chunk index offset, chunk offset, uncompressed size)
    while offset + 9 <= size:
        f.seek(offset)
        op, length = struct.unpack("<BQ", _read(f, 9, path, offset, "a record"))
        body_at = offset + 9
        if body_at + length > size:
            raise _refuse(path, offset, f"a record claims {length:,} bytes past the end of the file")
        if op == _CHUNK:
            chunks[offset] = _check_mcap_chunk(path, f, body_at, length)
        elif op == _MESSAGE_INDEX:
            body = _read(f, min(length, 6), path, offset, "a message index")
            if len(body) == 6:
                messages += struct.unpack_from("<I", body, 2)[0] // 16
        elif op == _MESSAGE:
            messages += 1
        elif op == _CHUNK_INDEX:
            body = _read(f, min(length, 48), path, offset, "a chunk index")
            if len(body) < 48:
                raise _refuse(path, offset, "a short chunk index")
            chunk_at, = struct.unpack_from("<Q", body, 16)
            uncompressed = _mcap_index_uncompressed(path, f, body_at, length, offset)
            indexed.append((offset, chunk_at, uncompressed))
        elif op == _FOOTER:
            break
        else:
            check_record_size(path, length, "a record")
        check_message_count(path, messages)
        offset = body_at + length
    for at, chunk_at, uncompressed in indexed:
        if chunks.get(chunk_at) != uncompressed:
            raise _refuse(path, at, "a chunk index points at no checked chunk, or states another size")


def _mcap_index_uncompressed(path: Path, f: BinaryIO, body_at: int, length: int, offset: int) -> int:
    """A chunk index's uncompressed size: after its map of message index offsets and the compression name."""
    f.seek(body_at + 32)
    (map_len,) = struct.unpack("<I", _read(f, 4, path, offset, "a chunk index"))
    tail_at = body_at + 36 + map_len + 8
    if tail_at + 4 > body_at + length:
        raise _refuse(path, offset, "a chunk index's offsets run past it")
    f.seek(tail_at)
    (name_len,) = struct.unpack("<I", _read(f, 4, path, offset, "a chunk index"))
    f.seek(tail_at + 4 + name_len)
    _, uncompressed = struct.unpack("<QQ", _read(f, 16, path, offset, "a chunk index"))
    return int(uncompressed)


def _check_mcap_chunk(path: Path, f: BinaryIO, body_at: int, length: int) -> int:
    head = _read(f, 32, path, body_at, "a chunk header")
    _, _, claimed, _, name_len = struct.unpack("<QQQII", head)
    check_record_size(path, claimed, "a chunk")
    compression = _read(f, name_len, path, body_at, "a chunk header").decode("latin1")
    (records_len,) = struct.unpack("<Q", _read(f, 8, path, body_at, "a chunk header"))
    if 32 + name_len + 8 + records_len > length:
        raise _refuse(path, body_at, "a chunk's records run past it")
    if compression == "":
        if records_len != claimed:
            raise _refuse(path, body_at, f"an uncompressed chunk of {records_len:,} bytes claims {claimed:,}")
        return int(claimed)
    if compression == "zstd":
        decompressor: Any = zstd.ZstdDecompressor()
    elif compression == "lz4":
        decompressor = lz4.frame.LZ4FrameDecompressor()
    else:
        raise _refuse(path, body_at, f"a chunk compressed with {compression!r} (expected zstd, lz4 or none)")
    _inflate_bounded(path, f, records_len, claimed, decompressor, body_at)
    return int(claimed)


# shared -----------------------------------------------------------------------------------------------------


def _inflate_bounded(path: Path, f: BinaryIO, compressed: int, claimed: int, decompressor: Any, offset: int) -> None:
    """Inflate `compressed` bytes from `f` with a streaming `decompressor` (bz2, lz4 or zstd), refusing the
    chunk once it yields more than `claimed` bytes or ends short of them: at most `claimed` + 1 bytes are
    produced, and none is kept."""
    produced, left = 0, compressed
    try:
        while True:
            data = f.read(min(_STEP, left))
            left -= len(data)
            produced += len(decompressor.decompress(data, claimed + 1 - produced))
            while produced <= claimed and not decompressor.needs_input and not decompressor.eof:
                out = decompressor.decompress(b"", claimed + 1 - produced)
                if not out:
                    break
                produced += len(out)
            if produced > claimed or left <= 0 or not data or decompressor.eof:
                break
    except (OSError, ValueError, EOFError, RuntimeError, zstd.ZstdError, lz4.frame.LZ4FrameError) as err:
        raise _refuse(path, offset, f"a compressed chunk that does not inflate ({err})") from None
    if produced != claimed:
        more = "more than" if produced > claimed else f"{produced:,} bytes, not"
        raise _refuse(path, offset, f"a compressed chunk inflates to {more} the {claimed:,} bytes it claims")


# ROS 2 sqlite3 ----------------------------------------------------------------------------------------------


def _check_sqlite(path: Path) -> None:
    try:
        db = apsw.Connection(f"file:{path}?mode=ro&immutable=1", flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI)
        try:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not {"messages", "topics"} <= tables:
                raise PointCloudError(f"{path}: an sqlite3 file without the messages and topics tables of a ROS 2 bag")
            count, largest = db.execute("SELECT COUNT(*), MAX(LENGTH(data)) FROM messages").fetchone()
        finally:
            db.close()
    except apsw.Error as err:
        raise PointCloudError(f"{path}: not a readable sqlite3 ROS 2 bag ({type(err).__name__})") from None
    check_message_count(path, int(count or 0))
    check_record_size(path, int(largest or 0), "a message")

