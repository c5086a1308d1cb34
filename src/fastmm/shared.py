"""A dataset's large Python containers, shared read-only with the loader's workers.

A map-style dataset often keeps its index in plain Python objects: a list of paths, a list of
labels, torchvision's ``ImageFolder.samples`` (a list of ``(path, class)`` tuples). A forked
worker that reads them writes each object's reference count, so every page holding one
becomes the worker's own, and the workers' memory grows toward one copy of the index each
(pytorch/pytorch#13246). Under spawn or forkserver, each worker is sent a pickle of it instead.

``DatasetShare.build`` finds such containers among the attributes of the dataset and of the
datasets it wraps, and encodes them once, in the main process, into one shared buffer (a
memfd). Each worker reads them through ``SharedList``, ``SharedTuple`` and ``SharedDict``,
which index the buffer in place: what a worker reads equals the original (same type, same
value), and no object is created but the one read. The main process's objects are left as
they were.

What is shared: lists, tuples and dicts with at least ``MIN_ITEMS`` items whose items (keys and
values) are str, bytes, int, float, bool, None, or tuples, lists and dicts of those. Not
shared (left as they are, and said why): a container holding any other type (a subclass of
str or int included), a str with a lone surrogate (it has no UTF-8 form), attributes kept in
``__slots__``. A worker that changes a shared list or dict gets a private copy of it at its
first change (as it would have had, page by page, before); a list or dict nested in a shared
container is a fresh copy each time it is read, so a change to it is not kept.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import mmap
import operator
import os
import pickle
import struct
import sys
import weakref
import zlib
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from multiprocessing import reduction
from typing import NamedTuple

import numpy as np

from ._wrappers import _DEPTH

log = logging.getLogger("fastmm")

MIN_ITEMS = 1024  # smaller containers are not worth a lookup's cost
_SCALARS = (str, bytes, int, float, bool, type(None))
_HEADER = struct.Struct("<4sxxxxq")  # a column's kind and its length
_KEPT: list = []  # a worker's inherited originals, never freed (freeing would touch them all)


class NotShareable(ValueError):
    """Why a container cannot be shared."""


# -- encoding (main process) -----------------------------------------------------------------


class _Writer:
    """The buffer being built: 8-byte aligned chunks, each written where ``tell()`` said."""

    def __init__(self):
        self.chunks: list[bytes] = []
        self.size = 0
        self.holds_mutables = False  # a list or dict inside an item: changes it cannot see

    def put(self, data) -> int:
        at = self.size
        data = bytes(data)
        self.chunks.append(data)
        self.size += len(data)
        pad = -self.size % 8
        if pad:
            self.chunks.append(b"\0" * pad)
            self.size += pad
        return at


def _check_item(x, depth: int = 0) -> bool:
    """Raise NotShareable unless ``x`` is one of the supported types, all the way down; whether
    it is or holds a list or dict."""
    kind = type(x)
    if kind is str:
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise NotShareable("it holds a str with a lone surrogate") from None
    elif kind in (tuple, list):
        if depth > 32:
            raise NotShareable("it nests deeper than 32 levels")
        # (every item checked, so no any() short cut)
        return any([_check_item(y, depth + 1) for y in x]) or kind is list
    elif kind is dict:
        if depth > 32:
            raise NotShareable("it nests deeper than 32 levels")
        for k, v in x.items():
            _check_item(k, depth + 1)
            _check_item(v, depth + 1)
        return True
    elif kind not in _SCALARS:
        raise NotShareable(f"it holds a {kind.__module__}.{kind.__qualname__}")
    return False


def _offsets(lengths, n: int) -> np.ndarray:
    """Where each of ``n`` items of these lengths starts, and where the last ends."""
    out = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter(lengths, np.int64, n), out=out[1:])
    return out


def _blobs(w: _Writer, kind: bytes, blobs: list[bytes]) -> int:
    at = w.put(_HEADER.pack(kind, len(blobs)))
    w.put(_offsets(map(len, blobs), len(blobs)).tobytes())
    w.put(b"".join(blobs))
    return at


def _column(w: _Writer, items: list | tuple, depth: int = 0) -> int:
    """Write ``items`` as one column; its offset in the buffer."""
    n = len(items)
    types = set(map(type, items))
    if types == {str}:
        joined = "".join(items)
        try:
            data = joined.encode("utf-8")
        except UnicodeEncodeError:
            raise NotShareable("it holds a str with a lone surrogate") from None
        if not joined.isascii():  # (ASCII: a character is a byte, the common case)
            return _blobs(w, b"str ", [s.encode("utf-8") for s in items])
        at = w.put(_HEADER.pack(b"str ", n))
        w.put(_offsets(map(len, items), n).tobytes())
        w.put(data)
        return at
    if types == {bytes}:
        return _blobs(w, b"byte", list(items))
    if types == {int}:
        try:
            values = np.fromiter(items, np.int64, n)
        except OverflowError:  # past 64 bits: each pickled
            pass
        else:
            at = w.put(_HEADER.pack(b"int ", n))
            w.put(values.tobytes())
            return at
    if types == {float}:
        at = w.put(_HEADER.pack(b"flt ", n))
        w.put(np.fromiter(items, np.float64, n).tobytes())
        return at
    if types == {bool}:
        at = w.put(_HEADER.pack(b"bool", n))
        w.put(bytes(bytearray(items)))
        return at
    if types == {type(None)}:
        return w.put(_HEADER.pack(b"none", n))
    if types == {tuple} and depth < 32:
        widths = set(map(len, items))
        if len(widths) == 1 and 0 < (width := widths.pop()) <= 64:
            # (a column at a time: zip(*items) takes 20x as long over 2M pairs)
            children = [_column(w, list(map(operator.itemgetter(j), items)), depth + 1)
                        for j in range(width)]
            at = w.put(_HEADER.pack(b"tupl", n))
            w.put(np.array([width, *children], np.int64).tobytes())
            return at
    if any([_check_item(x, depth) for x in items]):  # mixed, nested or large: each item
        w.holds_mutables = True  # pickled, once checked (every one)
    return _blobs(w, b"pick", [pickle.dumps(x, protocol=5) for x in items])


def _stable_hash(key) -> int:
    """A key's hash, the same in every process (str's and bytes' hash() is salted per process):
    equal keys hash equal, as in a dict (1, 1.0 and True alike)."""
    kind = type(key)
    if kind is str:
        return zlib.crc32(key.encode("utf-8", "surrogatepass")) * 3 + 1
    if kind is bytes:
        return zlib.crc32(key) * 3 + 2
    if kind is tuple:
        h = 0x345678
        for x in key:
            h = (h * 1000003 ^ _stable_hash(x)) & 0xFFFFFFFFFFFF
        return h
    if key is None:
        return 0x4E4F4E45
    return hash(key)  # numbers: not salted, and equal across int, float, bool, NumPy's ...


def _container(w: _Writer, obj) -> int:
    """Write a list, tuple or dict; its offset."""
    if type(obj) is dict:
        keys = list(obj)
        hashes = np.fromiter((_stable_hash(k) & 0x7FFFFFFFFFFFFFFF for k in keys), np.int64,
                             len(keys))
        order = np.argsort(hashes, kind="stable")
        key_at, value_at = _column(w, keys), _column(w, list(obj.values()))
        at = w.put(_HEADER.pack(b"dict", len(keys)))
        w.put(np.array([key_at, value_at], np.int64).tobytes())
        w.put(hashes[order].tobytes())
        w.put(order.astype(np.int64).tobytes())
        return at
    return _column(w, obj)


# -- reading (workers) -----------------------------------------------------------------------


_PAIR = struct.Struct("<qq").unpack_from
_INT = struct.Struct("<q").unpack_from
_FLOAT = struct.Struct("<d").unpack_from


class _Column:
    """Reads item ``i`` of a column of the buffer (``get``: the reader for its kind)."""

    def __init__(self, buf, at: int):
        kind, self.n = _HEADER.unpack_from(buf, at)
        self.buf, body = buf, at + _HEADER.size
        self.body = self.offsets = body
        self.data = body + 8 * (self.n + 1)  # (str, bytes, pickled: after the offsets)
        if kind == b"tupl":
            width = _INT(buf, body)[0]
            self.getters = [_Column(buf, p).get for p in struct.unpack_from(f"<{width}q", buf,
                                                                            body + 8)]
        self.get = getattr(self, "_" + kind.decode().strip())

    def _str(self, i: int) -> str:
        a, b = _PAIR(self.buf, self.offsets + 8 * i)
        return str(self.buf[self.data + a:self.data + b], "utf-8")

    def _byte(self, i: int) -> bytes:
        a, b = _PAIR(self.buf, self.offsets + 8 * i)
        return self.buf[self.data + a:self.data + b]

    def _pick(self, i: int):
        a, b = _PAIR(self.buf, self.offsets + 8 * i)
        return pickle.loads(self.buf[self.data + a:self.data + b])

    def _int(self, i: int) -> int:
        return _INT(self.buf, self.body + 8 * i)[0]

    def _flt(self, i: int) -> float:
        return _FLOAT(self.buf, self.body + 8 * i)[0]

    def _bool(self, i: int) -> bool:
        return self.buf[self.body + i] != 0

    def _none(self, i: int) -> None:
        return None

    def _tupl(self, i: int) -> tuple:
        return tuple([get(i) for get in self.getters])

    def at(self, i, what: str):
        """Item ``i`` as a ``what`` (list, tuple) takes an index: negative, or any object with
        ``__index__``; its errors in their words."""
        return self.get(_index(i, self.n, what))

    def take(self, part: slice) -> list:
        return [self.get(j) for j in range(*part.indices(self.n))]

    def __iter__(self):
        get = self.get
        return (get(j) for j in range(self.n))


def _index(i, n: int, what: str) -> int:
    try:
        i = i.__index__()
    except AttributeError:
        raise TypeError(f"{what} indices must be integers or slices, not "
                        f"{type(i).__name__}") from None
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"{what} index out of range")
    return i


class _AsPlain:
    """Comparison, ``+`` and ``*`` of a proxy, as on the plain list or tuple it stands for."""

    _plain: type  # list or tuple

    def _other(self, other):
        return self._plain(other) if isinstance(other, (self._plain, type(self))) else None

    def _compare(self, other, op):
        plain = self._other(other)
        return NotImplemented if plain is None else op(self._plain(self), plain)

    def __eq__(self, other):
        return self._compare(other, operator.eq)

    def __lt__(self, other):
        return self._compare(other, operator.lt)

    def __le__(self, other):
        return self._compare(other, operator.le)

    def __gt__(self, other):
        return self._compare(other, operator.gt)

    def __ge__(self, other):
        return self._compare(other, operator.ge)

    def __add__(self, other):
        return self._compare(other, operator.add)

    def __radd__(self, other):
        plain = self._other(other)
        return NotImplemented if plain is None else plain + self._plain(self)

    def __mul__(self, n):
        return self._plain(self) * n

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return repr(self._plain(self))

    def __reduce__(self):  # pickled elsewhere (a worker's own pickles): the plain object
        return self._plain, (self._plain(self),)


class SharedTuple(_AsPlain, Sequence):
    """A tuple of the dataset's, read in place from the shared buffer."""

    _plain = tuple

    def __init__(self, buf, at: int):
        self._items = _Column(buf, at)

    def __len__(self) -> int:
        return self._items.n

    def __getitem__(self, i):
        items = self._items
        if type(i) is int and 0 <= i < items.n:  # (the common case, first)
            return items.get(i)
        return tuple(items.take(i)) if isinstance(i, slice) else items.at(i, "tuple")

    def __iter__(self):
        return iter(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self))


class SharedList(_AsPlain, MutableSequence):
    """A list of the dataset's, read in place from the shared buffer until the worker changes
    it: then it is the worker's own list."""

    _plain = list

    def __init__(self, buf, at: int):
        self._items = _Column(buf, at)
        self._own: list | None = None

    def _mine(self) -> list:
        if self._own is None:
            self._own = list(self)
        return self._own

    def __len__(self) -> int:
        return len(self._own) if self._own is not None else self._items.n

    def __getitem__(self, i):
        if self._own is not None:
            return self._own[i]
        items = self._items
        if type(i) is int and 0 <= i < items.n:  # (the common case, first)
            return items.get(i)
        return items.take(i) if isinstance(i, slice) else items.at(i, "list")

    def __iter__(self):
        return iter(self._own if self._own is not None else self._items)

    def __setitem__(self, i, value) -> None:
        self._mine()[i] = value

    def __delitem__(self, i) -> None:
        del self._mine()[i]

    def insert(self, i, value) -> None:
        self._mine().insert(i, value)

    def sort(self, *, key=None, reverse: bool = False) -> None:
        self._mine().sort(key=key, reverse=reverse)

    def copy(self) -> list:
        return list(self)

    def __imul__(self, n):
        self._own = self._mine() * n
        return self

    __hash__ = None


class SharedDict(MutableMapping):
    """A dict of the dataset's, looked up in place in the shared buffer (keys in its order)
    until the worker changes it: then it is the worker's own dict."""

    def __init__(self, buf, at: int):
        kind, self._n = _HEADER.unpack_from(buf, at)
        body = at + _HEADER.size
        key_at, value_at = _PAIR(buf, body)
        self._keys, self._values = _Column(buf, key_at), _Column(buf, value_at)
        self._buf, self._hashes = buf, body + 16  # the keys' hashes, sorted
        self._order = self._hashes + 8 * self._n  # the key of each, by its place in the dict
        self._own: dict | None = None

    def _mine(self) -> dict:
        if self._own is None:
            self._own = dict(self.items())
        return self._own

    def _find(self, key) -> int:
        hash(key)  # an unhashable key: dict's TypeError
        h = _stable_hash(key) & 0x7FFFFFFFFFFFFFFF
        lo, hi = 0, self._n
        while lo < hi:  # the first of the sorted hashes >= h
            mid = (lo + hi) // 2
            if self._hash(mid) < h:
                lo = mid + 1
            else:
                hi = mid
        while lo < self._n and self._hash(lo) == h:
            i = _INT(self._buf, self._order + 8 * lo)[0]
            if self._keys.get(i) == key:
                return i
            lo += 1
        raise KeyError(key)

    def _hash(self, j: int) -> int:
        return _INT(self._buf, self._hashes + 8 * j)[0]

    def __getitem__(self, key):
        if self._own is not None:
            return self._own[key]
        return self._values.get(self._find(key))

    def __contains__(self, key) -> bool:
        if self._own is not None:
            return key in self._own
        try:
            self._find(key)
        except KeyError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._own) if self._own is not None else self._n

    def __iter__(self):
        return iter(self._own if self._own is not None else self._keys)

    def __setitem__(self, key, value) -> None:
        self._mine()[key] = value

    def __delitem__(self, key) -> None:
        del self._mine()[key]

    def copy(self) -> dict:
        return dict(self.items())

    def __eq__(self, other):
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(dict(self.items()))

    def __reduce__(self):
        return dict, (dict(self.items()),)


def _proxy(buf, kind: str, at: int):
    return {"list": SharedList, "tuple": SharedTuple, "dict": SharedDict}[kind](buf, at)


# -- finding, building, handing to workers ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shared:
    """One container shared: where it was found (``dataset.samples``), its kind, its items,
    about how many bytes its Python objects take, and where it lies in the buffer."""

    where: str
    kind: str
    items: int
    python_bytes: int
    at: int


class Placement(NamedTuple):
    """Where a shared container goes in a worker: ``owner.<name>``, in place of ``original``."""

    owner: object
    name: str
    original: object
    shared: Shared


def python_bytes(obj) -> int:
    """About how much memory ``obj``'s objects take, from up to 1,000 of its items."""
    items = list(obj.items()) if type(obj) is dict else obj
    sample = [items[i] for i in range(0, len(items), max(1, len(items) // 1000))]

    def size(x) -> int:
        if type(x) in (tuple, list):
            return sys.getsizeof(x) + sum(map(size, x))
        if type(x) is dict:
            return sys.getsizeof(x) + sum(size(k) + size(v) for k, v in x.items())
        return sys.getsizeof(x)

    per_item = sum(map(size, sample)) / max(1, len(sample))
    return int(sys.getsizeof(obj) + per_item * len(items))


def _datasets(dataset):
    """(path, object) for the dataset and the datasets it wraps (``.dataset``, ``.datasets``,
    and the one a telemetry wrapper watches, ``fastmm_wrapped``, under the same path)."""
    level, seen = [("dataset", dataset)], set()
    for _ in range(_DEPTH + 1):
        inner = []
        for path, d in level:
            if id(d) in seen:
                continue
            seen.add(id(d))
            yield path, d
            if getattr(type(d), "fastmm_wrapped", None) is not None:  # telemetry's wrappers
                inner.append((path, d.fastmm_wrapped))
            if getattr(d, "dataset", None) is not None:
                inner.append((path + ".dataset", d.dataset))
            datasets = getattr(d, "datasets", None)
            if isinstance(datasets, (list, tuple)):
                inner.extend((f"{path}.datasets[{i}]", x) for i, x in enumerate(datasets))
        level = inner


def containers(dataset, min_items: int = MIN_ITEMS):
    """(where, owner, attribute, value) for each list, tuple or dict of ``min_items`` or more
    among the attributes of ``dataset`` and of the datasets it wraps."""
    for path, d in _datasets(dataset):
        attributes = getattr(d, "__dict__", None)
        if not isinstance(attributes, dict):
            continue
        for name, value in list(attributes.items()):
            if type(value) in (list, tuple, dict) and len(value) >= min_items:
                yield f"{path}.{name}", d, name, value


class NotShared(NamedTuple):
    """A container left as it is, and why."""

    where: str
    kind: str
    items: int
    why: str


class DatasetShare:
    """The shared buffer of one loader's workers, and what it holds (``shared``, ``not_shared``).

    Built in the main process before workers start (``build``); a forked worker puts the
    shared containers in place of its inherited ones (``install``); a spawned one is sent the
    dataset with them in place (``for_workers``).

    Args:
        fd: the memfd holding the buffer (-1: nothing shared).
        size: its bytes.
        placements: where each shared container goes in a worker.
        shared: what is shared.
        not_shared: the large containers left as they are, and why.
        found: what ``containers()`` found when it was built, or None where a shared item
            is or holds a list or dict (then ``holds()`` is always False).
    """

    def __init__(self, fd: int, size: int, placements: list, shared: list[Shared],
                 not_shared: list[NotShared], found: list | None = None):
        self.fd, self.size = fd, size  # (the descriptor spawned workers are sent)
        self.placements: list[Placement] = placements
        self.shared, self.not_shared = shared, not_shared
        # mapped whole here (MAP_POPULATE): a page a worker reads is then one this process maps
        # too, never "private" to the first worker to read it (its USS, which counts pages
        # one process maps, went up to 0.31x the dataset in some rounds without)
        self._buf = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                              mmap.PROT_READ) if shared else None
        self._close_fd = weakref.finalize(self, os.close, fd) if shared else None
        # what holds() checks: what containers() found, and each shared container's references
        self._found = found
        # (once per container: ImageFolder's imgs is its samples)
        self._copies = None if found is None else [
            (original, _references(original))
            for original in {id(p.original): p.original for p in placements}.values()]

    @classmethod
    def build(cls, dataset, min_items: int = MIN_ITEMS,
              last: "DatasetShare | None" = None) -> "DatasetShare":
        """Share the large containers among the attributes of ``dataset`` and the datasets it
        wraps (``shared`` empty if there are none); ``last`` itself where it still holds what
        they hold (the previous epoch's, when nothing changed)."""
        if last is not None and last.holds(dataset, min_items):
            return last
        w = _Writer()
        placements, shared, not_shared, done = [], [], [], {}
        found = list(containers(dataset, min_items))
        for where, owner, name, value in found:
            if id(value) not in done:  # (ImageFolder's imgs is its samples: one copy)
                written = len(w.chunks), w.size
                try:
                    at = _container(w, value)
                except NotShareable as e:
                    del w.chunks[written[0]:]  # (what part of it was written)
                    w.size = written[1]
                    not_shared.append(NotShared(where, type(value).__name__, len(value), str(e)))
                    done[id(value)] = None
                    continue
                done[id(value)] = Shared(where, type(value).__name__, len(value),
                                         python_bytes(value), at)
                shared.append(done[id(value)])
            if done[id(value)] is not None:
                placements.append(Placement(owner, name, value, done[id(value)]))
        if not shared:
            return cls(-1, 0, [], [], not_shared)
        fd = _memfd(w.size)
        try:
            at = 0
            for chunk in w.chunks:
                at += os.pwrite(fd, chunk, at)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, w.size, placements, shared, not_shared,
                   None if w.holds_mutables else found)

    def holds(self, dataset, min_items: int = MIN_ITEMS) -> bool:
        """Whether workers of ``dataset`` can start from this share again: its large
        containers are the same objects on the same owners, each holding the same objects as
        when it was built (a list or dict changed in place, or an attribute set anew, is not;
        checked by identity, about 25 ms a million items)."""
        if self._found is None or self._buf is None:
            return False
        now = list(containers(dataset, min_items))
        return (len(now) == len(self._found)
                and all(a[0] == b[0] and a[1] is b[1] and a[2] == b[2] and a[3] is b[3]
                        for a, b in zip(now, self._found))
                and all(_same_references(value, copy) for value, copy in self._copies))

    @property
    def python_bytes(self) -> int:
        return sum(s.python_bytes for s in self.shared)

    def describe(self) -> str:
        """What is shared and what is not, in a line each (the start-up log, fastmm-doctor)."""
        lines = [f"shared with the workers, read in place ({self.size / 2**20:,.1f} MiB once, "
                 f"instead of up to {self.python_bytes / 2**20:,.1f} MiB of Python objects "
                 "copied into each worker as it reads them):" if self.shared else
                 "no large Python container to share with the workers"]
        lines += [f"  {s.where}: {s.kind} of {s.items:,} items" for s in self.shared]
        lines += [f"  not shared: {n.where} ({n.kind} of {n.items:,} items): {n.why}"
                  for n in self.not_shared]
        return "\n".join(lines)

    def proxies(self, buf) -> dict[int, object]:
        """One proxy per shared container (by id of the original), over ``buf``."""
        out = {}
        for p in self.placements:
            if id(p.original) not in out:
                out[id(p.original)] = _proxy(buf, p.shared.kind, p.shared.at)
        return out

    def install(self) -> None:
        """In a forked worker: the shared containers in place of the inherited ones (whose
        pages are never touched again: they are kept, not freed)."""
        proxies = self.proxies(self._buf)
        for p in self.placements:
            _KEPT.append(p.original)
            vars(p.owner)[p.name] = proxies[id(p.original)]

    def for_workers(self, dataset, start_method: str) -> tuple:
        """(what a worker's spec carries as its dataset, the share it installs or None): under
        fork the dataset itself and this share (the worker calls ``install``), else a dataset
        that pickles the shared containers as places in the buffer; nothing shared: the
        dataset and None."""
        if not self.shared:
            return dataset, None
        if start_method == "fork":
            return dataset, self
        return _SentDataset(dataset, self), None

    def close(self) -> None:
        if self._buf is not None:  # (nothing shared: nothing to close)
            self._buf.close()
            self._buf = None
            self._close_fd()


def _references(container):
    """What ``_same_references`` compares ``container`` with later."""
    if type(container) is dict:
        return list(container), list(container.values())
    return list(container) if type(container) is list else None  # (a tuple cannot change)


def _same_references(container, references) -> bool:
    if type(container) is tuple:
        return True
    if type(container) is list:
        return len(container) == len(references) and all(
            map(operator.is_, container, references))
    keys, values = references
    return (len(container) == len(keys) and all(map(operator.is_, container, keys))
            and all(map(operator.is_, container.values(), values)))


def _memfd(size: int) -> int:
    fd = os.memfd_create("fastmm-dataset", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _SharingPickler(reduction.ForkingPickler):
    """Pickles a dataset with each shared container as its place in the buffer."""

    def __init__(self, file, places: dict[int, tuple[str, int]]):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._places = places

    def persistent_id(self, obj):
        return self._places.get(id(obj))


class _SharingUnpickler(pickle.Unpickler):
    def __init__(self, file, buf):
        super().__init__(file)
        self._buf = buf

    def persistent_load(self, pid):
        kind, at = pid
        return _proxy(self._buf, kind, at)


class _SentDataset:
    """The dataset on its way to a spawned worker: pickled when the worker starts (so torch's
    tensor reductions work as they do for a dataset sent whole), with the buffer's descriptor
    passed alongside."""

    def __init__(self, dataset, share: DatasetShare):
        self.dataset, self.share = dataset, share

    def __reduce__(self):
        places = {id(p.original): (p.shared.kind, p.shared.at) for p in self.share.placements}
        data = io.BytesIO()
        _SharingPickler(data, places).dump(self.dataset)
        return _received, (data.getvalue(), reduction.DupFd(self.share.fd), self.share.size)


def _received(data: bytes, dup_fd, size: int):
    """In a spawned worker: the dataset, its shared containers read from the buffer."""
    fd = dup_fd.detach()
    try:
        buf = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return _SharingUnpickler(io.BytesIO(data), buf).load()
