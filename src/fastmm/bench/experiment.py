"""The method, end to end, on one training step: record the environment, the data and the step;
profile the baseline (torch's DataLoader, untouched) with the telemetry and name its observed
bottleneck; then single-factor A/B arms (one change each), interleaved repetitions with a fixed
input order, medians and 95% confidence intervals of each ratio, and a correctness check on
every run; a Markdown and a self-contained HTML report. Run:
``python -m fastmm.bench.experiment --config benchmarks/steps/image-224-small.toml --out DIR``.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import sys
import time
import tomllib
import zlib

import torch
from torch.utils.data import Dataset

from ..telemetry import Telemetry
from . import env, harness, options, stats
from .corpus import default_cache_dir
from .mmcorpus import CorpusSpec
from .pipelines import SIZE, TorchImageDataset, _files, ensure_mmcorpus, media

# the repository's step config (a source checkout: scripts/setup installs fastmm editable)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEP = os.path.join(REPO, "benchmarks", "steps", "image-224-small.toml")

COMPUTE_MODES = ("none", "sleep", "cpu", "cuda")
DATASETS = ("torch-pil", "fastmm-pil", "fastmm-fast")
FACTORS = ("loader", "dataset", "num_workers", "prefetch_factor", "per_device_batch")
# What must agree with the baseline for each factor: "bytes" (every batch identical), "pixels"
# (same samples in the same order, pixels within PIXEL_TOLERANCE) or "order" (same samples in
# the same order; the crops differ because the random streams are split differently).
CHECKS = {"loader": "bytes", "fastmm-pil": "bytes", "fastmm-fast": "pixels",
          "num_workers": "order", "prefetch_factor": "bytes", "per_device_batch": "order"}
PIXEL_TOLERANCE = 2.0  # mean |difference| in levels of 255, first timed batch


@dataclasses.dataclass(frozen=True)
class Step:
    """The training step the loader feeds (see benchmarks/steps/*.toml)."""

    name: str
    per_device_batch: int
    gradient_accumulation: int = 1
    world_size: int = 1
    sequence_length: int = 0
    images_per_sample: int = 1
    image_resolution: int = SIZE
    video_frames: int = 0
    distributed_sync: str = "none"
    compute: str = "none"
    compute_ms: float = 0.0

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.gradient_accumulation * self.world_size

    def __post_init__(self):
        if self.compute not in COMPUTE_MODES:
            raise ValueError(f"compute={self.compute!r}; use one of {COMPUTE_MODES}")
        if self.world_size != 1 or self.distributed_sync != "none":
            raise ValueError("this runner measures one process (world_size 1, no sync); "
                             "distributed steps run under torchrun (the sharding study)")
        if self.image_resolution != SIZE or self.video_frames:
            raise ValueError(f"this runner's arms are {SIZE}x{SIZE} image pipelines")


@dataclasses.dataclass(frozen=True)
class Config:
    step: Step
    data: dict
    loader: dict
    reps: int
    warmup_batches: int
    batches: int
    ab: list[tuple[str, object]]

    @classmethod
    def load(cls, path: str) -> "Config":
        """The config in ``path``; ValueError saying what is missing or wrong."""
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None
        missing = [t for t in ("step", "data", "loader", "experiment") if t not in raw]
        if missing:
            raise ValueError(f"{path}: no [{'], ['.join(missing)}] table")
        ab = [(a["factor"], a["value"]) for a in raw.get("ab", [])]
        for factor, value in ab:
            if factor not in FACTORS:
                raise ValueError(f"{path}: factor {factor!r}; use one of {FACTORS}")
            if factor == "dataset" and value not in DATASETS:
                raise ValueError(f"{path}: dataset {value!r}; use one of {DATASETS}")
        e = raw["experiment"]
        try:
            if e["reps"] < 5:
                raise ValueError(f"{path}: reps = {e['reps']}; the method asks for at least 5")
            return cls(Step(**raw["step"]), raw["data"], raw["loader"], e["reps"],
                       e["warmup_batches"], e["batches"], ab)
        except KeyError as missing_key:
            raise ValueError(f"{path}: [experiment] has no {missing_key}") from None
        except TypeError as err:  # a key [step] does not know, or one it lacks
            raise ValueError(f"{path}: [step]: {err}") from None


class ModelStep:
    """A stand-in for the model's step: the host waits (GPU-bound), burns a core, or runs
    matmuls on the GPU, for about ``ms`` per micro-batch (calibrated once). On the GPU they are
    4096-square bf16 products: a few hundred kernels a step that fill the device, as a model's
    do, rather than thousands of tiny ones that would keep the host busy launching them."""

    def __init__(self, mode: str, ms: float):
        self.mode, self.seconds, self.iters = mode, ms / 1e3, 0
        if mode in ("cpu", "cuda") and ms > 0:
            self.weight = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
                           if mode == "cuda" else torch.randn(256, 256))
            self._matmuls(4)
            t0 = time.perf_counter()
            self._matmuls(20)
            per = (time.perf_counter() - t0) / 20
            self.iters = max(1, round(self.seconds / per))

    def _matmuls(self, n: int) -> None:
        x = self.weight
        for _ in range(n):
            x = torch.tanh(x @ self.weight)
        if self.mode == "cuda":  # the step's stream, as loss.item() waits: not other streams
            torch.cuda.current_stream().synchronize()

    def __call__(self) -> None:
        if self.mode == "sleep":
            time.sleep(self.seconds)
        elif self.mode in ("cpu", "cuda") and self.iters:
            self._matmuls(self.iters)


class Indexed(Dataset):
    """(sample, index): lets every arm's output say which samples it carried, in what order."""

    def __init__(self, dataset):
        self.dataset = dataset  # telemetry finds a dataset that times its own samples through it

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i], i


def _dataset(name: str, root: str):
    from ..dataset import MultimodalDataset

    if name == "torch-pil":
        return TorchImageDataset(_files(root, ("jpg", "png")))
    manifest = os.path.join(root, "posix", "manifest.jsonl")
    if name == "fastmm-pil":
        return MultimodalDataset(manifest, decoder="pil", modality="image", size=SIZE,
                                 transform=media)
    return MultimodalDataset(manifest, decoder="torchvision", reduce=True, modality="image",
                             size=SIZE, transform=media)


def arm_settings(cfg: Config, factor: str | None = None, value=None) -> dict:
    """The baseline's settings, with at most one changed."""
    s = {"loader": "torch", "dataset": "torch-pil", "num_workers": cfg.loader["num_workers"],
         "prefetch_factor": cfg.loader["prefetch_factor"],
         "per_device_batch": cfg.step.per_device_batch}
    if factor is not None:
        if factor not in s:
            raise ValueError(f"unknown factor {factor!r}")
        s[factor] = value
    return s


def run_rep(settings: dict, cfg: Config, root: str, order: list[int], seed: int,
            step: ModelStep, trace_dir: str | None = None) -> dict:
    """One repetition: fresh loader, the fixed order, warm-up batches untimed, then timed ones,
    each followed by the model step; telemetry watching throughout."""
    import fastmm

    loader_cls = fastmm.DataLoader if settings["loader"] == "fastmm" else torch.utils.data.DataLoader
    torch.manual_seed(seed)  # the same base seed for every arm: the same worker seeds
    loader = loader_cls(Indexed(_dataset(settings["dataset"], root)),
                        batch_size=settings["per_device_batch"], sampler=order,
                        num_workers=settings["num_workers"],
                        prefetch_factor=settings["prefetch_factor"] if settings["num_workers"] else None,
                        pin_memory=cfg.loader.get("pin_memory", False))
    tm = Telemetry(trace=trace_dir is not None)
    need = cfg.warmup_batches + cfg.batches
    digest, indices, first, stamps = 0, [], None, []
    t_start = time.perf_counter()
    batches = iter(tm.watch(loader))
    try:
        for n, (images, index) in enumerate(batches):
            if n == cfg.warmup_batches:
                first = images.clone()
            if n >= cfg.warmup_batches:
                stamps.append(time.perf_counter())
                digest = zlib.crc32(images.numpy().tobytes(), digest)
                indices += index.tolist()
            with tm.compute():
                step()
            if n + 1 == need:
                break
        end = time.perf_counter()
    finally:
        batches.close()  # ends the epoch: workers go, the telemetry's sampler stops
    summary = tm.summary()
    if trace_dir is not None:
        tm.export(trace_dir)
    tm.close()
    del loader
    window = end - stamps[0]
    samples = len(indices)
    m = summary["metrics"]
    return {
        "samples_per_s": samples / window,  # end to end: data, copies and the model step
        "pipeline_samples_per_s": m["samples_per_s"],
        "queue_wait_share": sum_wait(m) / (end - t_start),
        "digest": f"{digest:08x}", "order_digest": f"{zlib.crc32(str(indices).encode()):08x}",
        "first": first, "telemetry": summary,
    }


def sum_wait(m: dict) -> float:
    q = m.get("queue_wait_s")
    return q["mean"] * q["count"] if q else 0.0


def correctness(kind: str, rep: dict, base: dict) -> dict:
    """Whether an arm's repetition delivered what the baseline's did."""
    same_order = rep["order_digest"] == base["order_digest"]
    if kind == "bytes":
        return {"check": "every batch byte-identical", "ok": rep["digest"] == base["digest"]}
    if kind == "pixels":
        a, b = rep["first"], base["first"]
        diff = (a.float() - b.float()).abs().mean().item() if a.shape == b.shape else float("inf")
        # no "|" in the label: it is a cell of the report's Markdown table
        return {"check": f"same samples in order; mean abs pixel diff <= {PIXEL_TOLERANCE}",
                "ok": same_order and diff <= PIXEL_TOLERANCE, "mean_abs_diff": diff}
    return {"check": "same samples in the same order", "ok": same_order}


def bottleneck(summary: dict, step: Step) -> dict:
    """The observed bottleneck of a run, from its measurements only, and what is left a
    hypothesis."""
    m = summary["metrics"]
    wall = summary["wall_s"] or 1.0
    waited = sum_wait(m) / wall
    stages = {k: (m[k]["mean"] * m[k]["count"]) for k in ("read_s", "decode_s", "augment_s",
                                                          "collate_s", "sample_s") if m.get(k)}
    cpu = m.get("worker_cpu_percent")
    observed = []
    if waited > 0.2:
        observed.append(f"data-bound: the loop waited for batches {waited:.0%} of its wall time "
                        f"(queue wait p50 {m['queue_wait_s']['p50'] * 1e3:.1f} ms)")
        if cpu:
            observed.append(f"workers at {cpu['p50']:.0f}% CPU each (p50): "
                            + ("CPU-bound" if cpu["p50"] >= 80 else "not CPU-bound (waiting on "
                                                                    "storage or locks?)"))
    else:
        observed.append(f"compute-bound: the loop waited for data only {waited:.0%} of its time")
    hypotheses = []
    if "sample_s" in stages and len(stages) == 2:  # only whole-sample and collate timing
        hypotheses.append("decode dominates each sample (typical of JPEG + resize) -- not "
                          "measured: the baseline Dataset marks no stages; the fastmm arms do")
    if step.compute == "sleep":
        hypotheses.append("on a GPU the host would be as idle during the model step as the "
                          "'sleep' stand-in leaves it (not measured here)")
    return {"observed": observed, "hypotheses": hypotheses, "queue_wait_share": waited}


def run(cfg: Config, args) -> dict:
    spec = CorpusSpec(num_images=cfg.data["images"], num_videos=cfg.data.get("videos", 0),
                      seed=cfg.data.get("seed", 0))
    root = ensure_mmcorpus(spec, args.cache_dir)
    with open(os.path.join(root, "composition.json")) as f:
        composition = json.load(f)
    n = len(_files(root, ("jpg", "png")))
    need = (cfg.warmup_batches + cfg.batches) * max(
        [cfg.step.per_device_batch] + [v for f, v in cfg.ab if f == "per_device_batch"])
    g = torch.Generator().manual_seed(cfg.data.get("seed", 0))
    order = []
    while len(order) < need:
        order += torch.randperm(n, generator=g).tolist()
    step = ModelStep(cfg.step.compute, cfg.step.compute_ms)
    arms = {"baseline": arm_settings(cfg)}
    for factor, value in cfg.ab:
        arms[f"{factor}={value}"] = arm_settings(cfg, factor, value)
    results: dict[str, list[dict]] = {name: [] for name in arms}
    total = cfg.reps * len(arms)
    done, t0 = 0, time.perf_counter()
    for r in range(cfg.reps):
        for name, settings in harness.rotated(list(arms.items()), r):
            trace = os.path.join(args.out, "traces", name) if r == 0 else None
            rep = run_rep(settings, cfg, root, order, cfg.data.get("seed", 0), step, trace)
            results[name].append(rep)
            done += 1
            eta = (time.perf_counter() - t0) / done * (total - done)
            print(f"[{done}/{total}] rep {r + 1} {name:28s} {rep['samples_per_s']:8.1f} samples/s "
                  f"(eta {eta:.0f} s)", file=sys.stderr, flush=True)
    base = results["baseline"]
    out_arms = {}
    for (name, settings), factor in zip(arms.items(), [None] + [f for f, _ in cfg.ab]):
        reps = results[name]
        rates = [x["samples_per_s"] for x in reps]
        entry = {"settings": settings, "factor": factor,
                 "samples_per_s": stats.summarize(rates),
                 "pipeline_samples_per_s": stats.summarize(
                     [x["pipeline_samples_per_s"] for x in reps]),
                 "queue_wait_share": stats.summarize([x["queue_wait_share"] for x in reps]),
                 "peak_total_pss_bytes": max((x["telemetry"]["metrics"]["total_pss_bytes"] or
                                              {"max": 0})["max"] for x in reps)}
        if factor is not None:
            kind = CHECKS.get(settings["dataset"] if factor == "dataset" else factor, "order")
            entry["ratio"] = stats.summarize(stats.paired_ratios(
                rates, [x["samples_per_s"] for x in base]))
            checks = [correctness(kind, x, b) for x, b in zip(reps, base)]
            entry["correctness"] = {"check": checks[0]["check"],
                                    "ok": all(c["ok"] for c in checks),
                                    "runs": len(checks), "details": checks}
        else:
            entry["correctness"] = {"check": "the same digest in every repetition",
                                    "ok": len({x["digest"] for x in reps}) == 1,
                                    "runs": len(reps)}
        out_arms[name] = entry
    baseline_summary = base[0]["telemetry"]
    return {
        "environment": env.capture(env.module_argv(__spec__, __name__),
                                   loader_config=dict(cfg.loader),
                                   paths=[str(args.cache_dir)]),
        "config_file": args.config, "step": dataclasses.asdict(cfg.step),
        "global_batch": cfg.step.global_batch, "data": composition,
        "experiment": {"reps": cfg.reps, "warmup_batches": cfg.warmup_batches,
                       "batches": cfg.batches},
        "baseline_profile": baseline_summary,
        "bottleneck": bottleneck(baseline_summary, cfg.step),
        "arms": out_arms, "total_s": time.perf_counter() - t0,
    }


SOURCES = [  # (what it supports, where, when it was read)
    ("DataLoader semantics: workers, seeding, prefetch_factor, pin_memory",
     "https://docs.pytorch.org/docs/stable/data.html", "2026-12-01"),
    ("torchvision v2 RandomResizedCrop / decode_jpeg (the baseline's augmentation and decode)",
     "https://docs.pytorch.org/vision/stable/transforms.html", "2026-12-01"),
    ("PSS, USS and smaps_rollup: what the memory figures mean",
     "https://docs.kernel.org/filesystems/proc.html", "2026-12-01"),
    ("psutil memory_full_info (USS, PSS) and io_counters (read_chars)",
     "https://psutil.readthedocs.io/en/latest/", "2026-12-01"),
    ("Trace Event Format (the trace files), opened by Perfetto",
     "https://perfetto.dev/docs/", "2026-12-01"),
    ("libjpeg-turbo: DCT-domain scaling used by the fast image path",
     "https://libjpeg-turbo.org/", "2026-12-01"),
    ("Percentile bootstrap for the confidence intervals: B. Efron, R. Tibshirani, An "
     "Introduction to the Bootstrap, Chapman & Hall, 1993", "ISBN 978-0412042317", "2026-12-01"),
]

ROLLOUT = ("roll out a factor when its ratio's 95% CI lies above 1.05, every run passed its "
           "correctness check and its peak total PSS is at most 1.10x the baseline's")
ROLLBACK = ("roll it back when, in production telemetry, end-to-end samples/s falls below 0.97x "
            "the A/B median, any correctness check fails, or peak total PSS exceeds 1.25x the "
            "baseline's")


def _decision(entry: dict, base: dict) -> str:
    ratio, ok = entry.get("ratio"), entry["correctness"]["ok"]
    pss = entry["peak_total_pss_bytes"] / max(1, base["peak_total_pss_bytes"])
    if ratio is None:
        return ""
    if ok and ratio["ci_low"] > 1.05 and pss <= 1.10:
        return "roll out"
    if not ok:
        return "reject: correctness"
    if ratio["ci_high"] < 1.0:
        return "reject: slower"
    return "no change shown" if pss <= 1.10 else "reject: memory"


def _fmt_ci(s: dict | None, digits: int = 1, unit: str = "") -> str:
    if not s:
        return "-"
    return (f"{s['median']:.{digits}f}{unit} [{s['ci_low']:.{digits}f}-"
            f"{s['ci_high']:.{digits}f}]")


def report_markdown(result: dict, plots: dict[str, str] | None = None) -> str:
    e, step, arms = result["environment"], result["step"], result["arms"]
    base = arms["baseline"]
    v = e["versions"]
    lines = [
        "# fastmm experiment: baseline first, then one factor at a time", "",
        f"Command: `{e['command']}`  ", f"Config: `{result['config_file']}`  ",
        f"Date: {e['timestamp_utc']}; total {result['total_s']:.0f} s  ",
        f"fastmm commit: `{e['git']['commit']}`"
        + (" (with local changes)" if e["git"]["dirty"] else "")
        + f"; training code commit: `{e['training_code_git']['commit']}`", "",
        "## Environment", "",
        f"- CPU: {e['cpu_model']}, {e['cpu_count_usable']} usable cores, NUMA "
        f"{e['numa_nodes'] or 'n/a'}; RAM {e['ram_total_bytes'] / 2**30:.1f} GiB; /dev/shm "
        f"{(e['dev_shm']['total_bytes'] or 0) / 2**30:.1f} GiB",
        f"- GPU: {', '.join(d['name'] for d in e['gpus']['devices']) or 'none'}",
        "- Storage: " + "; ".join(f"{p} on {s['device']} ({s['fstype']}, "
                                   f"{(s['free_bytes'] or 0) / 2**30:.0f} GiB free)"
                                   for p, s in e["storage"].items()),
        "- Network: " + ", ".join(f"{k} ({'up' if n['up'] else 'down'})"
                                   for k, n in e["network"].items()),
        f"- Python {e['python']}, torch {v['torch']}, torchvision {v['torchvision']}, "
        f"torchcodec {v['torchcodec']}, DALI {v['dali']}, FFmpeg "
        f"{(v['ffmpeg'] or 'n/a').split(' Copyright')[0]}, Pillow {v['pillow']} (libjpeg-turbo "
        f"{v['libjpeg_turbo']}), NumPy {v['numpy']}, webdataset {v['webdataset']}; fastmm C++ "
        f"path: {e['fastmm_uses_cpp']}", "",
        "## Data and step", "",
        f"- Data: {result['data']['counts']['images']} images "
        f"({result['data']['counts'].get('jpg', 0)} JPEG, {result['data']['counts'].get('png', 0)}"
        f" PNG; short side histogram {result['data']['image_short_side_hist']}), "
        f"{result['data']['counts']['videos']} videos, generated by fastmm.bench.mmcorpus.",
        f"- Step: {step['name']}: per-device batch {step['per_device_batch']}, gradient "
        f"accumulation {step['gradient_accumulation']}, world size {step['world_size']} "
        f"(global batch {result['global_batch']}), sequence length {step['sequence_length']}, "
        f"{step['images_per_sample']} image(s) per sample at {step['image_resolution']} px, "
        f"video frames {step['video_frames']}, sync {step['distributed_sync']}; model compute "
        f"included: {step['compute']} ({step['compute_ms']} ms per micro-batch).",
        f"- Method: {result['experiment']['reps']} interleaved repetitions per arm (each "
        "round starting one arm later), "
        f"{result['experiment']['warmup_batches']} warm-up batches untimed, "
        f"{result['experiment']['batches']} timed; the same sample order and base seed in every "
        "run; medians with percentile-bootstrap 95% CIs; ratios paired per repetition.", "",
        "## Baseline profile (torch DataLoader, untouched)", "",
    ]
    m = result["baseline_profile"]["metrics"]
    for name in ("queue_wait_s", "step_s", "sample_s", "collate_s", "worker_pss_bytes",
                 "total_pss_bytes", "worker_cpu_percent"):
        d = m.get(name)
        if d:
            scale, unit = ((1e3, " ms") if name.endswith("_s") else (2**-20, " MiB")
                           if name.endswith("bytes") else (1, "%"))
            lines.append(f"- `{name}`: p50 {d['p50'] * scale:.1f}{unit}, p95 "
                         f"{d['p95'] * scale:.1f}{unit}, p99 {d['p99'] * scale:.1f}{unit}, max "
                         f"{d['max'] * scale:.1f}{unit}")
    b = result["bottleneck"]
    lines += ["", "Observed (measured): " + "; ".join(b["observed"]) + ".",
              "Hypotheses (not measured): " + ("; ".join(b["hypotheses"]) or "none") + ".", "",
              "## Experiment matrix and results", "",
              "| arm | factor changed | samples/s end to end, median [95% CI] | ratio to "
              "baseline [95% CI] | pipeline samples/s | loop waiting | peak PSS MiB | "
              "correctness | decision |", "|---|---|---|---|---|---|---|---|---|"]
    for name, a in arms.items():
        check = a["correctness"]
        lines.append(
            f"| {name} | {a['factor'] or '-'} | {_fmt_ci(a['samples_per_s'])} | "
            f"{_fmt_ci(a.get('ratio'), 3, 'x') if a.get('ratio') else '1x'} | "
            f"{_fmt_ci(a['pipeline_samples_per_s'])} | "
            f"{a['queue_wait_share']['median']:.0%} | {a['peak_total_pss_bytes'] / 2**20:.0f} | "
            f"{'ok' if check['ok'] else 'FAILED'} ({check['check']}, {check['runs']} runs) | "
            f"{_decision(a, base)} |")
    lines += ["", f"Criteria: {ROLLOUT}; {ROLLBACK}.", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{k}]({p})" for k, p in plots.items()] + [""]
    lines += ["## Traces", "", "First repetition of every arm (open in https://ui.perfetto.dev):", ""]
    lines += [f"- {name}: `traces/{name}/trace.json`" for name in arms]
    lines += ["", "## Sources", ""]
    lines += [f"- {what}: {where} (read {when})" for what, where, when in SOURCES]
    return "\n".join(lines) + "\n"


def plots(result: dict, out: str) -> dict[str, str]:
    """PNG plots next to the report: ratio to baseline with its 95% CI, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {k: a for k, a in result["arms"].items() if a.get("ratio")}
    names = list(arms)
    med = [arms[n]["ratio"]["median"] for n in names]
    low = [m - arms[n]["ratio"]["ci_low"] for n, m in zip(names, med)]
    high = [arms[n]["ratio"]["ci_high"] - m for n, m in zip(names, med)]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(names) + 1.2))
    ax.barh(names, med, xerr=[low, high], color="#4c72b0", capsize=4)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("end-to-end samples/s, ratio to the baseline (median, 95% CI)")
    fig.tight_layout()
    path = os.path.join(out, "ratios.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"ratios to baseline": "ratios.png"}


def report_html(markdown: str, out: str) -> str:
    """A self-contained HTML page of the Markdown report (plots inlined as data URIs)."""
    import html

    body, table = [], []

    def flush_table():
        if table:
            rows = [r.strip("|").split("|") for r in table if not set(r) <= set("|-")]
            body.append("<table>" + "".join(
                "<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{html.escape(c.strip())}"
                                 f"</{'th' if i == 0 else 'td'}>" for c in row) + "</tr>"
                for i, row in enumerate(rows)) + "</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("!["):
            alt, src = line[2:].split("](")
            with open(os.path.join(out, src.rstrip(")")), "rb") as f:
                data = base64.b64encode(f.read()).decode()
            body.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("- "):
            body.append(f"<li>{html.escape(line[2:])}</li>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    flush_table()
    style = ("body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:"
             "collapse}td,th{border:1px solid #999;padding:.3em .5em;font-size:90%}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>fastmm experiment</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def _jsonable(result: dict) -> dict:
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k != "first"}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return clean(result)


@options.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmm.bench.experiment", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=STEP, help=f"(default {STEP})")
    p.add_argument("--out", type=options.directory, default=os.path.join("bench-out", "experiment"))
    p.add_argument("--cache-dir", type=options.directory, default=str(default_cache_dir()))
    args = p.parse_args(argv)
    try:
        cfg = Config.load(args.config)
    except ValueError as e:
        p.error(f"argument --config: {e}")
    os.makedirs(args.out, exist_ok=True)
    result = _jsonable(run(cfg, args))
    with open(os.path.join(args.out, "experiment.json"), "w") as f:
        json.dump(result, f, indent=1)
    markdown = report_markdown(result, plots(result, args.out))
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(args.out, "report.html"), "w") as f:
        f.write(report_html(markdown, args.out))
    print(markdown)
    return 0



if __name__ == "__main__":
    sys.exit(main())
