"""Checks that need CUDA (they skip elsewhere; FASTMM_REQUIRE_CUDA=1 turns a skip into a
failure): page-locked slabs with pin_memory=True, nvJPEG batch decode, crops on the GPU, NVDEC
clips (torchcodec; the test video is encoded by PyAV where, as on the device machine, there is
no ffmpeg CLI).
Run on a GPU machine with ``scripts/gpu-check``."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import fastmm

if not torch.cuda.is_available():
    if os.environ.get("FASTMM_REQUIRE_CUDA") == "1":
        raise RuntimeError("FASTMM_REQUIRE_CUDA=1 but CUDA is not available")
    pytest.skip("needs CUDA (FASTMM_REQUIRE_CUDA=1 makes this fail)", allow_module_level=True)


class Frames(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3, 224, 224), i % 251, dtype=torch.uint8)


@pytest.mark.parametrize("workers", [1, 2])
def test_pinned_slabs_copy_to_the_gpu_without_staging(workers):
    loader = fastmm.DataLoader(Frames(), batch_size=8, num_workers=workers, pin_memory=True)
    for k, batch in enumerate(loader):
        assert batch.is_pinned()  # the slab itself is host-registered: no pinned copy made
        on_gpu = batch.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), batch)
        assert int(on_gpu[0, 0, 0, 0]) == (8 * k) % 251


def test_the_benchmarks_cuda_consumer_copies_every_tensor_of_the_batch():
    from fastmm.bench.workloads import to_cuda

    batch = [torch.arange(1000, dtype=torch.uint8).pin_memory(), {"b": torch.ones(3, 5)}, "text"]
    assert to_cuda(batch) == 1000 + 3 * 5 * 4


def test_cuda_initialised_before_workers_fork_is_not_warned_of():
    """Every GPU training loop initialises CUDA before its loader forks workers that never use
    it: no warning for that (torch gives none); a GPU decode there is a DecoderFault instead."""
    import warnings

    torch.zeros(1, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", fastmm.FastmmWarning)
        loader = fastmm.DataLoader(Frames(), batch_size=8, num_workers=2,
                                   multiprocessing_context="fork")
        assert len(list(loader)) == 4


def test_a_batch_dropped_while_its_copy_is_queued_arrives_whole():
    """The usual loop, x = x.cuda(non_blocking=True), drops the host batch while its copy may
    still wait behind GPU work: its slab must not go back to the worker (which would write the
    next batch into it) before the copy is done."""
    loader = fastmm.DataLoader(Frames(), batch_size=2, num_workers=1, pin_memory=True,
                               prefetch_factor=1)
    busy = torch.randn(4096, 4096, device="cuda")
    arrived = []
    for batch in loader:
        for _ in range(20):  # queue ~tens of ms of work ahead of the copy
            busy = busy @ busy
            busy /= busy.norm()
        arrived.append(batch.to("cuda", non_blocking=True))
        del batch
    torch.cuda.synchronize()
    assert [int(b[j, 0, 0, 0]) for b in arrived for j in range(2)] == list(range(32))
    assert all(bool((b[j] == b[j, 0, 0, 0]).all()) for b in arrived for j in range(2))


def _jpeg(seed: int, size=(96, 128), subsampling: int = 0) -> bytes:
    """Noise, at 4:4:4 by default (the decoders' IDCTs alone differ); ``subsampling=2`` (4:2:0)
    adds the chroma upsampling, where libjpeg-turbo's smoothing and nvJPEG's differ most on
    noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = (rng.random((*size, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


def _photo_like(seed: int, size=(96, 128)) -> bytes:
    """Smooth colour gradients with mild noise, 4:2:0 as most photos are stored."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[0], 0:size[1]]
    arr = np.stack([x * 2 + seed * 10, y * 2, (x + y) + 40], -1) % 256
    arr = np.clip(arr + rng.normal(0, 4, arr.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90, subsampling=2)
    return buf.getvalue()


def test_nvjpeg_batch_matches_the_cpu_decoder():
    from fastmm.decode import get_decoder

    datas = [_jpeg(i) for i in range(3)] + [_photo_like(i) for i in range(3)]
    gpu = get_decoder("torchvision", device="cuda").decode_jpeg_batch(datas)
    cpu = [get_decoder("torchvision").decode_image(d) for d in datas]
    for g, c in zip(gpu, cpu):
        assert g.is_cuda and g.dtype == torch.uint8 and g.shape == c.shape
        assert (g.cpu().int() - c.int()).abs().float().mean() < 2.0  # IDCTs differ slightly


def test_dali_mixed_decoder_matches_its_cpu_decoder():
    """DALI's GPU ("mixed") decoder: a PNG bit-exact with DALI on the CPU, JPEGs within the
    nvJPEG test's tolerance, a JPEG crop's region decode too; each image stays as decoded after
    the next (the tensors view DALI's outputs, which only its default executor leaves alone)."""
    pytest.importorskip("nvidia.dali", reason="no DALI here (scripts/gpu-wheels packs it for the device)")
    from PIL import Image

    from fastmm.dataset import ResizedCrop
    from fastmm.decode import get_decoder

    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), np.uint8)).save(
        png, format="PNG")
    datas = [png.getvalue(), _jpeg(1), _photo_like(2)]
    gpu, cpu = get_decoder("dali", device="cuda"), get_decoder("dali")
    decoded = [gpu.decode_image(d) for d in datas]
    kept = [g.clone() for g in decoded]
    gpu.decode_image(_photo_like(3))
    on_cpu = [cpu.decode_image(d) for d in datas]
    for g, k, c in zip(decoded, kept, on_cpu):
        assert g.is_cuda and g.dtype == torch.uint8 and g.shape == c.shape
        assert torch.equal(g, k)
    assert torch.equal(decoded[0].cpu(), on_cpu[0])
    for g, c in zip(decoded[1:], on_cpu[1:]):
        assert (g.cpu().int() - c.int()).abs().float().mean() < 2.0

    def plan(width, height):
        torch.manual_seed(0)
        return ResizedCrop(size=(24, 32)).plan(width, height)

    crops = [dec.decode_resized_crop(datas[2], plan, key="k") for dec in (gpu, cpu)]
    assert crops[0].is_cuda and crops[0].shape == crops[1].shape == (3, 24, 32)
    assert (crops[0].cpu().int() - crops[1].int()).abs().float().mean() < 2.0


def test_crop_resize_on_the_gpu_matches_the_cpu():
    from fastmm.decode.base import CropPlan, crop_resize

    img = torch.randint(0, 256, (3, 120, 160), dtype=torch.uint8)
    plan = CropPlan(10, 20, 90, 100, 56, 64, True)
    cpu = crop_resize(img, plan)
    gpu = crop_resize(img.cuda(), plan)
    assert gpu.is_cuda and gpu.shape == cpu.shape
    assert (gpu.cpu().int() - cpu.int()).abs().max() <= 1


def _h264(frames: int, gop: int = 8) -> bytes:
    """A 256x256 H.264 MP4 whose frame i shows i (x264 with B-frames; the ffmpeg CLI, else
    PyAV)."""
    import tempfile

    from fastmm.bench.mmcorpus import encode_h264, index_pattern

    with tempfile.TemporaryDirectory() as d:
        encode_h264((np.tile(index_pattern(i), (4, 4, 1)) for i in range(frames)), 256, 256, 24,
                    gop, 18, f"{d}/v.mp4")
        with open(f"{d}/v.mp4", "rb") as f:
            return f.read()


def _torchcodec_cuda_error():
    """The RuntimeError torchcodec raises opening a clip on CUDA, or None when it opens."""
    pytest.importorskip("torchcodec")
    from torchcodec import decoders as tcd

    try:
        tcd.VideoDecoder(_h264(8), device="cuda")
    except RuntimeError as e:
        return e
    return None


@pytest.fixture
def nvdec():
    """torchcodec able to decode on CUDA: a torchcodec built without CUDA (PyPI's 0.11, say)
    is the environment's limit, not fastmm's."""
    from fastmm.decode.torchcodec import built_without_cuda

    error = _torchcodec_cuda_error()
    if error is not None and built_without_cuda(error):
        pytest.skip("torchcodec was built without CUDA")
    if error is not None:
        raise error


def test_torchcodec_on_cuda_without_nvdec_is_a_decoder_fault():
    """A torchcodec without CUDA (PyPI's 0.11) is a DecoderFault that says so, not every clip
    counted corrupt."""
    from fastmm.decode import ClipSpec, DecoderFault, get_decoder
    from fastmm.decode.torchcodec import built_without_cuda

    error = _torchcodec_cuda_error()
    if error is None:
        pytest.skip("this torchcodec decodes on CUDA")
    assert built_without_cuda(error)
    with pytest.raises(DecoderFault, match="built without CUDA"):
        get_decoder("torchcodec", device="cuda").decode_clip(_h264(8), ClipSpec(num_frames=2))


def test_nvdec_clip_frames_are_the_frames_asked_for(nvdec):
    from fastmm.bench.mmcorpus import read_frame_index
    from fastmm.decode import ClipSpec, get_decoder

    data, spec = _h264(48), ClipSpec(num_frames=5, stride=4)
    clip, idx = get_decoder("torchcodec", device="cuda").decode_clip(data, spec, key="v")
    assert clip.is_cuda and idx == [0, 4, 8, 12, 16]
    assert [read_frame_index(f.cpu()) for f in clip] == idx
    on_cpu, _ = get_decoder("torchcodec").decode_clip(data, spec, key="v")
    assert (clip.cpu().float() - on_cpu.float()).abs().mean() < 2.0


def test_nvdec_slimmed_clips_are_the_same_frames(nvdec):
    """MP4 slimming (decode.mp4) with NVDEC: the same frames as NVDEC on the whole file. It is
    off on CUDA by default until this passes on a GPU machine."""
    from fastmm.bench.mmcorpus import read_frame_index
    from fastmm.decode import ClipSpec, mp4
    from fastmm.decode.torchcodec import Decoder

    data = _h264(96, gop=24)
    spec = ClipSpec(num_frames=8, stride=2, sampling="random")
    assert mp4.parse(data) is not None
    for seed in range(6):
        clips = [Decoder(device="cuda", skip_unused_frames=skip).decode_clip(
            data, spec, generator=torch.Generator().manual_seed(seed)) for skip in (True, False)]
        (slimmed, idx), (whole, whole_idx) = clips
        assert idx == whole_idx and torch.equal(slimmed, whole)
        assert [read_frame_index(f.cpu()) for f in slimmed] == idx


class _NvjpegInWorker(Dataset):
    """nvJPEG in the DataLoader worker: each item one JPEG decoded on the GPU."""

    def __init__(self):
        from PIL import Image

        from fastmm.decode import get_decoder

        out = io.BytesIO()
        Image.new("RGB", (64, 48), (10, 200, 30)).save(out, "JPEG")
        self.data, self.decoder = out.getvalue(), get_decoder("torchvision", device="cuda")

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.decoder.decode_jpeg_batch([self.data])[0].cpu()


def test_gpu_decode_in_a_worker_forked_after_cuda_init_is_a_decoder_fault():
    """A training script initialises CUDA before its loader forks workers, which then cannot use
    it: a GPU decode there is a DecoderFault naming the way out, not corrupt samples; with
    spawn it decodes."""
    from fastmm.decode import DecoderFault

    torch.zeros(1, device="cuda")  # the parent initialises CUDA
    forked = fastmm.DataLoader(_NvjpegInWorker(), num_workers=1, multiprocessing_context="fork")
    with pytest.raises(DecoderFault, match="forked after.*'spawn'"):
        next(iter(forked))
    spawned = fastmm.DataLoader(_NvjpegInWorker(), num_workers=1, multiprocessing_context="spawn")
    assert [tuple(b.shape) for b in spawned] == [(1, 3, 48, 64)] * 2
