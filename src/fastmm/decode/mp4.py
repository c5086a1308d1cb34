"""Leave out the H.264 and HEVC frames a clip neither shows nor needs, before FFmpeg decodes them.

FFmpeg decodes every frame from the keyframe before a clip to its last frame, and the frames
decoded after that until the decoder's reordering lets the last one out. A non-reference frame
is never used to predict another one, so if the clip does not return it, it can go, as can
every frame after the clip's last in decode order (the decoder's flush at the end of the file
lets the rest out): the frames returned are bit-identical. Non-reference means: in H.264,
every slice has ``nal_ref_idc`` 0 (7.4.1); in HEVC, a sub-layer non-reference slice type
(TRAIL_N, TSA_N, ...) in a stream of one temporal sub-layer (7.4.2.2). With x264's default
B-frames that is about a third of the frames decoded for a clip taking every 2nd frame.

:func:`slim_clip` rewrites the video track's sample tables in memory so those samples are
gone. No sample moves: the old ``moov`` box becomes a ``free`` box and the new one is appended.
Anything it does not know for sure (fragmented MP4, not H.264 in ``avcC`` or HEVC of one
sub-layer in ``hvcC``, an edit list
other than one plain entry, not exactly one video track, tables that disagree) gives None, and
the clip is decoded from the file as it is. The caller checks the result against what the
decoder reports and falls back the same way.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np


class Track(NamedTuple):
    """The video track of an MP4, sample by sample in decode order."""

    timescale: int
    sizes: np.ndarray      # bytes of each sample
    offsets: np.ndarray    # file offset of each sample
    dts: np.ndarray        # decode time, in timescale units
    cts: np.ndarray        # composition offset: presentation time = dts + cts
    sync: np.ndarray | None  # 1-based keyframe sample numbers; None: every sample is one
    codec: str             # "h264" or "hevc"
    nal_length: int        # bytes of the length before each NAL unit (avcC, hvcC)
    media_time: int        # the edit list's start: FFmpeg's timestamps are pts - media_time
    path: tuple[tuple[bytes, int, int, int], ...]  # (type, start, payload, end): moov ... stbl
    last_duration: int     # duration of the last sample (stts)

    @property
    def moov(self) -> tuple[int, int]:
        """Where the moov box is: (start, end)."""
        return self.path[0][1], self.path[0][3]

    @property
    def num_frames(self) -> int:
        return len(self.sizes)

    @property
    def pts(self) -> np.ndarray:
        return self.dts + self.cts

    def average_fps(self) -> float | None:
        """Frames per second as torchcodec's exact mode counts them (frames over the span of
        presentation times), so a clip's frame choice is the same either way."""
        durations = np.diff(self.dts, append=self.dts[-1] + self.last_duration)
        begin = (int(self.pts.min()) - self.media_time) / self.timescale
        end = (int((self.pts + durations).max()) - self.media_time) / self.timescale
        return self.num_frames / (end - begin) if end != begin else None


def _boxes(data, start: int, end: int):
    """(type, box start, payload start, box end) of each box in data[start:end]."""
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, start)
        header = 8
        if size == 1:
            if start + 16 > end:
                raise ValueError("box header cut short")
            size, header = struct.unpack_from(">Q", data, start + 8)[0], 16
        elif size == 0:  # "to the end of the file": nothing could be appended after it
            raise ValueError(f"box {kind!r} of size 0")
        if size < header or start + size > end:
            raise ValueError(f"box {kind!r} runs past its parent")
        yield kind, start, start + header, start + size
        start += size


def _children(data, start: int, end: int) -> dict:
    found = {}
    for kind, box, payload, stop in _boxes(data, start, end):
        found.setdefault(kind, []).append((box, payload, stop))
    return found


def _one(children: dict, kind: bytes):
    boxes = children.get(kind, [])
    if len(boxes) != 1:
        raise ValueError(f"{len(boxes)} {kind!r} boxes")
    return boxes[0]


def _table(data, payload: int, stop: int, fields: int, dtype=">u4") -> np.ndarray:
    """A full box's entry table: version and flags, count, then count entries of ``fields``
    32-bit words.

    Args:
        data: the MP4's bytes.
        payload: where the table starts (the full box's version and flags).
        stop: where the box ends; a table that runs past it is a ValueError.
        fields: 32-bit words per entry.
        dtype: how a word is read (big-endian unsigned; ">i4" for signed offsets).
    """
    count = struct.unpack_from(">I", data, payload + 4)[0]
    first = payload + 8
    if first + count * fields * 4 > stop:
        raise ValueError("table longer than its box")
    return np.frombuffer(data, dtype, count * fields, first).reshape(count, fields)


def parse(data: bytes) -> Track | None:
    """The one video track of an MP4 (H.264 or HEVC), or None where :func:`slim_clip` can't
    be sure of it."""
    try:
        return _parse(data)
    except (ValueError, struct.error, IndexError):
        return None


def _parse(data: bytes) -> Track | None:
    top = _children(data, 0, len(data))
    if b"moof" in top:
        return None  # fragmented
    if max(stop for boxes in top.values() for _, _, stop in boxes) != len(data):
        return None  # bytes after the last box: a moov appended after them would not be read
    moov = _one(top, b"moov")
    videos = []
    for trak in _children(data, moov[1], moov[2]).get(b"trak", []):
        mdia = _one(_children(data, trak[1], trak[2]), b"mdia")
        hdlr = _one(_children(data, mdia[1], mdia[2]), b"hdlr")
        if data[hdlr[1] + 8:hdlr[1] + 12] == b"vide":
            videos.append(trak)
    if len(videos) != 1:
        return None
    trak = videos[0]
    trak_kids = _children(data, trak[1], trak[2])
    mdia = _one(trak_kids, b"mdia")
    mdia_kids = _children(data, mdia[1], mdia[2])
    mdhd = _one(mdia_kids, b"mdhd")
    version = data[mdhd[1]]
    timescale = struct.unpack_from(">I", data, mdhd[1] + (20 if version == 1 else 12))[0]
    if timescale == 0:
        return None
    minf = _one(mdia_kids, b"minf")
    stbl = _one(_children(data, minf[1], minf[2]), b"stbl")
    tables = _children(data, stbl[1], stbl[2])

    stsd = _one(tables, b"stsd")
    entry = next(_boxes(data, stsd[1] + 8, stsd[2]))
    if struct.unpack_from(">I", data, stsd[1] + 4)[0] != 1:
        return None  # not one sample description
    config = _children(data, entry[2] + 78, entry[3])  # after the visual sample entry fields
    if entry[0] in (b"avc1", b"avc3"):
        codec, nal_length = "h264", (data[_one(config, b"avcC")[1] + 4] & 3) + 1
    elif entry[0] in (b"hvc1", b"hev1"):
        info = data[_one(config, b"hvcC")[1] + 21]
        if info >> 3 & 7 != 1:
            return None  # temporal sub-layers: a sub-layer non-reference frame may be referenced
        codec, nal_length = "hevc", (info & 3) + 1
    else:
        return None

    stsz = _one(tables, b"stsz")
    fixed, count = struct.unpack_from(">II", data, stsz[1] + 4)
    if count > len(data):  # every sample takes a byte at least: a damaged count
        return None
    if fixed:
        sizes = np.full(count, fixed, np.int64)
    else:
        sizes = _table(data, stsz[1] + 4, stsz[2], 1).reshape(-1).astype(np.int64)  # after size
    n = len(sizes)
    if n == 0:
        return None
    offsets = _sample_offsets(data, tables, sizes)
    if offsets.min() < 0 or int((offsets + sizes).max()) > len(data):
        return None
    if ((offsets < moov[2]) & (offsets + sizes > moov[0])).any():
        return None  # a sample inside the moov box, whose type slim_clip rewrites
    stts = _table(data, *_one(tables, b"stts")[1:], 2).astype(np.int64)
    if stts[:, 0].sum() != n:  # checked before the table is expanded
        return None
    deltas = np.repeat(stts[:, 1], stts[:, 0])
    dts = np.concatenate(([0], np.cumsum(deltas[:-1])))
    cts = np.zeros(n, np.int64)
    if b"ctts" in tables:
        box = _one(tables, b"ctts")
        ctts = _table(data, box[1], box[2], 2, dtype=">i4" if data[box[1]] == 1 else ">u4")
        counts = ctts[:, 0].astype(np.int64)
        if counts.min(initial=0) < 0 or counts.sum() != n:
            return None
        cts = np.repeat(ctts[:, 1].astype(np.int64), counts)
    sync = None
    if b"stss" in tables:
        box = _one(tables, b"stss")
        sync = _table(data, box[1], box[2], 1).reshape(-1).astype(np.int64)
        if len(sync) == 0 or sync.min() < 1 or sync.max() > n:
            return None
    media_time = 0
    if b"edts" in trak_kids:
        edts = _one(trak_kids, b"edts")
        elst = _one(_children(data, edts[1], edts[2]), b"elst")
        if data[elst[1]] != 0 or struct.unpack_from(">I", data, elst[1] + 4)[0] != 1:
            return None  # version 1, or not exactly one edit
        media_time, rate = struct.unpack_from(">iI", data, elst[1] + 12)
        if media_time < 0 or rate != 0x10000:
            return None
    path = tuple((bytes(data[box[0] + 4:box[0] + 8]), *box)
                 for box in (moov, trak, mdia, minf, stbl))
    return Track(timescale, sizes, offsets, dts, cts, sync, codec, nal_length, media_time, path,
                 int(deltas[-1]))


def _sample_offsets(data, tables, sizes: np.ndarray) -> np.ndarray:
    if b"co64" in tables:
        box = _one(tables, b"co64")
        chunks = _table(data, box[1], box[2], 2).astype(np.int64)
        chunks = (chunks[:, 0] << 32) | chunks[:, 1]
    else:
        box = _one(tables, b"stco")
        chunks = _table(data, box[1], box[2], 1).reshape(-1).astype(np.int64)
    box = _one(tables, b"stsc")
    stsc = _table(data, box[1], box[2], 3).astype(np.int64)
    if len(stsc) == 0 or stsc[0, 0] != 1 or (np.diff(stsc[:, 0]) <= 0).any() \
            or stsc[-1, 0] > len(chunks) or (stsc[:, 1] < 1).any():
        raise ValueError("bad stsc")
    runs = np.diff(np.append(stsc[:, 0], len(chunks) + 1))  # chunks per stsc entry
    per_chunk = np.repeat(stsc[:, 1], runs)
    if per_chunk.sum() != len(sizes):
        raise ValueError("chunks and samples disagree")
    chunk_of = np.repeat(np.arange(len(chunks)), per_chunk)
    first = np.concatenate(([0], np.cumsum(per_chunk)[:-1]))  # first sample of each chunk
    before = np.cumsum(sizes) - sizes  # bytes of all earlier samples
    return chunks[chunk_of] + before - before[first[chunk_of]]


_HEVC_SUB_LAYER_NON_REFERENCE = {0, 2, 4, 6, 8, 10, 12, 14}  # TRAIL_N, TSA_N, ... RSV_VCL_N14


def is_reference(data: bytes, offset: int, size: int, codec: str, nal_length: int) -> bool:
    """Whether a sample's first slice may be used to predict other frames; True when it can't
    tell.

    Args:
        data: the MP4's bytes.
        offset: where the sample starts in ``data``.
        size: the sample's bytes.
        codec: "h264" or "hevc".
        nal_length: bytes of the length before each NAL unit (the track's avcC or hvcC).
    """
    end, pos = offset + size, offset
    while pos + nal_length + 1 < end:
        length = int.from_bytes(data[pos:pos + nal_length], "big")
        header = data[pos + nal_length]
        if codec == "h264" and header & 0x1F in (1, 5):  # a slice: non-IDR or IDR
            return header & 0x60 != 0  # nal_ref_idc
        if codec == "hevc" and header >> 1 < 32:  # a slice (VCL NAL unit types 0-31)
            temporal_id = (data[pos + nal_length + 1] & 7) - 1
            return header >> 1 not in _HEVC_SUB_LAYER_NON_REFERENCE or temporal_id != 0
        pos += nal_length + length
    return True


class Slim(NamedTuple):
    data: bytes           # the MP4 without the samples left out
    indices: list[int]    # the clip's frames, numbered in the slim file
    pts_seconds: list[float]  # what the decoder must report for them
    num_frames: int       # frames in the slim file
    dropped: int          # samples left out


def slim_clip(data: bytes, track: Track, wanted: list[int]) -> Slim | None:
    """``data`` without the samples the clip's frames (``wanted``: indices in presentation
    order) don't need: the non-reference ones between its keyframe and its last frame that it
    does not show, and every one after its last frame in decode order. None when there are
    none, or the tables can't be rewritten."""
    try:
        return _slim_clip(data, track, wanted)
    except (ValueError, IndexError, struct.error, OverflowError):
        return None


def _slim_clip(data: bytes, track: Track, wanted: list[int]) -> Slim | None:
    order = np.argsort(track.pts, kind="stable")  # sample of each frame, presentation order
    need = order[np.asarray(wanted, np.int64)]
    keyframes = (track.sync - 1) if track.sync is not None else np.arange(track.num_frames)
    start = keyframes[keyframes <= need.min()]
    if len(start) == 0:
        return None
    first, last = int(start.max()), int(need.max())
    keep = np.ones(track.num_frames, bool)
    keep[last + 1:] = False  # decoded after the clip's last frame: the decoder's flush gives it
    needed = set(need.tolist()) | set(keyframes.tolist())
    for s in range(first, last + 1):
        if s not in needed and not is_reference(data, int(track.offsets[s]), int(track.sizes[s]),
                                                track.codec, track.nal_length):
            keep[s] = False
    dropped = int((~keep).sum())
    if dropped == 0:
        return None
    moov = _slim_moov(data, track, keep)
    moov_at, view = track.moov[0], memoryview(data)  # slices of a view: one copy, in join
    slim = b"".join((view[:moov_at + 4], b"free", view[moov_at + 8:], moov))
    kept_pts = track.pts[keep]
    rank = np.argsort(np.argsort(kept_pts, kind="stable"), kind="stable")
    new_index = np.cumsum(keep) - 1  # sample number in the slim file, decode order
    return Slim(slim, [int(rank[new_index[s]]) for s in need],
                [(int(track.pts[s]) - track.media_time) / track.timescale for s in need],
                int(keep.sum()), dropped)


def _full_box(kind: bytes, payload: bytes, version_flags: int = 0) -> bytes:
    return struct.pack(">I4sI", 12 + len(payload), kind, version_flags) + payload


def _runs(values: np.ndarray) -> np.ndarray:
    """Run-length pairs (count, value), as stts and ctts store them."""
    starts = np.flatnonzero(np.diff(values, prepend=values[0] - 1))
    counts = np.diff(np.append(starts, len(values)))
    return np.stack([counts, values[starts]], 1)


def _slim_moov(data: bytes, track: Track, keep: np.ndarray) -> bytes:
    """The moov box with the video track's sample tables cut down to ``keep``."""
    n = int(keep.sum())
    dts = track.dts[keep]
    ends = np.append(track.dts[1:], track.dts[-1] + track.last_duration)  # of each sample
    deltas = np.diff(dts, append=ends[np.flatnonzero(keep)[-1]])
    cts = track.cts[keep]
    signed = cts.min() < 0
    offsets = track.offsets[keep]
    if deltas.max() >= 2**32 or cts.min() < -2**31 or cts.max() >= 2**31 << (not signed):
        raise ValueError("times that the tables can't hold")
    stts = _runs(deltas)
    tables = [_full_box(b"stts", struct.pack(">I", len(stts)) + stts.astype(">u4").tobytes())]
    if track.cts.any():
        ctts = _runs(cts)
        tables.append(_full_box(b"ctts", struct.pack(">I", len(ctts))
                                + ctts.astype(">i4" if signed else ">u4").tobytes(),
                                1 << 24 if signed else 0))
    tables.append(_full_box(b"stsc", struct.pack(">IIII", 1, 1, 1, 1)))  # one sample per chunk
    tables.append(_full_box(b"stsz", struct.pack(">II", 0, n)
                            + track.sizes[keep].astype(">u4").tobytes()))
    if offsets.max() < 2**32:
        tables.append(_full_box(b"stco", struct.pack(">I", n) + offsets.astype(">u4").tobytes()))
    else:
        tables.append(_full_box(b"co64", struct.pack(">I", n) + offsets.astype(">u8").tobytes()))
    if track.sync is not None:
        new_number = np.cumsum(keep)  # 1-based number of each kept sample in the slim file
        sync = new_number[track.sync[keep[track.sync - 1]] - 1]
        tables.append(_full_box(b"stss", struct.pack(">I", len(sync)) + sync.astype(">u4").tobytes()))

    # stbl keeps what is not per sample (stsd); then each enclosing box is rebuilt around
    # its new child: its bytes before the child, the child, its bytes after
    per_sample = {b"stts", b"ctts", b"stsc", b"stsz", b"stz2", b"stco", b"co64", b"stss", b"sdtp",
                  b"sbgp", b"sgpd", b"stps", b"subs", b"saiz", b"saio", b"cslg"}
    _, _, stbl_payload, stbl_end = track.path[-1]
    body = b"".join(bytes(data[box:stop]) for kind, box, _, stop in
                    _boxes(data, stbl_payload, stbl_end) if kind not in per_sample)
    box = _box(b"stbl", body + b"".join(tables))
    for (kind, _, payload, end), (_, child_at, _, child_end) in zip(track.path[-2::-1],
                                                                   track.path[:0:-1]):
        box = _box(kind, bytes(data[payload:child_at]) + box + bytes(data[child_end:end]))
    return box


def _box(kind: bytes, payload: bytes) -> bytes:
    if len(payload) + 8 < 2**32:
        return struct.pack(">I4s", len(payload) + 8, kind) + payload
    return struct.pack(">I4sQ", 1, kind, len(payload) + 16) + payload
