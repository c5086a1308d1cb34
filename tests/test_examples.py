"""The user pipelines under examples/, at test sizes: the samples their datasets document, the
same batches through fastmm's loader as through torch's, a real training step, and the stand-in
data they fall back on (generated once, atomically, the same from the same seed)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("skimage")  # the stand-in photos

import fastmm  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NUM_IMAGES, NUM_VIDEOS = 48, 12  # 12 videos: two batches of 8, so both workers make one
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def load(name: str, monkeypatch):
    """Import examples/<name>.py by path, as fastmm-bench does."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def needs_video():
    pytest.importorskip("torchcodec")
    if shutil.which("ffmpeg") is None:
        pytest.importorskip("av", reason="encoding the stand-in videos needs ffmpeg or PyAV")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache directory holding the stand-in data at test sizes, made once for the module."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        mp.setenv("EXAMPLE_IMAGES", str(NUM_IMAGES))
        mp.setenv("EXAMPLE_VIDEOS", str(NUM_VIDEOS))
        standin = load("standin_data", mp)
        images = standin.image_folder()
        videos = standin.video_folder() if shutil.which("ffmpeg") or _has("av") else None
    return root, images, videos


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The examples' steps set torch to one thread (see trainer()); other tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def env(cache, monkeypatch):
    """The examples' environment as a user without their own data has it: stand-in data."""
    root, images, videos = cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    monkeypatch.setenv("EXAMPLE_IMAGES", str(NUM_IMAGES))
    monkeypatch.setenv("EXAMPLE_VIDEOS", str(NUM_VIDEOS))
    monkeypatch.delenv("IMAGE_FOLDER", raising=False)
    monkeypatch.delenv("VIDEO_FOLDER", raising=False)
    return images, videos


def files_under(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*"))
            if p.is_file()}


# -- stand-in data ------------------------------------------------------------------------------

def test_standin_folders_are_made_once_complete_and_the_same_from_a_seed(tmp_path, monkeypatch):
    needs_video()
    from PIL import Image
    from torchcodec.decoders import VideoDecoder

    standin = load("standin_data", monkeypatch)
    monkeypatch.setenv("EXAMPLE_IMAGES", "3")
    monkeypatch.setenv("EXAMPLE_VIDEOS", "1")
    made = []
    for run in ("a", "b"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / run))
        made.append((standin.image_folder(), standin.video_folder()))
        cache = tmp_path / run / "fastmm" / "examples"
        assert sorted(p.name for p in cache.iterdir()) == [
            "images-v1.1-n3-seed0", "videos-v1.1-n1-seed0"]  # no temporary folder left
    (images_a, videos_a), (images_b, videos_b) = made
    assert files_under(images_a) == files_under(images_b)
    assert files_under(videos_a) == files_under(videos_b)

    # A folder already there is trusted as it is, not written again.
    stamp = os.stat(images_a).st_mtime_ns
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    assert standin.image_folder() == images_a and os.stat(images_a).st_mtime_ns == stamp

    jpegs = sorted(Path(images_a).glob("*/*.jpg"))
    assert len(jpegs) == 3
    assert sorted(p.stem for p in jpegs) == ["000000", "000001", "000002"]
    for path in jpegs:
        with Image.open(path) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert 300 <= min(im.size) <= 500 and max(im.size) <= round(500 * 4 / 3)
    (mp4,) = Path(videos_a).glob("*/*.mp4")
    meta = VideoDecoder(str(mp4)).metadata
    assert (meta.codec, meta.width, meta.height) == ("h264", 320, 240)
    assert 2.0 <= meta.num_frames / meta.average_fps <= 4.0 + 1e-6


@pytest.mark.parametrize("value", ["lots", "0", "-3"])
def test_a_bad_count_names_its_variable(value, tmp_path, monkeypatch):
    standin = load("standin_data", monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("EXAMPLE_IMAGES", value)
    with pytest.raises(ValueError, match=f"EXAMPLE_IMAGES={value!r}: needs a whole number"):
        standin.image_folder()
    assert not (tmp_path / "fastmm").exists()


# -- image_folder.py ----------------------------------------------------------------------------

def test_image_samples_are_normalised_crops_with_their_folder_label(env, monkeypatch):
    images, _ = env
    example = load("image_folder", monkeypatch)
    ds = example.dataset()
    assert ds.root == images and len(ds) == NUM_IMAGES
    assert ds.classes == sorted(p.name for p in Path(images).iterdir())
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    for i in range(0, NUM_IMAGES, 7):
        image, label = ds[i]
        assert image.dtype == torch.float32 and image.shape == (3, 128, 128)
        assert isinstance(label, int) and ds.classes[label] == Path(ds.samples[i][0]).parent.name
        # Undoing ImageNet's normalisation gives back 8-bit pixel values scaled to [0, 1].
        pixels = (image * std + mean) * 255
        assert pixels.min() > -1e-3 and pixels.max() < 255 + 1e-3
        assert (pixels - pixels.round()).abs().max() < 1e-3
    torch.manual_seed(3)
    first = ds[0][0]
    torch.manual_seed(3)
    assert torch.equal(ds[0][0], first)  # the crop and flip come from torch's RNG
    assert not torch.equal(ds[0][0], first)


def test_image_folder_variable_points_the_dataset_and_the_model_at_a_users_folder(
        env, tmp_path, monkeypatch):
    images, _ = env
    user = tmp_path / "mine"
    for cls in sorted(os.listdir(images))[:2]:
        shutil.copytree(Path(images) / cls, user / cls)
    monkeypatch.setenv("IMAGE_FOLDER", str(user))
    example = load("image_folder", monkeypatch)
    ds = example.dataset()
    assert ds.root == str(user) and ds.classes == sorted(os.listdir(user))
    assert len(ds) == len(list(user.glob("*/*.jpg")))
    model, _ = example.trainer()
    assert model[-1].out_features == 2


# -- video_clips.py -----------------------------------------------------------------------------

def test_video_samples_are_dicts_of_a_clip_its_label_and_its_path(env, monkeypatch):
    needs_video()
    _, videos = env
    example = load("video_clips", monkeypatch)
    ds = example.dataset()
    assert ds.root == videos and len(ds) == NUM_VIDEOS
    assert ds.classes == sorted(p.name for p in Path(videos).iterdir())
    assert sorted(path for path, _ in ds.samples) == sorted(map(str, Path(videos).glob("*/*.mp4")))
    for i in range(NUM_VIDEOS):
        sample = ds[i]
        assert sorted(sample) == ["label", "path", "video"]
        assert sample["video"].dtype == torch.uint8 and sample["video"].shape == (8, 3, 112, 112)
        assert sample["path"] == ds.samples[i][0]
        assert isinstance(sample["label"], int)
        assert ds.classes[sample["label"]] == Path(sample["path"]).parent.name


def test_a_clip_is_every_second_frame_from_a_start_drawn_by_torch(env, monkeypatch):
    needs_video()
    from torchcodec.decoders import VideoDecoder
    from torchvision.transforms import v2

    from fastmm.bench.mmcorpus import read_frame_index

    _, videos = env
    example = load("video_clips", monkeypatch)
    full, resized = example.VideoClips(videos, size=None), example.dataset()
    starts = set()
    for seed in range(4):
        for i in (0, 5):
            num_frames = VideoDecoder(full.samples[i][0]).metadata.num_frames
            torch.manual_seed(seed)
            clip = full[i]["video"]
            assert clip.shape == (8, 3, 240, 320)
            shown = [read_frame_index(frame) for frame in clip]
            assert shown == list(range(shown[0], shown[0] + 16, 2))
            assert 0 <= shown[0] <= num_frames - 15
            starts.add((i, shown[0]))
            torch.manual_seed(seed)  # the same frames, short side to 112, centre square
            assert torch.equal(resized[i]["video"], v2.CenterCrop(112)(v2.Resize(112)(clip)))
    assert len(starts) > 2


# -- both: the same batches as torch's loader, and a real step -----------------------------------

def batches(loader_class, ds) -> list:
    torch.manual_seed(0)
    loader = loader_class(ds, batch_size=8, num_workers=2, shuffle=True,
                          generator=torch.Generator().manual_seed(0))
    return list(loader)


def as_bytes(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.contiguous().numpy().tobytes()


def test_image_batches_are_the_same_as_torchs(env, monkeypatch):
    example = load("image_folder", monkeypatch)
    ds = example.dataset()
    ours, theirs = batches(fastmm.DataLoader, ds), batches(torch.utils.data.DataLoader, ds)
    assert len(ours) == len(theirs) == NUM_IMAGES // 8
    for (images, labels), (want_images, want_labels) in zip(ours, theirs):
        assert as_bytes(labels) == as_bytes(want_labels) and labels.dtype == torch.int64
        assert as_bytes(images) == as_bytes(want_images)
    assert sorted(torch.cat([labels for _, labels in ours]).tolist()) == sorted(ds.targets)


def test_video_batches_are_the_same_as_torchs(env, monkeypatch):
    needs_video()
    example = load("video_clips", monkeypatch)
    ds = example.dataset()
    ours, theirs = batches(fastmm.DataLoader, ds), batches(torch.utils.data.DataLoader, ds)
    assert [len(b["path"]) for b in ours] == [len(b["path"]) for b in theirs] == [8, 4]
    for batch, want in zip(ours, theirs):
        assert sorted(batch) == ["label", "path", "video"]
        assert batch["path"] == want["path"] and all(isinstance(p, str) for p in batch["path"])
        assert as_bytes(batch["label"]) == as_bytes(want["label"])
        assert as_bytes(batch["video"]) == as_bytes(want["video"])
    assert sorted(p for b in ours for p in b["path"]) == sorted(p for p, _ in ds.samples)


@pytest.mark.parametrize("name", ["image_folder", "video_clips"])
def test_train_step_takes_a_real_step(name, env, monkeypatch):
    if name == "video_clips":
        needs_video()
    example = load(name, monkeypatch)
    ds = example.dataset()
    torch.manual_seed(0)
    batch = torch.utils.data.default_collate([ds[i] for i in range(0, len(ds), len(ds) // 4)])
    rng = torch.get_rng_state()
    loss = example.train_step(batch)
    assert torch.equal(torch.get_rng_state(), rng)  # building the model drew on its own seed
    assert isinstance(loss, float) and math.isfinite(loss) and loss > 0
    model, _ = example.trainer()
    assert model is example.trainer()[0]  # built once
    assert torch.get_num_threads() == 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert math.isfinite(example.train_step(batch))
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    trained = {k for k, p in model.named_parameters()}
    assert trained <= changed  # every weight moved: a real backward and optimizer step
    assert any(k.endswith("running_mean") for k in changed)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["image_folder", "video_clips"])
def test_example_runs_as_a_training_script(name, env):
    if name == "video_clips":
        needs_video()
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    steps = re.findall(r"^step (\d+): loss (\S+) \([\d.]+ s\)$", done.stdout, re.M)
    assert [int(s) for s, _ in steps] == [0, 1]  # 48 images in 32s, 12 videos in 8s
    assert all(math.isfinite(float(loss)) for _, loss in steps)


@pytest.mark.slow
@pytest.mark.parametrize("name, batch", [("image_folder", 8), ("video_clips", 4)])
def test_example_runs_through_fastmm_bench(name, batch, env, tmp_path):
    """What the README shows a user: fastmm-bench --dataset on the example's Dataset and step
    (a smoke run, torch against fastmm): the same batches, a headline and a page."""
    if name == "video_clips":
        needs_video()
    target = EXAMPLES / f"{name}.py"
    done = subprocess.run([sys.executable, "-m", "fastmm.bench", "--dataset", f"{target}:dataset",
                           "--step", f"{target}:train_step", "--batch-size", str(batch),
                           "--num-workers", "2", "--quick", "--arms", "fastmm", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"report: {tmp_path / 'index.html'}"
    result = json.loads((tmp_path / "results.json").read_text())
    for arm in ("fastmm", "fastmm, loader alone"):
        check = result["arms"][arm]["correctness"]
        assert check["ok"] and check["check"] == "every batch byte-identical", check
    assert [h["what"].split(",")[1].strip() for h in result["headline"][:2]] == [
        "data pipeline (the loop only reads each batch)", "end to end on your step"]
