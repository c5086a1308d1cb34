"""MultimodalDataset: the same items from every source, crops bit-exact with torchvision's
pipeline, the frames asked for, and the on_error policy (raise, skip, replace) counted across
worker processes."""

from __future__ import annotations

import io
import os
import shutil
import warnings

import pytest
import torch
from PIL import Image

import fastmm
from fastmm.bench.mmcorpus import CorpusSpec, read_frame_index
from fastmm.dataset import MultimodalDataset, ResizedCrop
from fastmm.decode import ClipSpec, DecodeError
from fastmm.sources import SourceError, write_shards

if shutil.which("ffmpeg") is None:
    pytest.skip("the ffmpeg CLI is needed to encode corpus videos", allow_module_level=True)

CORPUS_SPEC = CorpusSpec(
    num_images=16, num_videos=3, seed=3, png_fraction=0.25, image_short_side=(120, 220),
    large_fraction=0.25, large_short_side=(700, 800), video_duration_s=(1.0, 1.4),
    video_fps=(24,), video_sizes=((128, 96),), video_keyint=(8,), shard_bytes=200_000,
)


def _roots(out):
    return {"posix": os.path.join(out, "posix"), "manifest": os.path.join(out, "posix",
            "manifest.jsonl"), "shards": os.path.join(out, "shards")}


def test_same_items_from_tree_manifest_and_shards(corpus):
    roots = _roots(corpus)
    sets = {
        name: MultimodalDataset(root, source="shards" if name == "shards" else "posix",
                                modality="image", size=64, crop="center")
        for name, root in roots.items()
    }
    assert {len(d) for d in sets.values()} == {CORPUS_SPEC.num_images}
    for i in range(CORPUS_SPEC.num_images):
        items = [d[i] for d in sets.values()]
        assert len({it["key"] for it in items}) == 1
        assert all(torch.equal(items[0]["image"], it["image"]) for it in items)
        assert items[0]["image"].shape == (3, 64, 64) and items[0]["image"].dtype == torch.uint8
        assert items[0]["caption"] and 0 <= items[0]["label"]


def test_random_crop_bit_exact_with_torchvision_pipeline(corpus):
    """No reduce: the same crop, flip and bilinear resize as torchvision v2 on a PIL image,
    drawing the same random numbers."""
    from torchvision.transforms import v2

    ds = MultimodalDataset(_roots(corpus)["manifest"], modality="image", size=(48, 64))
    tv = v2.Compose([v2.RandomResizedCrop((48, 64)), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    for i in range(len(ds)):
        sample = ds.source.read(ds._index()[i])
        data = next(v for k, v in sample.members.items() if k in ("jpg", "png"))
        torch.manual_seed(100 + i)
        ours = ds[i]["image"]
        torch.manual_seed(100 + i)
        theirs = tv(Image.open(io.BytesIO(data)).convert("RGB"))
        assert torch.equal(ours, theirs), sample.key


@pytest.mark.parametrize("decoder", ["pil", "torchvision"])
def test_fast_path_is_close_to_the_exact_one(corpus, decoder):
    """reduce=True (DCT-reduced JPEG decode, torch's resize) against the bit-exact pil path."""
    crop = ResizedCrop(size=(96, 96), mode="center")
    full = MultimodalDataset(_roots(corpus)["posix"], modality="image", crop=crop)
    reduced = MultimodalDataset(_roots(corpus)["posix"], modality="image", crop=crop, reduce=True,
                                decoder=decoder)
    diffs = []
    for i in range(len(full)):
        a, b = full[i]["image"].float(), reduced[i]["image"].float()
        assert a.shape == b.shape == (3, 96, 96)
        diffs.append((a - b).abs().mean().item())
        if "png" in full.source.extensions(full._index()[i]):  # never DCT-reduced: only the
            assert (a - b).abs().max() <= 2  # resize kernel differs (torch's vs Pillow's)
    assert max(diffs) < 4.0  # mean absolute difference in 0..255 levels
    assert any(d > 0 for d in diffs)  # the large JPEGs did take the reduced path


def test_video_clips_are_the_frames_asked_for(corpus):
    spec = ClipSpec(num_frames=4, stride=3, sampling="start")
    ds = MultimodalDataset(_roots(corpus)["shards"], source="shards", decoder="torchcodec",
                           modality="video", clip=spec)
    assert len(ds) == CORPUS_SPEC.num_videos
    for i in range(len(ds)):
        clip = ds[i]["video"]
        assert clip.shape[:2] == (4, 3)
        assert [read_frame_index(f) for f in clip] == [0, 3, 6, 9]


def test_video_resized_in_the_decoder(corpus):
    spec = ClipSpec(num_frames=2, stride=1)
    ds = MultimodalDataset(_roots(corpus)["posix"], decoder="torchcodec", modality="video",
                           clip=spec, size=(48, 48), crop="center")
    clip = ds[0]["video"]
    assert clip.shape == (2, 3, 48, 48) and clip.dtype == torch.uint8
    loader = fastmm.DataLoader(ds, batch_size=3, num_workers=1)
    (batch,) = list(loader)
    assert batch["video"].shape == (3, 2, 3, 48, 48)


def _bad_corpus(tmp_path, good_root, order=range(6)):
    """Six samples: good, corrupt jpg, good, zero-byte, good, truncated png (in `order`)."""
    good = MultimodalDataset(good_root, modality="image")
    datas = []
    for i in range(3):
        s = good.source.read(good._index()[i])
        ext = "jpg" if "jpg" in s.members else "png"
        datas.append((ext, s.members[ext]))
    png = io.BytesIO()
    Image.new("RGB", (40, 30), (9, 9, 9)).save(png, "PNG")
    samples = [
        (f"s{0}", {datas[0][0]: datas[0][1], "cls": b"0"}),
        ("s1", {"jpg": b"\xff\xd8\xff" + bytes(range(256)) * 4, "cls": b"1"}),
        ("s2", {datas[1][0]: datas[1][1], "cls": b"2"}),
        ("s3", {"jpg": b"", "cls": b"3"}),
        ("s4", {datas[2][0]: datas[2][1], "cls": b"4"}),
        ("s5", {"png": png.getvalue()[:60], "cls": b"5"}),
    ]
    out = tmp_path / "bad"
    write_shards([samples[i] for i in order], str(out))
    return str(out)


def test_on_error_raise_names_key_and_origin(corpus, tmp_path):
    ds = MultimodalDataset(_bad_corpus(tmp_path, _roots(corpus)["posix"]), source="shards",
                           size=32)
    assert ds[0]["label"] == 0
    with pytest.raises(DecodeError) as info:
        ds[1]
    assert info.value.key == "s1" and ".tar:" in info.value.origin


@pytest.mark.parametrize("num_workers", [0, 2])
def test_on_error_skip_and_replace_counted_across_workers(corpus, tmp_path, num_workers, caplog):
    root = _bad_corpus(tmp_path, _roots(corpus)["posix"])
    skip = MultimodalDataset(root, source="shards", size=32, on_error="skip")
    labels = [int(x) for b in fastmm.DataLoader(skip, batch_size=2, num_workers=num_workers)
              for x in b["label"]]
    assert labels == [0, 2, 4]
    assert skip.skipped == {"corrupt": 2, "empty": 1} and skip.replaced == 0
    replace = MultimodalDataset(root, source="shards", size=32, on_error="replace")
    batches = list(torch.utils.data.DataLoader(replace, batch_size=3, num_workers=num_workers))
    assert [b["label"].tolist() for b in batches] == [[0, 2, 2], [4, 4, 0]]
    assert replace.skipped == {"corrupt": 2, "empty": 1} and replace.replaced == 3
    if num_workers == 0:
        assert any("s3" in r.getMessage() and ".tar:" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_bad_stand_in_is_counted_once_at_its_own_index(corpus, tmp_path, num_workers, caplog):
    """s1 and s2 both bad: s1's slot tries s2 and passes over it; s2 is counted (and logged)
    once, for its own index, so the epoch's counts are the bad samples."""
    root = _bad_corpus(tmp_path, _roots(corpus)["posix"], order=[0, 1, 3, 2, 4, 5])
    data = MultimodalDataset(root, source="shards", size=32, on_error="replace")
    batches = list(fastmm.DataLoader(data, batch_size=3, num_workers=num_workers))
    assert [b["label"].tolist() for b in batches] == [[0, 2, 2], [2, 4, 0]]
    assert data.skipped == {"corrupt": 2, "empty": 1} and data.replaced == 3
    if num_workers == 0:
        assert sum("'s3'" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("width, height", [(4, 40), (1, 1), (1, 7), (7, 1), (1, 65000)])
def test_a_center_crop_is_never_empty(width, height):
    """A narrow image for a wide, flat output: the centred box rounds to at least a pixel each
    way (a 0-pixel box gave black images or errors no on_error policy catches)."""
    plan = ResizedCrop(size=(3, 50), mode="center").plan(width, height)
    assert 1 <= plan.height <= height and 1 <= plan.width <= width
    png = io.BytesIO()
    Image.new("RGB", (width, height), (200, 200, 200)).save(png, "PNG")
    out = fastmm.decode.get_decoder("pil").decode_resized_crop(png.getvalue(), lambda w, h: plan)
    assert out.shape == (3, 3, 50) and int(out.float().mean()) == 200


def test_a_label_that_is_not_an_int64_is_a_bad_sample(tmp_path):
    """A cls member is an integer (-1 for a sample without one); anything else would end the
    run at int() or in the collate (past int64), or turn quietly into a wrong label."""
    png = io.BytesIO()
    Image.new("RGB", (40, 30), (9, 9, 9)).save(png, "PNG")
    labels = [b" 7\n", b"-3", b"+4", b"--5", b"9" * 30, b"", b"9" * 5000, b"cat", b"\xd9\xa3",
              b"12"]
    write_shards([(f"s{i}", {"png": png.getvalue(), "cls": c}) for i, c in enumerate(labels)],
                 str(tmp_path / "labels"))
    skip = MultimodalDataset(str(tmp_path / "labels"), source="shards", size=8, on_error="skip")
    got = [b["label"].tolist() for b in fastmm.DataLoader(skip, batch_size=5, num_workers=2)]
    assert got == [[7, -3, 4], [-1, 12]]
    assert skip.skipped == {"bad_label": 5}
    strict = MultimodalDataset(str(tmp_path / "labels"), source="shards", size=8)
    with pytest.raises(SourceError, match="bad_label: the cls member b'--5'") as e:
        strict[3]
    assert e.value.key == "s3" and ".tar:" in e.value.origin


def test_missing_member_and_no_clip_spec_are_typed(corpus, tmp_path):
    out = tmp_path / "nomedia"
    write_shards([("a", {"txt": b"only text"})], str(out))
    assert len(MultimodalDataset(str(out), source="shards")) == 0  # no media: not an item
    videos = MultimodalDataset(_roots(corpus)["posix"], decoder="torchcodec", modality="video")
    with pytest.raises(DecodeError, match="clip=ClipSpec"):
        videos[0]
    with pytest.raises(ValueError, match="on_error"):
        MultimodalDataset(_roots(corpus)["posix"], on_error="ignore")


def test_environment_picks_source_and_decoder(corpus, monkeypatch):
    monkeypatch.setenv("FASTMM_SOURCE", "shards")
    monkeypatch.setenv("FASTMM_DECODE", "torchvision")
    ds = MultimodalDataset(_roots(corpus)["shards"], modality="image", size=32, crop="center")
    assert ds.source.kind == "shards" and ds.decoder.name == "torchvision"
    ref = MultimodalDataset(_roots(corpus)["shards"], source="shards", decoder="pil",
                            modality="image", size=32, crop="center")
    png = [i for i in range(len(ds)) if "png" in ds.source.extensions(ds._index()[i])]
    for i in png:  # PNG: same pixels decoded, so only the resize implementations differ
        assert (ds[i]["image"].float() - ref[i]["image"].float()).abs().mean() < 3
    monkeypatch.setenv("FASTMM_DECODE", "jpeg2000")
    with pytest.raises(fastmm.ConfigError, match="FASTMM_DECODE"):
        MultimodalDataset(_roots(corpus)["shards"])
    with pytest.raises(SourceError):
        MultimodalDataset(_roots(corpus)["shards"], source="shards", decoder="pil",
                          required=("flac",))[0]


def test_pipeline_benchmark_arms_agree(corpus, monkeypatch):
    """The video arms of the pipelines benchmark decode the same frames (same random draws),
    and the image arms make the same crops, so their speeds compare like for like."""
    from fastmm.bench import pipelines

    monkeypatch.setattr(pipelines, "CLIP_FRAMES", 4)
    files = pipelines._files(corpus, ("mp4",))
    ours = pipelines._arms(corpus, "video", 2, 0)["fastmm (torchcodec)"][1]
    clips = []
    for ds in (pipelines.TorchcodecClipDataset(files), pipelines.PyAVClipDataset(files), ours):
        torch.manual_seed(5)
        clip = ds[1]
        clips.append(pipelines.media(clip) if isinstance(clip, dict) else clip)
    assert all(c.shape == (4, 3, 224, 224) for c in clips)
    assert [read_frame_index(f) for f in clips[0]] == [read_frame_index(f) for f in clips[2]]
    assert (clips[0].float() - clips[1].float()).abs().mean() < 2  # same FFmpeg, same frames
    arms = pipelines._arms(corpus, "image", 2, 0)
    torch_ds, fast_ds = arms["torch (PIL + v2)"][1], arms["fastmm, exact (pil)"][1]
    assert len(torch_ds) == len(fast_ds)  # the same images in the same (manifest) order
    for i in (0, 5):
        torch.manual_seed(9 + i)
        theirs = torch_ds[i]
        torch.manual_seed(9 + i)
        assert torch.equal(theirs, fast_ds[i])


@pytest.mark.parametrize("decoder", ["torchvision", "torchcodec"])
def test_bad_images_through_other_backends(corpus, tmp_path, decoder):
    root = _bad_corpus(tmp_path, _roots(corpus)["posix"])
    ds = MultimodalDataset(root, source="shards", size=32, on_error="skip", decoder=decoder,
                           reduce=True)
    labels = [int(x) for b in torch.utils.data.DataLoader(ds, batch_size=2) for x in b["label"]]
    assert labels == [0, 2, 4]
    assert sum(ds.skipped.values()) == 3 and set(ds.skipped) <= {"corrupt", "empty"}


def test_wrong_extension_and_bomb_through_the_policy(tmp_path):
    """A PNG stored as .jpg decodes by its content; a decompression bomb is refused from its
    header and, under skip, counted as too_large."""
    png, bomb = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (20, 10), (200, 10, 10)).save(png, "PNG")
    Image.new("L", (12000, 12000)).save(bomb, "PNG")  # 144 Mpx: over the default cap
    write_shards([("a", {"jpg": png.getvalue(), "cls": b"1"}),
                  ("b", {"png": bomb.getvalue(), "cls": b"2"})], str(tmp_path))
    for decoder in ("pil", "torchvision"):
        ds = MultimodalDataset(str(tmp_path), source="shards", decoder=decoder, on_error="skip")
        (item,) = ds.__getitems__([0, 1])
        assert item["image"].shape == (3, 10, 20) and int(item["image"][0, 0, 0]) == 200
        assert ds.skipped == {"too_large": 1}


def test_a_dataset_with_no_samples_says_so(corpus, tmp_path):
    """A wrong root, source or modality gives an empty dataset, which torch's loader iterates
    as zero batches without a word: fastmm warns once, naming what it looked for."""
    (tmp_path / "notes.txt").write_bytes(b"not a sample of any modality")
    ds = MultimodalDataset(str(tmp_path), decoder="pil")
    with pytest.warns(fastmm.FastmmWarning, match=r"no samples: its posix source holds 1, "
                      r"none with a member ending in \.jpg, \.jpeg"):
        assert len(ds) == 0
    video_only = MultimodalDataset(str(tmp_path), decoder="pil", modality="video")
    with pytest.warns(fastmm.FastmmWarning, match=r"\.mp4"):
        assert list(fastmm.DataLoader(video_only, batch_size=2)) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(MultimodalDataset(_roots(corpus)["posix"], decoder="pil")) > 0
        len(ds)  # once is enough


def _changed_api(*args, **kwargs):
    raise TypeError("decode() got an unexpected keyword argument 'mode'")


@pytest.mark.parametrize("decoder, modality", [("torchvision", "image"), ("torchcodec", "image"),
                                               ("torchcodec", "video"), ("dali", "image")])
def test_a_library_whose_api_changed_stops_the_loop_instead_of_skipping_everything(
        corpus, monkeypatch, decoder, modality):
    """Our pins are loose: a decoder library release whose API no longer fits our call raises
    TypeError (or AttributeError) for every sample. That is not a bad sample: counted "corrupt",
    on_error="skip" would skip the whole corpus. It must stop the loop with the library's error
    (a DALI pipeline that does not build: DecoderFault), nothing counted."""
    if decoder == "dali":
        dali = pytest.importorskip("fastmm.decode.dali")
        monkeypatch.setattr(dali.fn.decoders, "image", _changed_api)
        monkeypatch.setattr(dali.fn.decoders, "image_slice", _changed_api)
    else:
        module = __import__(f"fastmm.decode.{decoder}", fromlist=["_"])
        library = module.tvio if decoder == "torchvision" else module.tcd
        names = (["VideoDecoder"] if modality == "video" else
                 ["decode_image", "decode_jpeg"] if decoder == "torchvision" else ["decode_image"])
        for name in names:
            monkeypatch.setattr(library, name, _changed_api)
    clip = ClipSpec(num_frames=2) if modality == "video" else None
    for crop in ("center", None):
        ds = MultimodalDataset(_roots(corpus)["posix"], decoder=decoder, modality=modality,
                               clip=clip, size=32 if crop else None, crop=crop, on_error="skip")
        with pytest.raises((TypeError, fastmm.DecoderFault), match="unexpected keyword"):
            next(iter(fastmm.DataLoader(ds, batch_size=2, collate_fn=list)))
        assert ds.skipped == {}


@pytest.mark.parametrize("cause, says", [("bad fork", "forked after.*'spawn'"),
                                         ("no CUDA", "no CUDA device")])
@pytest.mark.parametrize("decoder, modality", [("torchcodec", "video"), ("dali", "image")])
def test_gpu_decode_that_cannot_work_is_a_fault_not_a_bad_sample(
        corpus, monkeypatch, decoder, modality, cause, says):
    """CUDA unusable, so torch raises for every sample: in a worker forked after the main
    process initialised it (torch's own flag, set here as such a fork would find it), or on a
    machine without CUDA (torchcodec: "Failed to get current CUDA device"). The GPU backends say
    so, with the way out, instead of counting every sample corrupt (and, under "skip",
    skipping them all)."""
    if decoder == "dali":
        pytest.importorskip("fastmm.decode.dali")
    if cause == "bad fork":
        monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    elif torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    clip = ClipSpec(num_frames=2) if modality == "video" else None
    ds = MultimodalDataset(_roots(corpus)["posix"], decoder=decoder, device="cuda",
                           modality=modality, clip=clip, size=32, crop="center",
                           on_error="skip")
    with pytest.raises(fastmm.DecoderFault, match=says):
        ds[0]
    assert ds.skipped == {}
