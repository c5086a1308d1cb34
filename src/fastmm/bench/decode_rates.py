"""Decode rates on the CPU and on the GPU, and where the GPU overtakes the CPU (issue 3).

Images: the generated corpus's JPEGs in three size classes (under 0.3 MP, 0.3-1 MP, 1 MP and
over). CPU: torchvision's ``decode_jpeg`` (libjpeg-turbo) on one thread, images/s per core. GPU:
nvJPEG through torchvision's batched ``decode_jpeg`` at batch 1, 8 and 64, host bytes in and
images on the device, timed until the device is done.
Video: the pipelines' clip (16 frames, every 2nd, from a seeded random start) decoded by
torchcodec on one CPU thread and by NVDEC (``device="cuda"``), per source resolution.

The crossover is given two ways: the CPU cores that decode as fast as the GPU (GPU rate over the
per-core rate) and, for images, the smallest batch at which the GPU beats one core. Each GPU arm
is checked against the CPU's output (mean absolute pixel difference; for video also the frame
index drawn in the pixels). Arms this machine cannot run are reported as not measured, with why.
Run: ``python -m fastmm.bench.decode_rates --out DIR`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import warnings

import torch

from . import env, options, plots, stats
from .corpus import default_cache_dir
from .harness import OtherCores
from .mmcorpus import CorpusSpec, read_frame_index
from .page import Page
from .pipelines import _clip_spec, _files, ensure_mmcorpus
from .report import busy_notes, save

IMAGE_CLASSES = (("under 0.3 MP", 0, 300_000), ("0.3-1 MP", 300_000, 1_000_000),
                 ("1 MP and over", 1_000_000, 1 << 62))
GPU_BATCHES = (1, 8, 64)


def _rate(work, units: int, min_seconds: float, sync=None) -> float:
    """Units per second of ``work()`` (each call does ``units``), over at least min_seconds."""
    done, start = 0, time.perf_counter()
    while True:
        work()
        if sync:
            sync()
        done += units
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return done / elapsed


def _sync(device: str):
    return torch.cuda.synchronize if device.startswith("cuda") else None


def image_classes(paths: list[str]) -> dict[str, list[bytes]]:
    from PIL import Image

    out: dict[str, list[bytes]] = {name: [] for name, _, _ in IMAGE_CLASSES}
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as im:
            pixels = im.width * im.height
        for name, low, high in IMAGE_CLASSES:
            if low <= pixels < high:
                out[name].append(data)
    return {k: v for k, v in out.items() if v}


def image_arms(classes: dict[str, list[bytes]], args, gpu: str | None,
               others: list[float | None]) -> dict:
    """Per size class, images/s on one CPU thread and with nvJPEG at each batch; ``others``
    gets the cores other processes used during each repetition."""
    from torchvision import io as tvio

    rgb = tvio.ImageReadMode.RGB
    tensors = {k: [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in v]
               for k, v in classes.items()}
    arms: dict[str, dict] = {}
    for name, images in tensors.items():
        def cpu_all(images=images):
            for t in images:
                tvio.decode_jpeg(t, mode=rgb)

        figs = {"cpu 1 thread": []} | {f"gpu batch {b}": [] for b in GPU_BATCHES if gpu}
        for _ in range(args.reps):
            with OtherCores() as busy:
                figs["cpu 1 thread"].append(_rate(cpu_all, len(images), args.min_seconds))
                for b in GPU_BATCHES if gpu else ():
                    batch = (images * (b // len(images) + 1))[:b]
                    figs[f"gpu batch {b}"].append(_rate(
                        lambda batch=batch: tvio.decode_jpeg(batch, mode=rgb, device=gpu), b,
                        args.min_seconds, _sync(gpu)))
            others.append(busy.cores)
        arm = {"images": len(images), "rates": {k: stats.summarize(v) for k, v in figs.items()}}
        if gpu:
            on_cpu = [tvio.decode_jpeg(t, mode=rgb) for t in images[:16]]
            on_gpu = tvio.decode_jpeg(images[:16], mode=rgb, device=gpu)
            arm["gpu_vs_cpu_mean_abs_diff"] = max(
                (a.float() - g.cpu().float()).abs().mean().item() for a, g in zip(on_cpu, on_gpu))
        arms[name] = arm
    return arms


def _clip_jobs(paths: list[str], seed: int):
    """{"WxH": [(bytes, frame indices), ...]}: one seeded clip per video, as the pipelines draw,
    grouped by resolution."""
    from torchcodec.decoders import VideoDecoder

    jobs: dict[str, list] = {}
    g = torch.Generator().manual_seed(seed)
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        meta = VideoDecoder(data).metadata
        idx = _clip_spec().frame_indices(meta.num_frames, meta.average_fps, generator=g)
        jobs.setdefault(f"{meta.width}x{meta.height}", []).append((data, idx))
    return dict(sorted(jobs.items(), key=lambda kv: int(kv[0].split("x")[0])))


def video_arms(paths: list[str], args, gpu: str | None,
               others: list[float | None]) -> tuple[dict, str | None]:
    """Per resolution, clips/s on one CPU thread and with NVDEC; the reason NVDEC was not
    measured, if it was not. torchcodec's own NVDEC backend is tried first, then FFmpeg's.
    ``others`` gets the cores other processes used during each repetition."""
    import contextlib

    from torchcodec.decoders import VideoDecoder, set_cuda_backend

    backend = None

    def decode(data, idx, device):
        with set_cuda_backend(backend) if device.startswith("cuda") else contextlib.nullcontext():
            dec = VideoDecoder(data, device=device, seek_mode="exact")
        frames = dec.get_frames_at(idx).data
        if device.startswith("cuda") and dec.cpu_fallback:
            raise RuntimeError(f"torchcodec fell back to the CPU: {dec.cpu_fallback}")
        return frames

    jobs = _clip_jobs(paths, args.seed)
    nvdec_why = None if gpu else "no CUDA device on this machine"
    if gpu:
        tried = []
        # torchcodec's own NVDEC backend ("beta" in 0.11, "nvdec" in later releases), then FFmpeg's
        for backend in ("nvdec", "beta", "ffmpeg") if gpu.startswith("cuda") else (None,):
            try:
                data, idx = next(iter(jobs.values()))[0]
                decode(data, idx, gpu)
                break
            except Exception as e:  # no NVDEC in the driver, FFmpeg without CUDA, ...
                tried.append(f"{backend}: {type(e).__name__}: {e}"[:200])
        else:
            import torchcodec

            from ..decode.torchcodec import built_without_cuda

            no_cuda = any(built_without_cuda(t) for t in tried)
            nvdec_why = (f"torchcodec {torchcodec.__version__} "
                         + ("was built without CUDA: "
                            if no_cuda else "could not decode on CUDA: ")
                         + "; ".join(tried))
    arms = {}
    for res, clips in jobs.items():
        def run(device, clips=clips):
            for data, idx in clips:
                decode(data, idx, device)

        figs = {"cpu 1 thread": []} | ({"nvdec": []} if nvdec_why is None else {})
        for _ in range(args.reps):
            with OtherCores() as busy:
                figs["cpu 1 thread"].append(_rate(lambda: run("cpu"), len(clips),
                                                  args.min_seconds))
                if nvdec_why is None:
                    figs["nvdec"].append(_rate(lambda: run(gpu), len(clips), args.min_seconds,
                                               _sync(gpu)))
            others.append(busy.cores)
        arm = {"clips": len(clips), "rates": {k: stats.summarize(v) for k, v in figs.items()}}
        if nvdec_why is None:
            data, idx = clips[0]
            on_cpu, on_gpu = decode(data, idx, "cpu"), decode(data, idx, gpu).cpu()
            arm["nvdec_vs_cpu_mean_abs_diff"] = (on_cpu.float() - on_gpu.float()).abs().mean().item()
            arm["nvdec_frames_right"] = [read_frame_index(f) for f in on_gpu] == idx
            arm["cuda_backend"] = backend
        arms[res] = arm
    return arms, nvdec_why


def crossover(arms: dict, gpu_keys: list[str]) -> None:
    """Adds to each arm: cores_matching_gpu (best GPU rate / one core's rate) and, where there
    are several GPU batch sizes, the smallest batch whose rate beats one core."""
    for arm in arms.values():
        rates = arm["rates"]
        core = rates["cpu 1 thread"]["median"]
        gpu = {k: rates[k]["median"] for k in gpu_keys if rates.get(k)}
        if not gpu:
            continue
        arm["cores_matching_gpu"] = max(gpu.values()) / core
        if len(gpu) > 1:
            beating = [int(k.rsplit(" ", 1)[1]) for k, r in gpu.items() if r > core]
            arm["gpu_beats_one_core_from_batch"] = min(beating) if beating else None


def run(args) -> dict:
    torch.set_num_threads(1)
    gpu = args.accelerator if args.accelerator == "cpu" or torch.cuda.is_available() else None
    root = ensure_mmcorpus(CorpusSpec(num_images=args.images, num_videos=args.videos,
                                      seed=args.seed), args.cache_dir)
    others: list[float | None] = []  # per repetition of each arm: other processes' cores
    print("[decode-rates] images ...", file=sys.stderr, flush=True)
    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders (fastmm's backend too)
        warnings.simplefilter("ignore", DeprecationWarning)
        images = image_arms(image_classes(_files(root, ("jpg",))), args, gpu, others)
    crossover(images, [f"gpu batch {b}" for b in GPU_BATCHES])
    videos, nvdec_why, video_why = {}, None, None
    try:
        import torchcodec  # noqa: F401
    except Exception as e:  # not installed, or no FFmpeg libraries it can load
        video_why = f"torchcodec unavailable: {type(e).__name__}: {e}"[:300]
    if video_why is None and args.videos:
        print("[decode-rates] video ...", file=sys.stderr, flush=True)
        videos, nvdec_why = video_arms(_files(root, ("mp4",)), args, gpu, others)
        crossover(videos, ["nvdec"])
    return {
        "environment": env.capture(env.module_argv(__spec__, __name__), paths=[args.cache_dir]),
        "reps": args.reps, "min_seconds": args.min_seconds,
        "images": images,
        "accelerator": gpu,
        "gpu_images": {"measured": bool(gpu), "why": None if gpu else "no CUDA device on this machine"},
        "videos": videos,
        "nvdec": {"measured": video_why is None and nvdec_why is None,
                  "why": video_why or nvdec_why},
        "other_processes_cpu_cores": others,
    }


def _fmt(s: dict | None) -> str:
    return stats.interval(s, 0)


def _num(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


IMAGE_HEADER = (["size class", "images", "CPU, 1 thread"]
                + [f"nvJPEG batch {b}" for b in GPU_BATCHES]
                + ["cores matching the GPU", "GPU beats a core from batch", "GPU vs CPU pixels"])
VIDEO_HEADER = ["source", "clips", "CPU, 1 thread", "NVDEC", "cores matching the GPU",
                "NVDEC frames right", "NVDEC vs CPU pixels"]
READING = ("Cores matching the GPU: the GPU's best rate over one CPU thread's, i.e. how many "
           "decoding cores one GPU stands in for (before the GPU's other work). A class where "
           "it is below the cores a job can spare is one to keep on the CPU.")


def _image_rows(result: dict) -> list[list[str]]:
    return [[name, str(a["images"]), _fmt(a["rates"]["cpu 1 thread"])]
            + [_fmt(a["rates"].get(f"gpu batch {b}")) for b in GPU_BATCHES]
            + [_num(a.get("cores_matching_gpu")), _num(a.get("gpu_beats_one_core_from_batch"), "d"),
               _num(a.get("gpu_vs_cpu_mean_abs_diff"), ".2f")]
            for name, a in result["images"].items()]


def _video_rows(result: dict) -> list[list[str]]:
    return [[res, str(a["clips"]), _fmt(a["rates"]["cpu 1 thread"]), _fmt(a["rates"].get("nvdec")),
             _num(a.get("cores_matching_gpu")), str(a.get("nvdec_frames_right", "-")),
             _num(a.get("nvdec_vs_cpu_mean_abs_diff"), ".2f")]
            for res, a in result["videos"].items()]


def _setup(result: dict) -> str:
    e = result["environment"]
    gpus = ", ".join(d["name"] for d in e["gpus"]["devices"]) or "none"
    return (f"Command: `{e['command']}`; fastmm commit `{e['git']['commit']}`; {e['cpu_model']}, "
            f"{e['cpu_count_usable']} cores; GPU: {gpus}; {result['reps']} repetitions of "
            f">= {result['min_seconds']} s each. Intervals: {stats.CI_METHOD}.")


def _not_measured(result: dict) -> list[str]:
    out = []
    if not result["gpu_images"]["measured"]:
        out.append(f"nvJPEG not measured: {result['gpu_images']['why']}.")
    if not result["nvdec"]["measured"]:
        out.append(f"NVDEC not measured: {result['nvdec']['why']}.")
    return out


def finding(result: dict) -> dict:
    """What the rates say, for the main job's answer: how many CPU cores one GPU decodes as
    fast as, per image size class and video resolution. Rates apart from any loader: where to
    decode is called end to end, by study 2."""
    parts = []
    for what, arms in (("JPEGs", result["images"]), ("clips", result["videos"])):
        matched = [f"{name} {a['cores_matching_gpu']:.1f}" for name, a in arms.items()
                   if a.get("cores_matching_gpu")]
        if matched:
            parts.append(f"{what}: " + ", ".join(matched))
    if not parts:
        text = "; ".join(_not_measured(result)) or "No GPU decode was measured."
    else:
        text = (f"One GPU ({result['accelerator']}) decodes as fast as this many CPU cores "
                f"(its best batch against one core, medians of {result['reps']} repetitions): "
                + "; ".join(parts) + ".")
    return {"text": text, "call": "undecided",
            "label": "rates apart from any loader: study 2 decides the placement end to end"}


def figures(result: dict) -> list[tuple]:
    """(name, Figure, caption): the crossover of nvJPEG against one CPU core per size class,
    only where the GPU was measured (a plot of one line per class says nothing)."""
    if not result["gpu_images"]["measured"]:
        return []
    classes = {name: (a["rates"]["cpu 1 thread"]["median"],
                      {b: a["rates"][f"gpu batch {b}"]["median"] for b in GPU_BATCHES})
               for name, a in result["images"].items()}
    return [("crossover", plots.crossover(classes, "images/s"),
             f"JPEG decode rate of the GPU ({result['accelerator']}) at each batch size against "
             "one CPU core (dashed, same colour), per size class; medians of the repetitions. "
             "Where a solid line is above its dashed one, the GPU beats a core.")]


def page(result: dict) -> Page:
    """The report a reader opens: the crossover plot where measured, then the tables."""
    p = Page("Decode rates: CPU and GPU, and the crossover")
    for note in _not_measured(result) + result["busy"]:
        p.alert(note)
    for name, fig, caption in figures(result):
        p.plot(name, fig, caption)
    p.heading("JPEG images (images/s)")
    p.table(IMAGE_HEADER, _image_rows(result))
    p.heading("Video clips, 16 frames every 2nd (clips/s)")
    if result["videos"]:
        p.table(VIDEO_HEADER, _video_rows(result))
    p.text(READING)
    p.text(_setup(result))
    return p


def report(result: dict) -> str:
    """The Markdown export."""
    def table(header, rows):
        return (["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
                + ["| " + " | ".join(r) + " |" for r in rows])

    images_note, video_note = [], []
    for note in _not_measured(result):
        (images_note if note.startswith("nvJPEG") else video_note).append(note)
    lines = ["# Decode rates: CPU and GPU, and the crossover", "", _setup(result), "",
             *[f"**{note}**\n" for note in result["busy"]],
             "## JPEG images (images/s)", "", *table(IMAGE_HEADER, _image_rows(result))]
    lines += ["", *images_note, "", "## Video clips, 16 frames every 2nd (clips/s)", ""]
    if result["videos"]:
        lines += table(VIDEO_HEADER, _video_rows(result))
    lines += ["", *video_note, "", READING]
    return "\n".join(lines) + "\n"


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.decode_rates", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default=os.path.join("bench-out", "decode-rates"))
    p.add_argument("--images", type=options.whole(1), default=400)
    p.add_argument("--videos", type=options.whole(1), default=12)
    p.add_argument("--reps", type=options.whole(1), default=5)
    p.add_argument("--min-seconds", type=options.number(0), default=1.0)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--quick", action="store_true", help="smoke run")
    p.add_argument("--accelerator", default="cuda",
                   help="device of the GPU arms: cuda (used when present); cpu only to test this "
                        "script's own plumbing, its 'GPU' figures then being CPU ones")
    args = options.parse(p, argv, {"images": 40, "videos": 3, "reps": 2, "min_seconds": 0.1})
    result = run(args)
    result.update(finding=finding(result),
                  busy=busy_notes("decode rates", result["other_processes_cpu_cores"]))
    save(args.out, "decode_rates", result, report(result), page(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
