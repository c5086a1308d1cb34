"""Study 2, GPU decode placement: decode JPEGs in the CPU workers, or on the GPU (nvJPEG through
torchvision, in the training process) where a synthetic model step runs too. The one factor is
where decode (and the crop/resize after it) runs; corpus, crops (RandomResizedCrop(224) + flip,
same draws), order, batch and loader are the same. On the GPU, two ways: inline (the loop
decodes each batch, then runs the model on it) and ahead (a thread decodes the next batches on
a CUDA stream of its own while the model runs, as DALI's and SPDL's pipelines do).

Reported per arm: end-to-end samples/s; the model step's own time (CUDA events on the GPU)
against the model alone, i.e. its slowdown from sharing the device with decode (contention);
the GPU idle fraction (the telemetry's, from the same events); the loop's step and its wait for
data. On a machine without CUDA the CPU arm runs with the model step stood in by the host
waiting ("sleep", as for a GPU-bound step) and by a CPU matmul step that competes with decode
for cores; the GPU arms are reported as not measured.

Before any call, the arms' batches are compared (``check``): each arm's untimed warm-up batches
of its first repetition, the same samples with the same crops (same seeds). Arms that decode
alike must be byte-identical; CPU decode against nvJPEG may differ by what the decoders and the
CPU arm's DCT-reduced decode are known to differ by (``CPU_GPU_LEVELS``). The call rests on it.
Run: ``python -m fastmm.bench.study_gpu_decode --out DIR`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import sys
import threading
import time
from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from ..telemetry import Telemetry
from . import env, harness, options, plots, stats
from .corpus import default_cache_dir
from .mmcorpus import CorpusSpec
from .pipelines import SIZE, _files, ensure_mmcorpus
from .report import busy_notes, save_study
from .workloads import ModelStep


class Decoded(Dataset):
    """CPU arm: the worker decodes, crops and resizes (torchvision backend, fast path)."""

    def __init__(self, paths: list[str]):
        from ..dataset import ResizedCrop
        from ..decode import get_decoder

        self.paths, self.crop = paths, ResizedCrop(size=(SIZE, SIZE))
        self.decoder = get_decoder("torchvision", device="cpu")

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return self.decoder.decode_resized_crop(f.read(), self.crop.plan, reduce=True)


class Encoded(Dataset):
    """GPU arm: the worker reads the bytes and draws the crop from the header (the same draws
    as the CPU arm); decoding waits for the GPU."""

    def __init__(self, paths: list[str]):
        from ..dataset import ResizedCrop

        self.paths, self.crop = paths, ResizedCrop(size=(SIZE, SIZE))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from ..decode.base import DecodeLimits, open_image_header

        with open(self.paths[i], "rb") as f:
            data = f.read()
        with open_image_header(data, self.paths[i], DecodeLimits()) as im:
            plan = self.crop.plan(*im.size)
        plan_ints = torch.tensor([*plan[:6], int(plan.flip)])
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), plan_ints


GPU_ARMS = ("gpu-decode inline", "gpu-decode ahead")

# What CPU decode's images may differ from the GPU arms' by, per image, as the mean |difference|
# in levels of 255: nvJPEG against libjpeg-turbo (torchvision's own test of decode_jpeg on CUDA,
# test/test_image.py test_decode_jpeg_cuda, "Some difference expected between jpeg
# implementations": mean < 2 per image; fastmm's tests/test_gpu.py holds nvJPEG to the same),
# torch's resize on the GPU against the CPU's (at most 1 level per value: tests/test_gpu.py),
# and the CPU arm's DCT-reduced decode against the full-size decode the GPU arms crop from (at
# most 6.6 per image on this corpus: benchmarks/results/2026-11-30-pipelines.md), added up.
# No source bounds a single value's difference: the largest is recorded, not judged.
NVJPEG_LEVELS, GPU_RESIZE_LEVELS, REDUCED_LEVELS = 2.0, 1.0, 6.6
CPU_GPU_LEVELS = NVJPEG_LEVELS + GPU_RESIZE_LEVELS + REDUCED_LEVELS
LEVELS_SOURCE = (
    f"{NVJPEG_LEVELS:g} (nvJPEG against libjpeg-turbo: torchvision's test_decode_jpeg_cuda, "
    f"test/test_image.py) + {GPU_RESIZE_LEVELS:g} (resize on the GPU against the CPU: "
    f"tests/test_gpu.py) + {REDUCED_LEVELS:g} (the CPU arm's DCT-reduced decode against a "
    "full-size one on this corpus: benchmarks/results/2026-11-30-pipelines.md)")


class Difference(NamedTuple):
    """How far one arm's images are from another's, in levels of 255."""

    images: int  # compared
    worst_mean_levels: float  # the largest mean |difference| of one image
    max_levels: float  # the largest |difference| of any value


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> Difference:
    """Image by image over two arms' batches (N x C x H x W, uint8, on the CPU); batches of
    other counts or shapes are infinitely far apart (their crops are not the same)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return Difference(0, float("inf"), float("inf"))
    images, worst, top = 0, 0.0, 0.0
    for x, y in zip(a, b):
        if not x.numel():
            continue
        d = (x.int() - y.int()).abs()
        worst = max(worst, d.flatten(1).float().mean(1).max().item())
        top = max(top, float(d.max()))
        images += len(x)
    return Difference(images, worst, top)


def _on_cpu(name: str) -> bool:
    return name.startswith("cpu-decode")


def comparisons(names: list[str]) -> list[tuple[str, str, float]]:
    """(arm, against, mean levels allowed per image): every arm against the first (CPU
    decode), byte-identical (0) where both decode in the CPU workers, within CPU_GPU_LEVELS
    against a GPU arm; the GPU arms against each other byte-identical (both nvJPEG)."""
    first, *rest = names
    out = [(n, first, 0.0 if _on_cpu(n) else CPU_GPU_LEVELS) for n in rest]
    gpu = [n for n in names if not _on_cpu(n)]
    return out + [(n, gpu[0], 0.0) for n in gpu[1:]]


def check(kept: dict[str, list[torch.Tensor]]) -> dict:
    """The arms' batches compared (``comparisons``): what, how many, the differences found,
    and ok only where every comparison compared images and stayed within its bound."""
    pairs = []
    for arm, against, allowed in comparisons(list(kept)):
        d = difference(kept[arm], kept[against])
        pairs.append({"arm": arm, "against": against, "allowed_mean_levels": allowed,
                      **d._asdict(), "ok": d.images > 0 and d.worst_mean_levels <= allowed})
    return {"what": "each arm's warm-up batches of its first repetition (the same samples, the "
                    "same crops from the same seeds): byte-identical where the arms decode "
                    "alike, CPU decode against nvJPEG within a mean |difference| per image of "
                    f"{CPU_GPU_LEVELS:g} levels of 255 = {LEVELS_SOURCE}",
            "batches_per_arm": len(next(iter(kept.values()), [])),
            "pairs": pairs, "ok": bool(pairs) and all(p["ok"] for p in pairs)}


def _keep(batch):
    return batch  # a list of (bytes tensor, plan) pairs: no stacking of ragged bytes


def gpu_decode(batch, device: str) -> torch.Tensor:
    """nvJPEG on the batch, then each image's crop and resize on the GPU, stacked."""
    from torchvision import io as tvio

    from ..decode.base import CropPlan, crop_resize

    images = tvio.decode_jpeg([b for b, _ in batch], mode=tvio.ImageReadMode.RGB, device=device)
    return torch.stack([crop_resize(img, CropPlan(*p[:6].tolist(), bool(p[6])))
                        for img, (_, p) in zip(images, batch)])


class DecodeAhead:
    """Decoded batches made ahead by a thread, on a CUDA stream of its own (none on the CPU)
    so that decode overlaps the model's step on the default stream; ``depth`` batches wait at
    most. Each batch is handed over once its decode has finished on the GPU."""

    def __init__(self, batches, device: str, depth: int = 2):
        self._device, self._stop = device, threading.Event()
        self._stream = torch.cuda.Stream(device) if device.startswith("cuda") else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, args=(batches,), daemon=True,
                                        name="fastmm-decode-ahead")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _run(self, batches) -> None:
        try:
            with torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext():
                for batch in batches:
                    images = gpu_decode(batch, self._device)
                    done = None
                    if self._stream is not None:
                        done = torch.cuda.Event()
                        done.record(self._stream)
                    if not self._put((images, done)):
                        return
        except BaseException as e:  # raised again in the loop
            self._put(e)
            return
        self._put(None)

    def __iter__(self):
        while (item := self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            images, done = item
            if done is not None:
                stream = torch.cuda.current_stream()
                stream.wait_event(done)
                images.record_stream(stream)  # made on the decode stream, freed after this one
            yield images

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class StepTimes:
    """Each model step's own time: CUDA events around it on the GPU (so a step slowed by work
    sharing the device takes longer), the host's clock elsewhere."""

    def __init__(self, cuda: bool):
        self.cuda, self._events, self._host = cuda, [], []

    @contextlib.contextmanager
    def step(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host.append(time.perf_counter() - t0)

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self._events]
        return list(self._host)


def run_arm(arm: str, step: ModelStep, paths, args, order, keep: bool = False) -> dict:
    """One repetition of an arm; with ``keep``, its warm-up batches' images as well (copied to
    the CPU before the timed batches begin), for ``check``."""
    import fastmm

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(args.seed)
    on_cpu = arm == "cpu-decode"
    dataset = Decoded(paths) if on_cpu else Encoded(paths)
    loader = fastmm.DataLoader(dataset, batch_size=args.batch, sampler=order,
                               num_workers=args.num_workers,
                               collate_fn=None if on_cpu else _keep, pin_memory=cuda and on_cpu)
    tm = Telemetry()
    batches = iter(tm.watch(loader))
    ahead = DecodeAhead(batches, device) if arm == "gpu-decode ahead" else None
    source = iter(ahead) if ahead else batches
    times, waits, n, start, kept = StepTimes(step.mode == "cuda"), [], 0, None, []
    try:
        for k in range(args.warmup_batches + args.batches):
            if k == args.warmup_batches:
                start, n = time.perf_counter(), 0
            t0 = time.perf_counter()
            batch = next(source)
            if on_cpu:
                with tm.h2d(batch):
                    images = batch.to(device, non_blocking=True)
            else:  # inline: the loop waits for the decode, as it would for the loader
                images = batch if ahead else gpu_decode(batch, device)
            waits.append(time.perf_counter() - t0)
            if keep and k < args.warmup_batches:
                kept.append(images.to("cpu", copy=True))
            with tm.compute(), times.step():
                step()
            n += len(images)
        seconds = time.perf_counter() - start
    finally:
        if ahead:
            ahead.close()
        batches.close()
    m = tm.summary()["metrics"]
    tm.close()
    timed = slice(args.warmup_batches, None)  # the warm-up batches' figures left out
    return {"samples_per_s": n / seconds, "gpu_idle_fraction": m["gpu_idle_fraction"],
            "data_wait_p50_s": stats.summarize(waits[timed])["median"],
            "model_step_s_p50": stats.summarize(times.seconds()[timed])["median"],
            "step_s_p50": (m["step_s"] or {}).get("p50"), "kept": kept}


def model_alone(step: ModelStep, reps: int = 20) -> list[float]:
    """Seconds of each of ``reps`` model steps with nothing else running (the reference for
    the slowdown), timed as the arms time them."""
    times = StepTimes(step.mode == "cuda")
    for _ in range(reps):
        with times.step():
            step()
    return times.seconds()


def run(args) -> dict:
    root = ensure_mmcorpus(CorpusSpec(num_images=args.images, num_videos=0, seed=args.seed),
                           args.cache_dir)
    paths = _files(root, ("jpg",))
    cuda = torch.cuda.is_available()
    computes = ["cuda"] if cuda else ["sleep", "cpu"]
    arms = [("cpu-decode", c) for c in computes]
    arms += [(a, "cuda") for a in GPU_ARMS] if cuda else []
    g = torch.Generator().manual_seed(args.seed)
    need, order = (args.warmup_batches + args.batches) * args.batch, []
    while len(order) < need:  # epochs of the same seeded permutation, as long as needed
        order += torch.randperm(len(paths), generator=g).tolist()
    order = order[:need]
    # one step per stand-in, calibrated once: the arms and the model alone run the same work
    steps = {c: ModelStep(c, args.compute_ms) for c in computes}
    before = {c: model_alone(step) for c, step in steps.items()}  # and after the arms
    results: dict[str, list] = {f"{a} / model {c}": [] for a, c in arms}
    kept: dict[str, list] = {}
    for r in range(args.reps):
        for arm, compute in harness.rotated(list(arms), r):
            name = f"{arm} / model {compute}"
            with harness.OtherCores() as others:
                fig = run_arm(arm, steps[compute], paths, args, order, keep=name not in kept)
            fig["other_processes_cpu_cores"] = others.cores
            kept.setdefault(name, fig.pop("kept"))
            results[name].append(fig)
            print(f"[gpu-decode] rep {r + 1}/{args.reps} {arm} / model {compute}: "
                  f"{fig['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
    alone = {c: stats.summarize(before[c] + model_alone(step))["median"]
             for c, step in steps.items()}
    out_arms = {}
    for name, figs in results.items():
        compute = name.rsplit(" ", 1)[1]
        out_arms[name] = {
            "measured": True,
            "samples_per_s": stats.summarize([f["samples_per_s"] for f in figs]),
            "model_step_s_alone": alone[compute],
            "model_step_s": stats.summarize([f["model_step_s_p50"] for f in figs]),
            "loop_step_s": stats.summarize([f["step_s_p50"] for f in figs]),
            "data_wait_p50_s": stats.summarize([f["data_wait_p50_s"] for f in figs]),
            "gpu_idle_fraction": (None if compute != "cuda" else
                                  stats.summarize([f["gpu_idle_fraction"] for f in figs])),
        }
        cpu = results.get(f"cpu-decode / model {compute}")
        if not name.startswith("cpu-decode") and cpu:  # paired by round with CPU decode
            out_arms[name]["vs_cpu_decode"] = stats.summarize(stats.paired_ratios(
                [f["samples_per_s"] for f in figs], [f["samples_per_s"] for f in cpu]))
    if not cuda:
        for arm in GPU_ARMS:
            out_arms[f"{arm} / model cuda"] = {"measured": False,
                                               "why": "no CUDA device on this machine"}
    out_arms["gpu-decode (DALI mixed) / model cuda"] = {
        "measured": False, "why": "DALI's GPU decoder is not in this study yet"}
    result = {"environment": env.capture(env.module_argv(__spec__, __name__),
                                         loader_config={"batch_size": args.batch,
                                                        "num_workers": args.num_workers},
                                         paths=[args.cache_dir]),
              "images": len(paths), "batch": args.batch, "compute_ms": args.compute_ms,
              "arms": out_arms, "check": check({n: kept[n] for n in results}),
              "busy": busy_notes("gpu-decode", [f["other_processes_cpu_cores"]
                                                for figs in results.values() for f in figs])}
    result["finding"] = finding(result)
    return result


def _compared(p: dict) -> str:
    """One comparison of ``check`` in words, after the arm's name."""
    if not p["images"]:
        return f"compared with {p['against']}: no images, or not the same shapes"
    seen = (f"{p['images']} images, the worst {p['worst_mean_levels']:.2f} levels off on "
            f"average, the largest value {p['max_levels']:g}")
    if p["allowed_mean_levels"] == 0:
        return (f"byte-identical to {p['against']}" if p["ok"] else
                f"DIFFERS from {p['against']} (byte-identical expected; {seen})")
    return (f"{'within' if p['ok'] else 'NOT within'} {p['allowed_mean_levels']:g} levels of "
            f"{p['against']} ({seen})")


def _checked(c: dict) -> str:
    return (f"Batches compared, the warm-up's {c['batches_per_arm']} per arm: "
            + "; ".join(f"{p['arm']} {_compared(p)}" for p in c["pairs"]) + ".")


def finding(result: dict) -> dict:
    """Where a GPU was measured: decode ahead on the GPU against decode in the CPU workers,
    end to end on the step (``stats.decision`` on the paired ratio, rolled back if the arms'
    batches failed ``check``). Without one: what the CPU arms showed, and "undecided", since
    the question was not measured."""
    arms = result["arms"]
    gpu = arms.get("gpu-decode ahead / model cuda", {})
    if gpu.get("measured"):
        inline = arms["gpu-decode inline / model cuda"]
        call, label = stats.decision(gpu["vs_cpu_decode"], ok=result["check"]["ok"])
        text = (f"With a {result['compute_ms']:g} ms model step on the GPU, decoding on the GPU "
                f"ahead of the step gave {stats.interval(gpu['vs_cpu_decode'], 2, 'x')} the "
                "end-to-end samples/s of decoding in the CPU workers, and decoding inline "
                f"{stats.interval(inline['vs_cpu_decode'], 2, 'x')}; the model step took "
                f"{gpu['model_step_s']['median'] / gpu['model_step_s_alone']:.2f}x its time "
                "alone with decode ahead beside it. " + _checked(result["check"]))
        return {"text": text, "call": call, "label": f"gpu-decode ahead: {label}"}
    sleep, cpu = arms.get("cpu-decode / model sleep"), arms.get("cpu-decode / model cpu")
    text = f"GPU decode not measured: {gpu.get('why', 'no GPU arm ran')}."
    if sleep and cpu:
        text += (f" CPU decode in the workers kept a {result['compute_ms']:g} ms step that "
                 f"leaves the host idle (as a GPU step does) at "
                 f"{stats.interval(sleep['samples_per_s'], 0, ' samples/s')}, waiting "
                 f"{sleep['data_wait_p50_s']['median'] * 1e3:.1f} ms for data (p50); beside a "
                 f"CPU matmul step that competes for the cores, the step took "
                 f"{cpu['model_step_s']['median'] * 1e3:.1f} ms against "
                 f"{cpu['model_step_s_alone'] * 1e3:.1f} ms alone "
                 f"({cpu['model_step_s']['median'] / cpu['model_step_s_alone']:.2f}x; "
                 f"{stats.interval(cpu['samples_per_s'], 0, ' samples/s')}).")
    text += " " + _checked(result["check"])
    label = "the GPU arms were not measured here" + (
        f"; CPU decode {stats.interval(sleep['samples_per_s'], 0, ' samples/s')}" if sleep else "")
    return {"text": text, "call": "undecided", "label": label}


def figures(result: dict) -> list[tuple]:
    """(name, Figure, caption): each measured arm's end-to-end samples/s; on a GPU also the
    GPU arms' ratio to CPU decode (the crossover, where it was measured)."""
    measured = [(k, a) for k, a in result["arms"].items() if a["measured"]]
    out = [("rates", plots.rates([(k, a["samples_per_s"]) for k, a in measured],
                                 "samples/s end to end"),
            "End-to-end samples/s of each measured arm (data, decode, model step): median and "
            "interval over the repetitions (" + stats.CI_METHOD + ").")]
    ratios = [(k, a["vs_cpu_decode"]) for k, a in measured if a.get("vs_cpu_decode")]
    if ratios:
        out.append(("vs-cpu-decode", plots.rates(ratios, "samples/s, ratio to CPU decode",
                                                 ref=1.0),
                    "GPU decode over CPU decode, paired by round: above the dotted line the GPU "
                    "placement is faster end to end."))
    return out


TITLE = "Study 2: GPU decode placement"
HEADER = ["arm", "samples/s end to end", "model step alone", "model step (slowdown)",
          "loop step p50", "data wait p50", "GPU idle", "vs CPU decode", "batches checked"]


def _check_cell(result: dict, name: str) -> str:
    said = [("ok: " if p["ok"] else "FAILED: ") + _compared(p)
            for p in result["check"]["pairs"] if p["arm"] == name]
    return "; ".join(said) or "the reference"


def _rows(result: dict) -> list[list[str]]:
    rows = []
    for name, a in result["arms"].items():
        if not a["measured"]:
            rows.append([name, f"not measured: {a['why']}", "", "", "", "", "", "", ""])
            continue
        w, st, ms = a["data_wait_p50_s"], a["loop_step_s"], a["model_step_s"]
        alone, gi = a["model_step_s_alone"], a["gpu_idle_fraction"]
        rows.append([name, stats.interval(a["samples_per_s"], 1), f"{alone * 1e3:.1f} ms",
                     f"{ms['median'] * 1e3:.1f} ms "
                     f"({ms['median'] / alone if alone else float('nan'):.2f}x)",
                     f"{st['median'] * 1e3:.1f} ms", f"{w['median'] * 1e3:.1f} ms",
                     "-" if gi is None else format(gi["median"], ".0%"),
                     stats.interval(a.get("vs_cpu_decode"), 2, "x"), _check_cell(result, name)])
    return rows


def _setup(result: dict) -> list[str]:
    e = result["environment"]
    gpus = ", ".join(d["name"] for d in e["gpus"]["devices"]) or "none"
    return [
        f"Command: `{e['command']}`; fastmm commit `{e['git']['commit']}`; {e['cpu_model']}, "
        f"{e['cpu_count_usable']} cores; GPU: {gpus}.",
        f"{result['images']} JPEGs, RandomResizedCrop({SIZE}) + flip, batch {result['batch']}; "
        f"model step calibrated to {result['compute_ms']:g} ms (its measured time alone is in "
        f"the table). Intervals: {stats.CI_METHOD}.",
        f"Batches checked: {result['check']['what']}. The largest difference of a single value "
        "is shown, not judged: no source bounds it. A failed check makes the call roll back.",
    ]


NOTES = ("Model step: its own time (CUDA events on the GPU, the host's clock otherwise), "
         "median of the repetitions' medians; the slowdown is against the model alone, i.e. "
         "what sharing the device with decode costs it. Data wait: from the end of one step "
         "until the next batch is ready on the GPU (inline: the loader's batch and its decode). "
         "GPU idle: the telemetry's, 1 - the steps' GPU time / the loop's wall time (loader "
         "start included).")


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.study_gpu_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=options.directory, default=os.path.join("bench-out", "study-gpu-decode"))
    p.add_argument("--images", type=options.whole(1), default=400)
    p.add_argument("--batch", type=options.whole(1), default=32)
    p.add_argument("--num-workers", type=options.whole(1), default=2)
    p.add_argument("--compute-ms", type=options.number(0, above=False), default=40.0)
    p.add_argument("--reps", type=options.whole(1), default=6,
                   help="repetitions, interleaved (default 6, the fewest that give a 95%% CI)")
    p.add_argument("--warmup-batches", type=options.whole(1), default=2,
                   help="untimed batches per repetition; the first repetition's are the ones "
                   "compared across arms (default 2)")
    p.add_argument("--batches", type=options.whole(1), default=30)
    p.add_argument("--seed", type=options.whole(0), default=0)
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    p.add_argument("--quick", action="store_true", help="smoke run")
    args = options.parse(p, argv, {"images": 64, "batch": 8, "batches": 3, "warmup_batches": 1})
    result = run(args)
    save_study(args.out, "gpu_decode", result, TITLE, HEADER, _rows(result),
               _setup(result) + [NOTES], figures(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
