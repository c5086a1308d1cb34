"""Coverage-guided fuzzing (atheris, libFuzzer) of the parsers that read bytes fastmm did not
write, and of the C++ core against its pure-Python twin.

    python fuzz/fuzz.py TARGET [libFuzzer options]    e.g.  -runs=20000  -max_total_time=600

Targets:
  tar     the tar reader (sources/shards.iter_members) on any bytes: it ends, every member lies
          inside the file in order, damage is reported as the last member, nothing raises.
  index   the shard index cache read back from beside a shard: any bytes there are either a
          valid index of that shard or ignored (the shard is scanned again); reads never fail.
  gather  fastmm._C.gather against the twin on any buffer sizes, offsets and strides (full
          64-bit range): the same bytes written or the same error, never a crash.
  planes  fastmm._C.planes against the twin and NumPy on channels-last views of any shape,
          crop and step (and on views it must refuse): the same bytes or the same error.
  layout  the slab layout tables a worker sends with a batch (collate.unpack): any table gives
          tensors inside the slabs they name or a ValueError, never a read outside them.
  state   a loader's state_dict damaged a field at a time (a checkpoint edited or cut):
          load_state_dict raises ValueError, or what it loads can be applied.
  keys    hostile name lists in a published manifest, staged with and without extract: only
          names that pass the one check are copied, every other is counted by name, and nothing
          is written, replaced or deleted outside the staging directory.
  mp4     the MP4 sample tables the torchcodec backend slims (decode.mp4, H.264 and HEVC
          seeds) on any bytes: parse
          gives None or samples inside the file; a slimmed file parses again with the clip's
          frames, byte for byte, at the indices it names; nothing raises.

A crash or a hang (-timeout, default 10 s here) writes the input to crash-*/timeout-* and exits
non-zero. The seeds (valid tars of each format, a real index, real layouts) are made at start.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import json
import math
import os
import shutil
import struct
import sys
import tarfile
import tempfile
import zlib

import atheris
import numpy as np

with atheris.instrument_imports(include=["fastmm"]):
    import torch

    import fastmm
    from fastmm import _twin, collate, resume
    from fastmm._messages import Inline, InSlab, Packed, TensorSpec
    from fastmm.decode import mp4
    from fastmm.sources import SourceError, StagedSource
    from fastmm.sources.base import name_problem
    from fastmm.sources.shards import ShardSource, _valid_index, iter_members

    try:
        from fastmm import _C
    except ImportError:
        _C = None


# -- tar ---------------------------------------------------------------------------------------


class _MemFile:
    """One in-memory file reused for every input (a real fd: the reader fstat()s it)."""

    def __init__(self):
        self.f = os.fdopen(os.memfd_create("fastmm-fuzz"), "w+b", buffering=0)

    def load(self, data: bytes):
        self.f.seek(0)
        self.f.truncate(0)
        self.f.write(data)
        self.f.seek(0)
        return self.f


def _tar(members, fmt) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tar_seeds() -> list[bytes]:
    long = "d/" * 60 + "sample.jpg"
    members = [("a.jpg", b"\xff\xd8" * 300), ("a.txt", b"caption"), ("b.cls", b"3"), (long, b"x")]
    odd = [("é" * 40 + ".jpg", b"1" * 700), ("b.txt", b"2")]  # non-ASCII: a pax header
    tars = [_tar(members, tarfile.GNU_FORMAT), _tar(members, tarfile.PAX_FORMAT),
            _tar(members[:3], tarfile.USTAR_FORMAT), _tar(odd, tarfile.PAX_FORMAT),
            _tar(odd, tarfile.GNU_FORMAT)]
    return tars + [b"\1" + t for t in tars]


_mem = None


def _with_checksums(data: bytes) -> bytes:
    """Every whole 512-byte block given a valid header checksum, so mutations get past it."""
    out = bytearray(data)
    for pos in range(0, len(out) - 511, 512):
        out[pos + 148 : pos + 156] = b" " * 8
        out[pos + 148 : pos + 156] = b"%06o\0 " % sum(out[pos : pos + 512])
    return bytes(out)


def tar_one(data: bytes) -> None:
    global _mem
    _mem = _mem or _MemFile()
    if data[:1] and data[0] & 1:  # half the inputs: as they come; half: checksums made valid
        data = _with_checksums(data[1:])
    f = _mem.load(data)
    last_header = -1
    members = list(iter_members(f, read_data=True, max_member_bytes=1 << 16))
    for i, m in enumerate(members):
        if m.problem is not None:
            assert i == len(members) - 1, "damage must end the listing"
            continue
        assert last_header < m.header_offset < m.data_offset <= len(data), m
        assert m.data_offset + m.size <= len(data), m
        if m.kind == "file" and m.data is not None:
            assert len(m.data) == m.size
        last_header = m.header_offset


# -- index -------------------------------------------------------------------------------------


class _IndexTarget:
    def __init__(self):
        self.dir = os.path.join(tempfile.gettempdir(), "fastmm-fuzz-index-shard")
        os.makedirs(self.dir, exist_ok=True)
        self.shard = os.path.join(self.dir, "s.tar")
        with open(self.shard, "wb") as f:
            members = [(f"{k}.{e}", f"{k}-{e}".encode() * 7) for k in "abc" for e in ("jpg", "txt")]
            f.write(_tar(members, tarfile.USTAR_FORMAT))
        self.size = os.path.getsize(self.shard)
        self.cache = os.path.join(self.dir, ".s.tar.fastmm-idx.json")
        truth = ShardSource(self.shard, index_cache="beside")
        self.expected = [(k, truth.read(i).members) for i, k in enumerate(truth.keys())]
        with open(self.cache, "rb") as f:
            self.saved = json.load(f)
        self.seed = b"\1" + json.dumps(self.saved["entries"]).encode()

    def one(self, data: bytes) -> None:
        entries = None
        if data[:1] and data[0] & 1:  # half the inputs: entries under the shard's true stamp
            try:
                entries = json.loads(data[1:])
                data = json.dumps({"stamp": self.saved["stamp"], "entries": entries}).encode()
            except (ValueError, RecursionError):
                pass
        with open(self.cache, "wb") as f:
            f.write(data)
        source = ShardSource(self.shard, index_cache="beside", on_error="raise")
        got = []
        for i, key in enumerate(source.keys()):
            try:
                got.append((key, source.read(i).members))
            except SourceError:  # what a valid-looking index may still claim (a damaged sample)
                got.append((key, None))
        if not _valid_index(entries, self.size):  # ignored: the shard was scanned again
            assert got == self.expected, got
        for key, members in got:  # whatever a valid index says, only the shard's bytes come out
            for value in (members or {}).values():
                assert isinstance(value, bytes) and len(value) <= self.size


_index = None


def index_one(data: bytes) -> None:
    global _index
    _index = _index or _IndexTarget()
    _index.one(data)


# -- keys --------------------------------------------------------------------------------------


class _KeysTarget:
    """A sandbox holding a remote directory and a staging directory, laid anew for each input."""

    def __init__(self):
        self.box = tempfile.mkdtemp(prefix="fastmm-fuzz-keys-")
        self.remote = os.path.join(self.box, "remote")
        self.stage = os.path.join(self.box, "stage")
        # parts an attacker would try, this sandbox's own path among them
        self.parts = ["", ".", "..", ".fastmm-stage", "a", "a.tar", "b.jpg", "x\\y", "n\0ul",
                      "\ud800", self.box.strip("/"), "remote", "stage", ".tar"]

    def _names(self, fdp) -> list[str]:
        names = []
        for _ in range(fdp.ConsumeIntInRange(1, 8)):
            parts = [self.parts[fdp.ConsumeIntInRange(0, len(self.parts) - 1)]
                     if fdp.ConsumeBool() else fdp.ConsumeUnicode(6)
                     for _ in range(fdp.ConsumeIntInRange(1, 4))]
            names.append("/".join(parts))
        return names

    def one(self, data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        extract = fdp.ConsumeBool()
        names = self._names(fdp)
        shutil.rmtree(self.box, ignore_errors=True)
        os.makedirs(self.remote)
        lines = []
        for name in names:
            body = bytes(1024) if name.endswith(".tar") else b"x"  # an empty tar, or a byte
            if name_problem(name) is None:  # the check's promise, before anything is joined
                path = os.path.join(self.remote, name)
                assert os.path.normpath(path) == path, name
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "xb") as f:
                        f.write(body)
                except OSError:
                    pass  # a file and a directory of one name, a name too long: staged or not
            lines.append(json.dumps({"path": name, "size": len(body),
                                     "sha256": hashlib.sha256(body).hexdigest()}))
        with open(os.path.join(self.remote, ".fastmm-files.jsonl"), "w") as f:
            f.write("\n".join(lines) + "\n")
        remote_before = sorted(os.walk(self.remote))
        try:
            src = StagedSource(self.remote, self.stage, extract=extract, on_error="skip",
                               progress=None)
        except SourceError as e:  # a .tar to extract that could not be copied: its samples
            assert extract and e.key.endswith(".tar") and e.reason != "unsafe_name", e  # unknown
        else:
            manifest = os.path.join(self.remote, ".fastmm-files.jsonl")
            unsafe = [p.key for p in src.problems
                      if p.reason == "unsafe_name" and p.origin.startswith(manifest)]
            assert len(src.files) + len(unsafe) == len(names), (names, src.files, unsafe)
            assert all(name_problem(f.path) is None for f in src.files)
        assert sorted(os.walk(self.remote)) == remote_before  # nothing there added or removed
        for where, dirs, files in os.walk(self.box):
            for n in dirs + files:
                path = os.path.join(where, n)
                assert path.startswith((self.remote + os.sep, self.stage + os.sep)) or \
                    path in (self.remote, self.stage), path


_keys = None


def keys_one(data: bytes) -> None:
    global _keys
    _keys = _keys or _KeysTarget()
    _keys.one(data)


# -- gather ------------------------------------------------------------------------------------


def _outcome(impl, dst: bytearray, offset: int, srcs: list[bytes], stride: int):
    try:
        impl.gather(dst, offset, srcs, stride)
    except (ValueError, OverflowError) as e:
        return type(e).__name__
    return bytes(dst)


def _edgy(fdp, small: int) -> int:
    """Mostly small; else any 64-bit value, or one near a power of two (where sums overflow)."""
    pick = fdp.ConsumeIntInRange(0, 5)
    if pick < 3:
        return fdp.ConsumeIntInRange(0, small)
    if pick == 3:
        return fdp.ConsumeInt(8)
    near = (1 << fdp.ConsumeIntInRange(8, 63)) - fdp.ConsumeIntInRange(-small, small)
    return min(near, (1 << 63) - 1)


def gather_one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    size = fdp.ConsumeIntInRange(0, 4096)
    offset, stride = _edgy(fdp, 64), _edgy(fdp, 512)
    srcs = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 600)) for _ in range(fdp.ConsumeIntInRange(0, 12))]
    fill = bytearray(fdp.ConsumeBytes(1) * size or size)
    twin = _outcome(_twin, bytearray(fill), offset, srcs, stride)
    if _C is not None:
        cpp = _outcome(_C, bytearray(fill), offset, srcs, stride)
        assert cpp == twin, (offset, stride, [len(s) for s in srcs], size, cpp, twin)


# -- planes ------------------------------------------------------------------------------------


def _planes_outcome(impl, dst: bytearray, src):
    try:
        impl.planes(dst, src)
    except (ValueError, BufferError) as e:
        return type(e).__name__
    return bytes(dst)


def planes_one(data: bytes) -> None:
    """A view cut from random pixels: leading dims with steps, a crop, C channels of pixels
    ``ps`` bytes apart (sometimes a layout planes must refuse)."""
    fdp = atheris.FuzzedDataProvider(data)
    lead = [fdp.ConsumeIntInRange(1, 4) for _ in range(fdp.ConsumeIntInRange(0, 2))]
    h, w = fdp.ConsumeIntInRange(1, 9), fdp.ConsumeIntInRange(1, 80)
    ps = fdp.ConsumeIntInRange(1, 5)
    pixels = np.frombuffer(fdp.ConsumeBytes(math.prod(lead) * h * w * ps).ljust(
        math.prod(lead) * h * w * ps, b"\x01"), dtype=np.uint8).reshape(*lead, h, w, ps)
    channels = fdp.ConsumeIntInRange(1, ps)
    steps = tuple(slice(None, None, fdp.ConsumeIntInRange(1, 2)) for _ in lead)
    top, left = fdp.ConsumeIntInRange(0, h - 1), fdp.ConsumeIntInRange(0, w - 1)
    view = pixels[(*steps, slice(top, None), slice(left, None), slice(0, channels))]
    src = np.moveaxis(view, -1, -3)
    if fdp.ConsumeBool():
        src = np.ascontiguousarray(view)  # planar already: refused
    size = src.size + fdp.ConsumeIntInRange(-1, 1) * fdp.ConsumeBool()
    twin = _planes_outcome(_twin, bytearray(size), src)
    if isinstance(twin, bytes):
        assert twin == np.ascontiguousarray(src).tobytes()
    if _C is not None:
        cpp = _planes_outcome(_C, bytearray(size), src)
        assert cpp == twin, (src.shape, src.strides, size, cpp, twin)


# -- layout ------------------------------------------------------------------------------------

_DTYPES = [torch.uint8, torch.int16, torch.int32, torch.float32, torch.float64, torch.bfloat16]


def layout_one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    views = {i: memoryview(bytearray(fdp.ConsumeIntInRange(0, 4096))) for i in range(2)}
    places = []  # plausible tables first (most pass the check), then a few fields spoiled
    for _ in range(fdp.ConsumeIntInRange(1, 3)):
        start = fdp.ConsumeIntInRange(0, 64)
        if fdp.ConsumeBool():
            places.append(["inline", start, fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256))])
        else:
            slab_id = fdp.ConsumeIntInRange(0, 1)
            offset = fdp.ConsumeIntInRange(0, len(views[slab_id]))
            nbytes = fdp.ConsumeIntInRange(0, len(views[slab_id]) - offset)
            places.append(["slab", start, slab_id, offset, nbytes])
    tensors = []
    for _ in range(fdp.ConsumeIntInRange(1, 3)):
        slot = fdp.ConsumeIntInRange(0, len(places) - 1)
        dtype = fdp.PickValueInList(_DTYPES)
        shape = [fdp.ConsumeIntInRange(0, 8) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        stride = [fdp.ConsumeIntInRange(0, 64) for _ in shape]
        lo = places[slot][1] + dtype.itemsize * fdp.ConsumeIntInRange(0, 16)
        tensors.append([slot, dtype, shape, stride, lo])
    for _ in range(fdp.ConsumeIntInRange(0, 3)):
        row = fdp.PickValueInList(places + tensors)
        field = fdp.ConsumeIntInRange(0, len(row) - 1)
        if isinstance(row[field], list) and row[field]:
            row[field][fdp.ConsumeIntInRange(0, len(row[field]) - 1)] = _edgy(fdp, 64) * (
                -1 if fdp.ConsumeBool() else 1)
        elif type(row[field]) is int:
            row[field] = _edgy(fdp, 64) * (-1 if fdp.ConsumeBool() else 1)
    # the records a worker sends; a row whose kind was spoiled stays a bare tuple (refused)
    places = [Inline(*p[1:]) if p[0] == "inline" else InSlab(*p[1:]) if p[0] == "slab"
              else tuple(p) for p in places]
    tensors = [TensorSpec(slot, dtype, tuple(shape), tuple(stride), lo)
               for slot, dtype, shape, stride, lo in tensors]
    try:
        batch = collate.unpack(Packed(places, tensors, collate_payload(len(tensors))), views)
    except ValueError:
        return
    for t in batch:  # each tensor's reachable bytes lie inside its place's bytes
        if t.numel():
            lo, hi = collate._byte_span(t)
            assert 0 <= lo <= hi <= t.untyped_storage().nbytes(), (lo, hi)
            t[(0,) * t.dim()].item(), t[tuple(n - 1 for n in t.shape)].item()  # both ends read


def collate_payload(n: int) -> bytes:
    """A batch pickled as a worker would: a list of ``n`` tensor references."""

    class Ref(int):
        def __reduce__(self):
            return collate._slab_tensor, (int(self),)

    return collate.pickle.dumps([Ref(i) for i in range(n)], collate.pickle.DEFAULT_PROTOCOL)


def _layout_seeds() -> list[bytes]:
    return [struct.pack("<QQ", 4096, 2048) + bytes(range(256)) * 2]


# -- state -------------------------------------------------------------------------------------


class _StateTarget:
    """A real mid-epoch state of a 2-worker shuffled loader, then damaged a field at a time."""

    def __init__(self):
        self.make = lambda: fastmm.DataLoader(list(range(64)), batch_size=4, shuffle=True,
                                              num_workers=2, generator=torch.Generator())
        loader = self.make()
        it = iter(loader)
        for _ in range(5):
            next(it)
        self.state = loader.state_dict()
        del it

    def _value(self, fdp):
        kind = fdp.ConsumeIntInRange(0, 7)
        if kind == 0:
            return None
        if kind == 1:
            return _edgy(fdp, 70) * (-1 if fdp.ConsumeBool() else 1)
        if kind == 2:
            return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
        if kind == 3:
            return fdp.ConsumeBool()
        if kind == 4:
            return fdp.ConsumeRegularFloat()
        if kind == 5:
            return [self._value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        if kind == 6:
            return {}
        return base64.b64encode(zlib.compress(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 6000)))
                                ).decode()

    def one(self, data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        state = copy.deepcopy(self.state)
        for _ in range(fdp.ConsumeIntInRange(1, 3)):  # replace or drop a field somewhere
            node = state
            while True:
                keys = list(node) if isinstance(node, dict) else list(range(len(node)))
                if not keys:
                    break
                key = keys[fdp.ConsumeIntInRange(0, len(keys) - 1)]
                child = node[key]
                if isinstance(child, (dict, list)) and child and fdp.ConsumeBool():
                    node = child
                    continue
                if isinstance(node, dict) and fdp.ConsumeIntInRange(0, 7) == 0:
                    del node[key]
                else:
                    node[key] = self._value(fdp)
                break
        loader = self.make()
        try:
            loader.load_state_dict(state)
        except ValueError:
            return
        p = loader._progress  # what the next iterator would start from
        with resume.KeepRng(loader.generator):
            for rng in p.worker_rng:
                if rng is not None:
                    resume.apply_rng(rng)
            if p.sampler_rng is not None:
                resume._set_generator_states(p.sampler_rng, loader.generator,
                                             resume.sampler_generator(loader))
        assert len(p.worker_batches) == 2 and all(type(b) is int and b >= 0
                                                   for b in [p.batches, *p.worker_batches])


_state = None


def state_one(data: bytes) -> None:
    global _state
    _state = _state or _StateTarget()
    _state.one(data)


# -- mp4 ---------------------------------------------------------------------------------------


def _mp4_seeds() -> list[bytes]:
    """Small files with B-frames, as ffmpeg writes them (the index at the end): x264, and x265
    where the ffmpeg CLI has it."""
    import shutil
    import subprocess

    import numpy as np

    from fastmm.bench.mmcorpus import encode_h264

    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 4, (32, 32, 3), np.uint8) * 64 for _ in range(30)]
    seeds = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v.mp4")
        encode_h264(frames, 32, 32, 24, 12, 40, path)
        with open(path, "rb") as f:
            seeds.append(f.read())
        if shutil.which("ffmpeg"):
            hevc = os.path.join(tmp, "h.mp4")
            made = subprocess.run(
                ["ffmpeg", "-v", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", "32x32",
                 "-r", "24", "-i", "-", "-c:v", "libx265", "-x265-params", "log-level=error",
                 "-g", "12", "-pix_fmt", "yuv420p", hevc],
                input=b"".join(f.tobytes() for f in frames), capture_output=True)
            if made.returncode == 0:
                with open(hevc, "rb") as f:
                    seeds.append(f.read())
    return seeds


def mp4_one(data: bytes) -> None:
    track = mp4.parse(data)
    if track is None:
        return
    n = track.num_frames
    assert n >= 1 and len(track.offsets) == len(track.dts) == len(track.cts) == n
    assert track.offsets.min() >= 0 and int((track.offsets + track.sizes).max()) <= len(data)
    start = zlib.crc32(data) % n  # a clip somewhere in the video, every 2nd frame
    wanted = list(range(start, n, 2))[:8]
    slim = mp4.slim_clip(data, track, wanted)
    if slim is None:
        return
    again = mp4.parse(slim.data)
    assert again is not None and again.num_frames == slim.num_frames == n - slim.dropped
    order = again.pts.argsort(kind="stable")
    frames = track.pts.argsort(kind="stable")
    for old, new in zip(wanted, slim.indices):
        a, b = frames[old], order[new]
        assert data[track.offsets[a]:track.offsets[a] + track.sizes[a]] == \
            slim.data[again.offsets[b]:again.offsets[b] + again.sizes[b]], (old, new)


TARGETS = {
    "tar": (tar_one, _tar_seeds),
    "index": (index_one, lambda: [_IndexTarget().seed, b"{}"]),
    "gather": (gather_one, lambda: [bytes(64), bytes(range(256))]),
    "planes": (planes_one, lambda: [bytes(64), bytes(range(256))]),
    "layout": (layout_one, _layout_seeds),
    "state": (state_one, lambda: [bytes(16), bytes(range(256))]),
    "mp4": (mp4_one, _mp4_seeds),
    "keys": (keys_one, lambda: [bytes(64), bytes(range(256)), b"\xff" * 64]),
}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer options] [corpus dir]")
    one, seeds = TARGETS[argv[1]]
    options = [a for a in argv[2:] if a.startswith("-")]
    # the corpus grows across runs (libFuzzer adds what finds new coverage); seeds go in first
    corpus = next((a for a in argv[2:] if not a.startswith("-")),
                  os.path.join(tempfile.gettempdir(), f"fastmm-fuzz-{argv[1]}"))
    os.makedirs(corpus, exist_ok=True)
    for i, seed in enumerate(seeds()):
        with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
            f.write(seed)
    if not any(a.startswith("-timeout=") for a in options):
        options.append("-timeout=10")
    atheris.Setup([argv[0], *options, corpus], one)
    atheris.Fuzz()


def in_a_child_of_its_own() -> None:
    """Go on in a child forked here, this process waiting for it and exiting as it did.
    libFuzzer's out-of-memory check (-rss_limit_mb) reads the process's peak RSS, and a process
    started by exec keeps the peak of the one that started it (a test run's pytest, with
    gigabytes mapped, made every input an "oom" before any ran): a forked child's peak is its
    own. The child dies with this process (a timeout that kills it ends the fuzzing too)."""
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # (the parent was gone before that)
        os._exit(1)


if __name__ == "__main__":
    in_a_child_of_its_own()
    main(sys.argv)
