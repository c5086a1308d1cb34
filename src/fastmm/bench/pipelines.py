"""Whole pipelines side by side: fastmm's own decode + crop/resize against what a torch user
typically writes, on the generated multimodal corpus, same output size, batch and workers.

- images: torch DataLoader over a Dataset doing PIL open + convert RGB + torchvision v2
  RandomResizedCrop(224) + RandomHorizontalFlip + PILToTensor, against fastmm.DataLoader over
  MultimodalDataset's fast path (torchvision backend, reduce=True: crop planned from the header,
  libjpeg-turbo decode into a tensor, JPEG DCT-reduced decode when the crop allows it, torch's
  uint8 resize) and its exact path (pil backend: bit-exact with the torch arm);
- images, where NVIDIA DALI is installed: DALI's own CPU pipeline as its documentation writes
  one (file reader, fused decode + random crop, antialiased resize, coin-flip mirror; its
  ``num_threads`` equal to the other arms' workers), in place of a DataLoader;
- images, where SPDL is installed: SPDL's own thread pipeline (FFmpeg demux and decode, the
  crop drawn as RandomResizedCrop draws it, crop + bilinear scale + flip in FFmpeg's filter
  graph; as many threads as the other arms' workers), batches as SPDL gives them (NHWC);
- images, where Mosaic Streaming is installed (it pins numpy < 2.2: ``scripts/mosaic-env``
  makes a venv with it and every other arm's library): its own pipeline, the images written
  once to MDS shards, a StreamingVisionDataset (its shuffle) whose transform is the torch arm's,
  in torch DataLoader workers;
- images from the corpus's tar shards, where webdataset is installed: WebDataset's own pipeline
  as its documentation writes one (shards resampled, shuffle buffer, Pillow decode, the torch
  arm's v2 augmentation, batched in torch DataLoader workers), against fastmm.DataLoader over
  MultimodalDataset reading the same shards by offset (the fast path as above);
- video: 16-frame clips at 224x224 (frames every 2nd source frame from a random start): torch
  DataLoader over a Dataset that decodes with torchcodec (then v2 Resize(224) + CenterCrop(224)),
  the same with PyAV, against fastmm.DataLoader over MultimodalDataset (torchcodec backend,
  centre crop first, then torch's uint8 resize), with and without leaving out the
  non-reference frames the clip does not return (decode.mp4; the same pixels); and, where SPDL
  is installed, SPDL's own thread pipeline (the clip's frames decoded by
  ``sample_decode_video``, scaled and centre-cropped in FFmpeg's filter graph).

Every arm's frame and crop choices come from the same random draws (ClipSpec, and torchvision's
RandomResizedCrop order), so all arms do the same work; DALI's arm draws its own crops and
order (the same area and aspect-ratio ranges as RandomResizedCrop's). Repetitions are
interleaved (A B C, B C A, C A B, ...) after an untimed warm-up; figures are medians with
min-max. Run:
``python -m fastmm.bench.pipelines --out DIR`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import platform
import shutil
import sys
import time

import torch
from torch.utils.data import Dataset

from . import env, harness, options, stats
from .corpus import default_cache_dir
from .env import library_versions
from .mmcorpus import MMCORPUS_VERSION, CorpusSpec, write_corpus
from .report import save
from .workloads import CONSUMERS, image_transform

CLIP_FRAMES, CLIP_STRIDE, SIZE = 16, 2, 224


def media(item: dict) -> torch.Tensor:
    """MultimodalDataset item -> its image or clip, so every arm yields plain uint8 batches."""
    return item["image"] if "image" in item else item["video"]


class PillowAugment:
    """The typical user's image work: PIL open (a path, or the encoded bytes), convert to RGB,
    torchvision v2 augmentation."""

    def __init__(self):
        self.transform = image_transform(SIZE)

    def __call__(self, source) -> torch.Tensor:
        from PIL import Image

        if isinstance(source, bytes):
            source = io.BytesIO(source)
        with Image.open(source) as im:
            return self.transform(im.convert("RGB"))


class TorchImageDataset(Dataset):
    """The typical user Dataset: each file through PillowAugment."""

    def __init__(self, files: list[str]):
        self.files = files
        self.augment = PillowAugment()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.augment(self.files[i])


def _clip_spec():
    from ..decode import ClipSpec

    return ClipSpec(num_frames=CLIP_FRAMES, stride=CLIP_STRIDE, sampling="random")


def _resize_crop(frames: torch.Tensor) -> torch.Tensor:
    from torchvision.transforms import v2

    return v2.functional.center_crop(v2.functional.resize(frames, SIZE, antialias=True), SIZE)


class TorchcodecClipDataset(Dataset):
    """A user Dataset decoding clips with torchcodec, then torchvision Resize + CenterCrop."""

    def __init__(self, files: list[str]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        from torchcodec.decoders import VideoDecoder

        dec = VideoDecoder(self.files[i], seek_mode="exact")
        meta = dec.metadata
        idx = _clip_spec().frame_indices(meta.num_frames, meta.average_fps)
        return _resize_crop(dec.get_frames_at(indices=idx).data)


class PyAVClipDataset(Dataset):
    """A user Dataset decoding clips with PyAV (seek to the keyframe before the clip, decode on,
    keep the frames asked for), then torchvision Resize + CenterCrop."""

    def __init__(self, files: list[str]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        import av

        with av.open(self.files[i]) as container:
            stream = container.streams.video[0]
            idx = _clip_spec().frame_indices(stream.frames, float(stream.average_rate))
            rate, tb = stream.average_rate, stream.time_base
            start_pts = int(idx[0] / rate / tb)
            container.seek(start_pts, stream=stream, backward=True, any_frame=False)
            wanted, frames = set(idx), {}
            for frame in container.decode(stream):
                n = round(frame.pts * tb * rate)
                if n in wanted:
                    frames[n] = torch.from_numpy(frame.to_ndarray(format="rgb24"))
                if n >= idx[-1]:
                    break
        clip = torch.stack([frames[n] for n in idx]).permute(0, 3, 1, 2)
        return _resize_crop(clip)


class OwnPipeline:
    """An arm that is another library's own pipeline, iterated like a loader. It takes the
    DataLoader arguments the benchmark passes, runs ``num_workers`` threads or workers, and
    ignores the sampler: it draws its own order, seeded from torch's seed, so each repetition
    differs as the other arms' do."""

    def __init__(self, files: list[str], *, batch_size: int, num_workers: int, sampler=None):
        self.files, self.batch_size, self.threads = files, batch_size, max(1, num_workers)
        self.seed = torch.initial_seed() % 2**31


class DaliImageLoader(OwnPipeline):
    """DALI's CPU image pipeline: batches of uint8 Bx3xSIZExSIZE torch tensors (one copy out of
    DALI's memory, as its PyTorch iterator makes); DALI's reader shuffles."""

    def __iter__(self):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=None,
                      seed=self.seed)
        def images():
            encoded, _ = fn.readers.file(files=self.files, random_shuffle=True)
            # libjpeg-turbo decodes only the crop's region of a JPEG
            img = fn.decoders.image_random_crop(encoded, device="cpu", output_type=types.RGB)
            img = fn.resize(img, size=(SIZE, SIZE), antialias=True)
            img = fn.flip(img, horizontal=fn.random.coin_flip())
            return fn.transpose(img, perm=[2, 0, 1])

        pipe = images()
        pipe.build()
        try:
            while True:
                (out,) = pipe.run()
                yield torch.from_numpy(out.as_array())
        finally:
            del pipe  # its threads end here, before the next arm forks workers


class WebDatasetImageLoader(OwnPipeline):
    """WebDataset's own pipeline as its documentation writes one, over tar shards (``files``):
    shards resampled without end, a shuffle buffer, Pillow decode and the torch arm's v2
    augmentation in torch DataLoader workers, batched there."""

    def __iter__(self):
        import webdataset as wds

        transform = image_transform(SIZE)
        images = (wds.WebDataset(self.files, resampled=True, shardshuffle=False, seed=self.seed)
                  .select(lambda sample: "jpg" in sample or "png" in sample)  # not the videos
                  .shuffle(1000).decode("pilrgb").to_tuple("jpg;png").map_tuple(transform)
                  .batched(self.batch_size))
        for (batch,) in wds.WebLoader(images, batch_size=None, num_workers=self.threads):
            yield batch


MOSAIC_EPOCH = 1 << 20  # samples: longer than any repetition


class MosaicImageLoader(OwnPipeline):
    """Mosaic Streaming's own image pipeline as its documentation writes one: the images in MDS
    shards (``files`` is their directory, see ``ensure_mds``), a StreamingVisionDataset over
    them (its shuffle; one epoch as long as the run needs, its samples drawn again) whose
    transform is the torch arm's (Pillow decode, v2 augmentation), in torch DataLoader
    workers."""

    def __iter__(self):
        from streaming.vision.base import StreamingVisionDataset

        images = StreamingVisionDataset(
            local=self.files, shuffle=True, shuffle_seed=self.seed, batch_size=self.batch_size,
            epoch_size=MOSAIC_EPOCH, transform=PillowAugment())
        loader = torch.utils.data.DataLoader(images, batch_size=self.batch_size,
                                             num_workers=self.threads)
        for x, _ in loader:
            yield x


def ensure_mds(root: str, files: list[str]) -> str:
    """The images ``files`` as Mosaic Streaming's MDS shards beside the corpus (their encoded
    bytes, label = position), written once with its MDSWriter; returns their directory."""
    out = os.path.join(root, "mds")
    if not os.path.exists(os.path.join(out, "index.json")):
        from streaming import MDSWriter

        partial = out + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        with MDSWriter(out=partial, columns={"x": "bytes", "y": "int"}) as writer:
            for i, path in enumerate(files):
                with open(path, "rb") as f:
                    writer.write({"x": f.read(), "y": i})
        os.rename(partial, out)
    return out


class SpdlPipeline(OwnPipeline):
    """What SPDL's arms share: its thread pipeline over the files in an endless random order,
    ``decode`` on as many threads as the other arms' workers, ``batch`` on each batch's items."""

    def _run(self, decode, batch):
        from spdl.pipeline import PipelineBuilder

        order = torch.Generator().manual_seed(self.seed)

        def paths():
            while True:
                yield from (self.files[i] for i in torch.randint(
                    len(self.files), (1024,), generator=order).tolist())

        pipeline = (PipelineBuilder().add_source(paths())
                    .pipe(decode, concurrency=self.threads)
                    .aggregate(self.batch_size).pipe(batch).add_sink(2)
                    .build(num_threads=self.threads))
        with pipeline.auto_stop():
            yield from pipeline


class SpdlImageLoader(SpdlPipeline):
    """SPDL's own image pipeline as its documentation writes one: each file demuxed and decoded
    by FFmpeg, the crop and resize done in FFmpeg's filter graph (box and flip drawn as
    RandomResizedCrop draws them, bilinear scale to 224x224, RGB), each batch converted into
    one buffer and handed out as a torch tensor without a copy (NHWC, as SPDL gives it)."""

    def __iter__(self):
        import spdl.io

        from ..dataset import ResizedCrop

        crop = ResizedCrop(size=(SIZE, SIZE))

        def decode(path: str):
            packets = spdl.io.demux_image(path)
            p = crop.plan(packets.width, packets.height)
            flip = ",hflip" if p.flip else ""
            return spdl.io.decode_packets(packets, filter_desc=(
                f"crop={p.width}:{p.height}:{p.left}:{p.top},"
                f"scale={p.out_width}:{p.out_height}:flags=bilinear{flip},format=rgb24"))

        return self._run(decode, lambda frames: spdl.io.to_torch(spdl.io.convert_frames(frames)))


class SpdlClipLoader(SpdlPipeline):
    """SPDL's own video pipeline: each file demuxed, the clip's frames drawn as the other arms
    draw them (ClipSpec, from the packet count and frame rate) and just those decoded
    (``spdl.io.sample_decode_video``), FFmpeg's filter graph scaling the short side to 224 and
    cropping the centre (bilinear, RGB); a batch is its clips stacked, BxTxHxWxC as SPDL gives
    them."""

    def __iter__(self):
        import spdl.io

        scale_crop = spdl.io.get_video_filter_desc(
            scale_width=SIZE, scale_height=SIZE, scale_mode="crop", scale_algo="bilinear",
            pix_fmt="rgb24")

        def decode(path: str) -> torch.Tensor:
            packets = spdl.io.demux_video(path)
            num, den = packets.frame_rate
            idx = _clip_spec().frame_indices(len(packets), num / den)
            frames = spdl.io.sample_decode_video(packets, idx, filter_desc=scale_crop)
            return spdl.io.to_torch(spdl.io.convert_frames(frames))

        return self._run(decode, torch.stack)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing too
        return False


def ensure_mmcorpus(spec: CorpusSpec, cache_dir) -> str:
    """The multimodal corpus of ``spec`` in the cache, generated once."""
    key = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    root = os.path.join(str(cache_dir), f"mmcorpus-v{MMCORPUS_VERSION}-{key.hexdigest()[:12]}")
    if not os.path.exists(os.path.join(root, "composition.json")):
        print(f"generating the multimodal corpus in {root} ...", file=sys.stderr, flush=True)
        write_corpus(spec, root, processes=None,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    return root


def _files(root: str, exts: tuple[str, ...]) -> list[str]:
    with open(os.path.join(root, "posix", "manifest.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [os.path.join(root, "posix", path) for r in rows
            for ext, path in r["members"].items() if ext in exts]


def _arms(root: str, workload: str, batch: int, workers: int):
    import fastmm
    from ..dataset import MultimodalDataset

    manifest = os.path.join(root, "posix", "manifest.jsonl")
    if workload == "image":
        files = _files(root, ("jpg", "png"))
        ours = dict(source="posix", modality="image", size=SIZE, transform=media)
        arms = {
            "torch (PIL + v2)": (torch.utils.data.DataLoader, TorchImageDataset(files)),
            "fastmm": (fastmm.DataLoader, MultimodalDataset(
                manifest, decoder="torchvision", reduce=True, **ours)),
            "fastmm, exact (pil)": (fastmm.DataLoader, MultimodalDataset(
                manifest, decoder="pil", **ours)),
        }
        if _installed("nvidia.dali"):
            arms["DALI (CPU pipeline)"] = (DaliImageLoader, files)
        if _installed("spdl.io"):
            arms["SPDL (threads, FFmpeg)"] = (SpdlImageLoader, files)
        if _installed("streaming"):
            arms["Mosaic Streaming (MDS, PIL + v2)"] = (MosaicImageLoader, ensure_mds(root, files))
        if _installed("webdataset"):
            shards = os.path.join(root, "shards")
            arms["WebDataset (tar shards, PIL + v2)"] = (WebDatasetImageLoader, sorted(
                os.path.join(shards, n) for n in os.listdir(shards) if n.endswith(".tar")))
            arms["fastmm, tar shards"] = (fastmm.DataLoader, MultimodalDataset(
                shards, decoder="torchvision", reduce=True, **{**ours, "source": "shards"}))
        return arms
    from ..decode.torchcodec import Decoder

    files = _files(root, ("mp4",))
    ours = dict(source="posix", modality="video", clip=_clip_spec(), size=SIZE, crop="center",
                transform=media)
    arms = {
        "torch + torchcodec": (torch.utils.data.DataLoader, TorchcodecClipDataset(files)),
        "torch + PyAV": (torch.utils.data.DataLoader, PyAVClipDataset(files)),
        "fastmm (torchcodec)": (fastmm.DataLoader, MultimodalDataset(
            manifest, decoder=Decoder(), **ours)),
        "fastmm, every frame decoded": (fastmm.DataLoader, MultimodalDataset(
            manifest, decoder=Decoder(skip_unused_frames=False), **ours)),
    }
    if _installed("spdl.io"):
        arms["SPDL (threads, FFmpeg)"] = (SpdlClipLoader, files)
    return arms


def measure_fast_path(root: str, limit: int = 400) -> dict:
    """The image fast path against the exact one, one thread: the time of decode + random crop
    + resize to 224 (torchvision backend with reduce=True vs pil without), and the pixel
    difference it makes (same crops), on the corpus's JPEGs."""
    from ..dataset import ResizedCrop
    from ..decode import get_decoder

    decoders = {False: get_decoder("pil"), True: get_decoder("torchvision")}
    crop = ResizedCrop(size=(SIZE, SIZE))
    datas = []
    for path in _files(root, ("jpg",))[:limit]:
        with open(path, "rb") as f:
            datas.append(f.read())
    times = {False: 0.0, True: 0.0}
    diffs, reduced = [], 0
    for i, data in enumerate(datas):
        outs = {}
        for reduce in (False, True):
            torch.manual_seed(i)  # the same crop both ways
            t0 = time.perf_counter()
            outs[reduce] = decoders[reduce].decode_resized_crop(data, crop.plan, reduce=reduce)
            times[reduce] += time.perf_counter() - t0
        d = (outs[True].float() - outs[False].float()).abs()
        if d.max() > 0:
            reduced += 1
            diffs.append(d.mean().item())
    n = len(datas)
    return {
        "images": n, "crop": f"RandomResizedCrop({SIZE}) as torchvision draws it",
        "exact_ms_per_image": times[False] / n * 1e3, "fast_ms_per_image": times[True] / n * 1e3,
        "speedup": times[False] / times[True], "images_whose_pixels_differ": reduced,
        "mean_abs_diff_levels": stats.summarize(diffs),
    }


def run(args) -> dict:
    spec = CorpusSpec(num_images=args.images, num_videos=args.videos, seed=args.seed)
    root = ensure_mmcorpus(spec, args.cache_dir)
    consume = CONSUMERS["sum64"][0]
    out = {"command": " ".join(env.module_argv(__spec__, __name__)), "corpus": json.load(open(os.path.join(
        root, "composition.json"))), "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "torch": torch.__version__, "versions": library_versions(),
        "cases": {}}
    if "image" in args.workloads:
        out["fast_path"] = measure_fast_path(root)
    for workload in args.workloads:
        batch = args.image_batch if workload == "image" else args.video_batch
        arms = _arms(root, workload, batch, args.num_workers)

        def rep(name, seconds, rep_index):
            loader_class, dataset = arms[name]

            def make():
                torch.manual_seed(args.seed + rep_index)
                # endless random order, the same draws for every arm of a repetition
                sampler = torch.utils.data.RandomSampler(dataset, replacement=True,
                                                         num_samples=1 << 40)
                return loader_class(dataset, batch_size=batch, sampler=sampler,
                                    num_workers=args.num_workers)
            fig = harness.run_loader(make, args.num_workers, seconds, consume)
            print(f"[{workload}] rep {rep_index} {name:34s} {fig['samples_per_s']:8.1f} "
                  "samples/s", file=sys.stderr, flush=True)
            return fig

        figs = {name: [] for name in arms}
        for name in arms:
            rep(name, args.warmup_seconds, -1)
        for r in range(args.reps):
            for name in harness.rotated(list(arms), r):
                figs[name].append(rep(name, args.min_seconds, r))
        rates = {n: [f["samples_per_s"] for f in fs] for n, fs in figs.items()}
        base = next(iter(arms))
        ours = [n for n in arms if n.startswith("fastmm")]
        pairs = [(a, b) for a in ours for b in arms if not b.startswith("fastmm")]
        pairs += [(ours[0], b) for b in ours[1:]]  # the default against its variants
        out["cases"][workload] = {
            "batch_size": batch, "num_workers": args.num_workers,
            "arms": {n: stats.summarize(v) for n, v in rates.items()},
            "samples_per_s": rates,  # every repetition, in the order they ran
            "ratios_over_baselines": {
                f"{a} / {b}": stats.summarize(stats.paired_ratios(rates[a], rates[b]))
                for a, b in pairs
            },
            "baseline": base,
        }
    return out


def report(result: dict) -> str:
    lines = [f"pipelines on {result['cores']} cores ({result['machine']}), torch {result['torch']}"]
    r = result.get("fast_path")
    if r:
        diff = r["mean_abs_diff_levels"] or {"median": 0.0, "max": 0.0}
        lines.append(
            f"image fast path, 1 thread, {r['images']} JPEGs: exact {r['exact_ms_per_image']:.2f}"
            f" -> fast {r['fast_ms_per_image']:.2f} ms/image ({r['speedup']:.2f}x); "
            f"{r['images_whose_pixels_differ']} differ, mean |diff| median "
            f"{diff['median']:.2f}, max {diff['max']:.2f} levels of 255")
    for workload, case in result["cases"].items():
        lines.append(f"\n{workload}: batch {case['batch_size']}, {case['num_workers']} workers "
                     "(samples/s median [min-max])")
        width = max(map(len, case["arms"]))
        for name, s in case["arms"].items():
            lines.append(f"  {name:{width}s} {s['median']:8.1f} [{s['min']:.1f}-{s['max']:.1f}]")
        width = max(map(len, case["ratios_over_baselines"]))
        for name, s in case["ratios_over_baselines"].items():
            if s:
                lines.append(f"  {name:{width}s} {s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]")
    return "\n".join(lines)


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.pipelines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default="bench-out/pipelines")
    p.add_argument("--workloads", type=options.listed(str, ("image", "video")), default="image,video")
    p.add_argument("--images", type=options.whole(1), default=1500)
    p.add_argument("--videos", type=options.whole(1), default=24)
    p.add_argument("--image-batch", type=options.whole(1), default=64)
    p.add_argument("--video-batch", type=options.whole(1), default=8)
    p.add_argument("--num-workers", type=options.whole(1), default=2)
    p.add_argument("--reps", type=options.whole(1), default=3)
    p.add_argument("--min-seconds", type=options.number(0), default=5.0)
    p.add_argument("--warmup-seconds", type=options.number(0), default=2.0)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--quick", action="store_true", help="smoke run: small corpus, short reps")
    args = options.parse(p, argv, {"images": 64, "videos": 4, "reps": 1, "min_seconds": 0.5,
                                   "warmup_seconds": 0.5})
    result = run(args)
    save(args.out, "pipelines", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
