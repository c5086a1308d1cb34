"""MultimodalDataset: samples from a storage source, decoded by a backend, cropped and resized
to a fixed size, with one bad-input policy. Works with fastmm.DataLoader and torch's.

Each item is a dict: ``"key"``, ``"image"`` (uint8 3xHxW) or ``"video"`` (uint8 TxCxHxW), and
``"caption"`` / ``"label"`` from the sample's ``txt`` / ``cls`` members ("" and -1 when absent).

Bad input (a damaged sample in the source, bytes no decoder can read, a cap exceeded):
``on_error="raise"`` raises the typed error (SourceError, DecodeError) with the key and origin;
``"skip"`` drops the sample from its batch (through ``__getitems__``, which torch's fetcher
calls; a lone ``dataset[i]`` returns None); ``"replace"`` returns the next good sample instead,
so batches stay full. Every skipped or replaced sample is logged with its key and origin (shard
and byte offset for tar shards) and counted by reason in counters that all worker processes
share, so ``dataset.skipped`` in the main process totals every worker's. A sample is counted for
the index it was drawn for, not again when it is tried as another's stand-in, so an epoch over
every index counts each bad sample once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import types
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import torch
import torch.utils.data

from . import config
from ._shared import SharedArray, row_of, this_worker
from ._batch_fill import sample_by_sample
from .decode import ClipSpec, DecodeError, DecodeLimits, ImageDecoder, VideoDecoder, get_decoder
from .decode.base import CropPlan
from .errors import FastmmWarning
from .sources import Problem, Source, SourceError, open_source, source_kind
from .telemetry import stage
from .telemetry.recorder import sample_stage

OnError = Literal["raise", "skip", "replace"]
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_EXTS = ("mp4", "webm", "mkv", "avi", "mov", "m4v")
# Reasons a sample is bad: the decoders' and the sources' (see their errors); others count as
# "other". Fixed, so the counters can live in one small shared array.
REASONS = (
    "empty", "corrupt", "too_large", "too_short", "no_video", "unsupported", "missing_member",
    "truncated", "unreadable", "unsafe_name", "bad_name", "bad_header", "not_a_file",
    "duplicate_member", "bad_manifest", "size", "checksum", "deadline", "bad_label", "other",
)
log = logging.getLogger("fastmm")


@dataclass(frozen=True, kw_only=True)
class ResizedCrop:
    """The crop and resize to ``size`` (h, w), planned from the source size before decoding.

    ``mode="random"``: torchvision's RandomResizedCrop(size, scale, ratio) followed by
    RandomHorizontalFlip(flip_p), drawing the same random numbers in the same order from torch's
    RNG, so a seeded run crops exactly as that torchvision pipeline would.
    ``mode="center"``: the largest centred box of the output's aspect ratio (what Resize of the
    short side then CenterCrop give), no flip."""

    size: tuple[int, int]
    mode: Literal["random", "center"] = "random"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5

    def __post_init__(self):
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"size={self.size!r}; give an int or (height, width) >= 1")
        object.__setattr__(self, "size", size)
        if self.mode not in ("random", "center"):
            raise ValueError(f"mode={self.mode!r}; use 'random' or 'center'")
        # torchvision's float32 logs, computed once (as Python floats: the same draws)
        object.__setattr__(self, "_log_ratio", torch.log(torch.tensor(self.ratio)).tolist())

    def plan(self, width: int, height: int) -> CropPlan:
        out_h, out_w = self.size
        if self.mode == "center":
            scale = min(width / out_w, height / out_h)
            # at least a pixel each way: a narrow image for a wide, flat output rounds to 0
            w = max(1, min(width, round(out_w * scale)))
            h = max(1, min(height, round(out_h * scale)))
            return CropPlan((height - h) // 2, (width - w) // 2, h, w, out_h, out_w, False)
        top, left, h, w = self._random_box(width, height)
        flip = bool(torch.rand(1) < self.flip_p)
        return CropPlan(top, left, h, w, out_h, out_w, flip)

    def _random_box(self, width: int, height: int) -> tuple[int, int, int, int]:
        # torchvision.transforms.v2.RandomResizedCrop._get_params, draw for draw
        area = height * width
        log_ratio = self._log_ratio
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return top, left, h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


def _label(member: bytes, key: str, origin: str) -> int:
    """The ``cls`` member as an int, -1 for a sample without one. Anything else (a class name,
    a number past int64, which no batch tensor could hold) is a bad sample, not a quiet -1."""
    text = member.strip()
    if not text:
        return -1
    digits = text[1:] if text[:1] in (b"-", b"+") else text
    if digits.isdigit() and len(digits) <= 19 and -(1 << 63) <= int(text) < 1 << 63:
        return int(text)
    raise SourceError("bad_label", key, origin,
                      f"the cls member {text[:40]!r} is not an integer in int64's range")


def _column(reason: str) -> int:
    return REASONS.index(reason) if reason in REASONS else REASONS.index("other")


class _Counters(SharedArray):
    """Skip and replace counts by reason, one row per process so no increment is lost without
    a lock."""

    ROWS = 1025  # the main process, then a row per worker (shared beyond 1024 workers)

    def __init__(self):
        super().__init__("q", self.ROWS * (len(REASONS) + 1))
        self._as_handed_out = None  # a snapshot totals() answers from (handed_out())

    def _row(self, worker_id: int | None) -> slice:
        row = row_of(worker_id, self.ROWS)
        width = len(REASONS) + 1
        return slice(row * width, (row + 1) * width)

    def add(self, reason: str, replaced: bool) -> None:
        row = self._row(this_worker())
        self._array[row.start + _column(reason)] += 1
        if replaced:
            self._array[row.stop - 1] += 1

    def row(self, worker_id: int | None) -> list[int]:
        """A process's counts (``worker_id`` None: the main process's) by reason, then
        replaced."""
        return self._array[self._row(worker_id)]

    def set_row(self, worker_id: int | None, counts: list[int]) -> None:
        self._array[self._row(worker_id)] = [int(n) for n in counts]

    def set_totals(self, skipped: dict[str, int], replaced: int) -> None:
        """Start from saved totals (kept in this process's row; the workers' rows cleared)."""
        width = len(REASONS) + 1
        self._array[:] = [0] * len(self._array)
        for reason, n in skipped.items():
            self._array[_column(reason)] += int(n)
        self._array[width - 1] = int(replaced)

    def met(self) -> int:
        """Bad samples met so far (skipped or replaced), in every process."""
        return sum(self.totals()[0].values())

    def totals(self) -> tuple[dict[str, int], int]:
        rows = self._as_handed_out or self._array
        sums = np.asarray(rows, dtype=np.int64).reshape(self.ROWS, -1).sum(axis=0).tolist()
        return {r: n for r, n in zip(REASONS, sums) if n}, sums[-1]

    @contextlib.contextmanager
    def handed_out(self, rows: list):
        """totals() as a loader's batches handed out have them: each worker's row (``rows``,
        by worker id; None: as it is) as after its last batch handed out, from one snapshot.
        The batches its workers made ahead, a resumed loader makes again, and counts then."""
        view = self._array[:]
        if len(rows) < self.ROWS:  # else rows are shared between workers
            for worker_id, row in enumerate(rows):
                if row is not None:
                    view[self._row(worker_id)] = row
        self._as_handed_out = view
        try:
            yield
        finally:
            self._as_handed_out = None


class DecodeDeadline(SharedArray):
    """The decode deadline: which sample each worker process is on and since when, so that
    fastmm.DataLoader can replace a worker stuck on one past ``seconds`` (a decoder
    stuck in C cannot be interrupted from inside its process); and the samples that were, so
    that no worker tries them again (they count as "deadline", by the bad-input policy)."""

    ROWS = 1025  # the main process, then a row per worker (shared beyond 1024 workers)
    CAP = 4096  # samples remembered as expired

    def __init__(self, seconds: float):
        # [since per row | item per row | enforced flag | expired count | expired items]
        super().__init__("d", 2 * self.ROWS + 2 + self.CAP)
        self.seconds = seconds
        self._known = (0, frozenset())

    def _row(self, worker_id: int | None) -> int:
        return row_of(worker_id, self.ROWS)

    def begin(self, item: int) -> None:
        row = self._row(this_worker())
        self._array[self.ROWS + row] = item
        self._array[row] = time.monotonic()  # CLOCK_MONOTONIC: one clock for all processes

    def end(self) -> None:
        self._array[self._row(this_worker())] = 0.0

    def overdue(self, worker_ids) -> list[tuple[int, int]]:
        """(worker id, item) for each listed worker on one sample longer than the deadline."""
        now, out = time.monotonic(), []
        for w in worker_ids:
            since = self._array[self._row(w)]
            if since and now - since > self.seconds:
                out.append((w, int(self._array[self.ROWS + self._row(w)])))
        return out

    def expire(self, item: int, worker_id: int | None) -> bool:
        """Remember ``item`` as expired; False once CAP samples are (the caller must stop: a
        sample not remembered would be tried, and stick, again)."""
        self._array[self._row(worker_id)] = 0.0
        n = int(self._array[2 * self.ROWS + 1])
        if n >= self.CAP:
            return False
        self._array[2 * self.ROWS + 2 + n] = item
        self._array[2 * self.ROWS + 1] = n + 1
        return True

    def expired(self) -> frozenset[int]:
        n = int(self._array[2 * self.ROWS + 1])
        if n != self._known[0]:
            start = 2 * self.ROWS + 2
            self._known = (n, frozenset(int(x) for x in self._array[start:start + n]))
        return self._known[1]

    @property
    def enforced(self) -> bool:
        """Set by a fastmm.DataLoader that replaces the workers stuck past it."""
        return bool(self._array[2 * self.ROWS])

    @enforced.setter
    def enforced(self, value: bool) -> None:
        self._array[2 * self.ROWS] = float(value)


SampleWatch = DecodeDeadline  # its older name (docs/loader.md)

class MultimodalDataset(torch.utils.data.Dataset):
    """Map-style dataset over a source of image and video samples.

    ``source``, ``decoder`` and ``device`` switch backends without touching training code.

    Args:
        root: where the samples are (a directory, manifest or shard directory); or give an open
            ``source`` instead.
        source: a name ("posix", "staged", "shards"; default FASTMM_SOURCE, then "posix"), or
            an open Source.
        decoder: a name ("pil", "torchvision", "torchcodec", "dali"; default FASTMM_DECODE, then
            "pil"), or an ImageDecoder object.
        device: where a decoder given by name decodes (default FASTMM_DEVICE, then "cpu").
        modality: "image" or "video" keeps only those samples (decided from member extensions,
            nothing read); intact samples with neither are left out. None: both.
        size: the output size (int or (h, w)); with ``crop`` it gives every item the same shape,
            so batches collate. None: no resize.
        crop: "random" (RandomResizedCrop + flip as torchvision draws them) or "center", used
            with ``size``; or a ``ResizedCrop``.
        reduce: True is the fast path (pil and torchvision backends): JPEGs decode at a
            DCT-reduced scale when the crop is at least twice the output size, the rest are
            resized by torch's vectorised uint8 kernel.
        clip: a ClipSpec, which videos need; a clip's frames are resized with the same plan.
        transform: runs last on the item dict.
        on_error: the bad-input policy, "raise", "skip" or "replace" (see the module).
        max_replace: under "replace", how many samples after a bad one are tried in its place
            before a RuntimeError.
        limits: the caps (DecodeLimits) of a decoder given by name.
        keep_problems: how many of this process's latest problems ``problems`` keeps.
        decode_deadline: seconds one sample may take (read, decode, transform); past it,
            fastmm.DataLoader replaces the worker and the sample counts as "deadline" (default
            FASTMM_DECODE_DEADLINE, then none; 0: none).
        **source_options: go to the source opened on ``root``.
    """

    fastmm_marks_sample_stage = True  # telemetry: its own "sample" spans, one per item (hooks)

    def __init__(
        self,
        root=None,
        *,
        source: str | Source | None = None,
        decoder=None,
        device: str | None = None,
        modality: Literal["image", "video"] | None = None,
        size: int | tuple[int, int] | None = None,
        crop: Literal["random", "center"] | ResizedCrop = "random",
        reduce: bool = False,
        clip: ClipSpec | None = None,
        transform: Callable[[dict], dict] | None = None,
        on_error: OnError = "raise",
        max_replace: int = 16,
        limits: DecodeLimits | None = None,
        keep_problems: int = 100,
        decode_deadline: float | None = None,
        **source_options,
    ):
        # what it was made from, for with_options (a benchmark's one-change arms)
        options = {k: v for k, v in locals().items() if k not in ("self", "source_options")}
        self.options = types.MappingProxyType({**options, **source_options})
        if on_error not in ("raise", "skip", "replace"):
            raise ValueError(f"on_error={on_error!r}; use 'raise', 'skip' or 'replace'")
        if modality not in (None, "image", "video"):
            raise ValueError(f"modality={modality!r}; use 'image', 'video' or None")
        if isinstance(source, Source):
            self.source = source
        else:
            if root is None:
                raise ValueError("give root (where the samples are) or an open source")
            # the dataset owns the bad-input policy, so the source reports every problem to it;
            # a file a staged source fails to copy is then those samples' problem, not the run's
            if on_error != "raise" and source_kind(source) == "staged":
                source_options.setdefault("defer_failures", True)
            self.source = open_source(source, root, on_error="raise", **source_options)
        self.decoder = (
            decoder if isinstance(decoder, ImageDecoder)
            else get_decoder(decoder, device=device, limits=limits)
        )
        if isinstance(crop, ResizedCrop):
            self.crop = crop
        elif size is not None:
            self.crop = ResizedCrop(size=size, mode=crop)
        else:
            self.crop = None
        self.reduce = reduce
        self.clip = clip
        self.modality = modality
        self.transform = transform
        self.on_error = on_error
        self.max_replace = max_replace
        self.problems: deque[Problem] = deque(maxlen=keep_problems)  # this process's latest
        self.fastmm_skip_counts = _Counters()
        deadline = config.decode_deadline(decode_deadline)
        self.fastmm_decode_deadline = DecodeDeadline(deadline) if deadline else None
        self._said_unenforced = False  # warned that no loader enforces the deadline here
        self._items: list[int] | None = None
        self._ahead: dict = {}  # source index -> a read in flight (__getitems__)

    def with_options(self, **changes) -> "MultimodalDataset":
        """A new dataset made from this one's arguments with ``changes`` (e.g. ``decoder=``,
        ``reduce=``, ``source=``): the same samples through one other backend, as a
        benchmark's single-factor arm asks."""
        options = {**self.options, **changes}
        if "source" in changes and isinstance(self.options["source"], Source):
            raise ValueError("this dataset was given an open source: it has no root to open "
                             "another source on")
        return MultimodalDataset(**options)

    # -- index ---------------------------------------------------------------------------------

    def _index(self) -> list[int]:
        if self._items is None:
            wanted = {"image": IMAGE_EXTS, "video": VIDEO_EXTS}.get(self.modality,
                                                                    IMAGE_EXTS + VIDEO_EXTS)
            # a damaged sample may have lost the member that says what it is: kept, so that
            # reading it counts the damage (dropped here, it would be lost uncounted)
            self._items = [
                i for i in range(len(self.source))
                if self.source.damaged(i) or any(e in wanted for e in self.source.extensions(i))
            ]
            if not self._items:  # most likely a wrong root, source or modality: say so once
                warnings.warn(
                    f"fastmm: MultimodalDataset has no samples: its {self.source.kind} source "
                    f"holds {len(self.source)}, none with a member ending in "
                    f"{', '.join('.' + e for e in wanted)}", FastmmWarning, stacklevel=3)
        return self._items

    def __len__(self) -> int:
        return len(self._index())

    @property
    def skipped(self) -> dict[str, int]:
        """Bad samples met so far, by reason, summed over this process and its workers."""
        return self.fastmm_skip_counts.totals()[0]

    @property
    def replaced(self) -> int:
        """How many of those were replaced by another sample (on_error="replace")."""
        return self.fastmm_skip_counts.totals()[1]

    def state_dict(self) -> dict:
        """What a resumed run carries on from (``DataLoader.state_dict`` includes it): the skip
        and replace counts. Which samples come next is the loader's state; a bad sample is
        skipped or replaced the same way every time, so it needs nothing more."""
        skipped, replaced = self.fastmm_skip_counts.totals()
        state = {"skipped": skipped, "replaced": replaced}
        deadline = self.fastmm_decode_deadline
        if deadline is not None:  # so a resumed run does not get stuck on them again
            state["expired"] = sorted(deadline.expired())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.fastmm_skip_counts.set_totals(state["skipped"], state["replaced"])
        deadline = self.fastmm_decode_deadline
        for item in state.get("expired", ()):
            if deadline is not None and item not in deadline.expired():
                deadline.expire(item, None)

    # -- items ---------------------------------------------------------------------------------

    def __getitem__(self, index: int):
        return self._get(index)

    def __getitems__(self, indices: list[int]) -> list:
        """A batch's items; under on_error="skip" bad samples are left out of it. From an
        object store the batch's samples are fetched at once, then decoded one by one."""
        n = len(self._index())
        self._ahead = self.source.read_ahead(
            [self._items[i % n] for i in indices if isinstance(i, int) and -n <= i < n])
        try:
            with sample_by_sample() as put:
                items = [put(self._get(i), position) for position, i in enumerate(indices)]
        finally:
            for future in self._ahead.values():  # the batch failed: what it left unread
                future.cancel()
            self._ahead = {}
        if self.on_error == "skip":
            items = [item for item in items if item is not None]
            if not items:
                raise RuntimeError(
                    f"every sample of a batch of {len(indices)} was bad and skipped "
                    f"(counts so far: {self.skipped}); see the 'fastmm' log for keys"
                )
        return items

    def _get(self, index: int, *, count: bool = True):
        """The item at ``index`` under the policy; ``count=False`` for a sample tried again in
        the same epoch (ShardStream's padding), whose badness was counted the first time."""
        with sample_stage():
            return self._get_unmarked(index, count)

    def _get_unmarked(self, index: int, count: bool):
        items = self._index()
        n = len(items)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        index %= n
        for attempt in range(self.max_replace + 1):
            item = (index + attempt) % n
            try:
                return self._load_within_deadline(item)
            except (SourceError, DecodeError) as e:
                if self.on_error == "raise":
                    raise
                if attempt == 0 and count:  # a bad stand-in is passed over, counted at its own index
                    self._count(e, replaced=self.on_error == "replace")
                if self.on_error == "skip":
                    return None
        raise RuntimeError(
            f"{self.max_replace + 1} samples in a row from index {index} were bad; "
            f"counts so far: {self.skipped}"
        )

    def _load_within_deadline(self, item: int) -> dict:
        deadline = self.fastmm_decode_deadline
        if deadline is None:
            return self._load(self._items[item])
        if item in deadline.expired():
            raise DecodeError("deadline", self.source.keys()[self._items[item]],
                              f"took over decode_deadline={deadline.seconds:g}s before; its "
                              f"worker was replaced and the sample is not tried again")
        if not deadline.enforced and not self._said_unenforced:
            self._said_unenforced = True
            warnings.warn("fastmm: decode_deadline is enforced by fastmm.DataLoader with "
                          "num_workers > 0 (it replaces a stuck worker) over this dataset or "
                          "a wrapper that keeps it as `.dataset` or in `.datasets`; here a "
                          "stuck sample would block", FastmmWarning, stacklevel=5)
        deadline.begin(item)
        try:
            return self._load(self._items[item])
        finally:
            deadline.end()

    def _count(self, error: SourceError | DecodeError, replaced: bool) -> None:
        origin = getattr(error, "origin", "")
        self.fastmm_skip_counts.add(error.reason, replaced)
        self.problems.append(Problem(error.reason, error.key, origin, str(error)))
        log.warning("fastmm: %s sample %r (%s): %s", "replaced" if replaced else "skipped",
                    error.key, origin or "decoder", error)

    def _load(self, i: int) -> dict:
        with stage("read") as mark:
            ahead = self._ahead.pop(i, None)
            sample = self.source.read(i) if ahead is None else ahead.result()
            mark.bytes = sum(len(v) for v in sample.members.values())
        key = sample.key
        image = next((e for e in IMAGE_EXTS if e in sample.members), None)
        video = next((e for e in VIDEO_EXTS if e in sample.members), None)
        try:
            with stage("decode"):  # with the crop and resize planned into it
                if image is not None and self.modality != "video":
                    item = {"key": key, "image": self._image(sample.members[image], key)}
                elif video is not None:
                    item = {"key": key, "video": self._video(sample.members[video], key)}
                else:
                    raise SourceError("missing_member", key, sample.origin, "no image or video")
        except DecodeError as e:
            e.origin = sample.origin  # a decode error names where the bytes came from too
            raise
        item["caption"] = sample.members.get("txt", b"").decode("utf-8", "replace")
        item["label"] = _label(sample.members.get("cls", b""), key, sample.origin)
        if self.transform is None:
            return item
        with stage("augment"):
            return self.transform(item)

    def _image(self, data: bytes, key: str) -> torch.Tensor:
        if self.crop is None:
            return self.decoder.decode_image(data, key=key)
        return self.decoder.decode_resized_crop(data, self.crop.plan, key=key, reduce=self.reduce)

    def _video(self, data: bytes, key: str) -> torch.Tensor:
        if self.clip is None:
            raise DecodeError("unsupported", key, "a video sample needs clip=ClipSpec(...)")
        if not isinstance(self.decoder, VideoDecoder):
            raise DecodeError("unsupported", key,
                              f"the {self.decoder.name} decoder has no video; use torchcodec")
        if self.crop is None:
            return self.decoder.decode_clip(data, self.clip, key=key)[0]
        return self.decoder.decode_resized_clip(data, self.clip, self.crop.plan, key=key)[0]
