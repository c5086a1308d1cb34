"""Decoder registry, configuration (FASTMM_DECODE, FASTMM_DEVICE), ClipSpec and DecodeLimits."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest
import torch

from fastmm.config import DECODE_BACKENDS, ConfigError, DecodeConfig
from fastmm.decode import (
    DECODERS,
    ClipSpec,
    DecodeError,
    DecodeLimitError,
    DecodeLimits,
    get_decoder,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("FASTMM_DECODE", raising=False)
    monkeypatch.delenv("FASTMM_DEVICE", raising=False)


def test_registry_names_are_the_config_choices():
    assert tuple(DECODERS) == DECODE_BACKENDS == ("pil", "torchvision", "torchcodec", "dali")


def test_default_is_pil_on_cpu():
    assert DecodeConfig.resolve() == DecodeConfig(backend="pil", device="cpu")
    dec = get_decoder()
    assert dec.name == "pil" and dec.device == "cpu" and dec.limits == DecodeLimits()


def test_argument_beats_variable_beats_default(monkeypatch):
    monkeypatch.setenv("FASTMM_DECODE", "torchvision")
    monkeypatch.setenv("FASTMM_DEVICE", "cuda:1")
    assert DecodeConfig.resolve() == DecodeConfig(backend="torchvision", device="cuda:1")
    assert DecodeConfig.from_env() == DecodeConfig(backend="torchvision", device="cuda:1")
    assert DecodeConfig.resolve(backend="pil", device="cpu") == DecodeConfig("pil", "cpu")
    monkeypatch.setenv("FASTMM_DEVICE", "cpu")
    assert get_decoder().name == "torchvision"
    assert get_decoder("pil").name == "pil"


@pytest.mark.parametrize("var,value", [("FASTMM_DECODE", "opencv"), ("FASTMM_DEVICE", "gpu"),
                                       ("FASTMM_DEVICE", "cuda:x")])
def test_bad_variable_names_variable_value_and_choices(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as e:
        DecodeConfig.resolve()
    msg = str(e.value)
    assert var in msg and repr(value) in msg
    assert ("'pil', 'torchvision', 'torchcodec', 'dali'" in msg) if var == "FASTMM_DECODE" else (
        "'cuda:N'" in msg)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="unknown decoder 'opencv'"):
        get_decoder("opencv")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_decoder("pil", device="tpu")
    with pytest.raises(ValueError, match="CPU only"):
        get_decoder("pil", device="cuda")


@pytest.mark.parametrize("name,module,package", [
    ("torchcodec", "torchcodec", "torchcodec"), ("dali", "nvidia.dali", "nvidia-dali-cuda130"),
    ("torchvision", "torchvision", "torchvision"), ("pil", "PIL", "pillow")])
def test_missing_library_names_the_package(monkeypatch, name, module, package):
    monkeypatch.delitem(sys.modules, f"fastmm.decode.{name}", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # makes "import <module>" fail
    with pytest.raises(ImportError, match=rf"pip install {package}"):
        get_decoder(name)


def test_decode_does_not_import_sources_slabs_or_collate():
    src = pathlib.Path(__file__).parents[1] / "src" / "fastmm" / "decode"
    banned = {"sources", "slabs", "collate", "loader", "_workers", "dataset", "bench"}
    for f in src.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [(node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            parts = {p for n in names for p in n.split(".")}
            assert not parts & banned, (f.name, names)


def test_errors_are_value_errors_with_key_and_reason():
    e = DecodeError("corrupt", "a/b", "bad bytes")
    assert isinstance(e, ValueError) and (e.key, e.reason) == ("a/b", "corrupt")
    assert str(e) == "corrupt: bad bytes (key='a/b', origin='')"
    lim = DecodeLimitError("k", "too big")
    assert isinstance(lim, DecodeError) and lim.reason == "too_large" and lim.key == "k"


def test_limits():
    lim = DecodeLimits(max_image_pixels=100, max_clip_frames=4, max_clip_pixels=300)
    lim.check_image(10, 10, "k")
    with pytest.raises(DecodeLimitError, match="max_image_pixels=100"):
        lim.check_image(11, 10, "k")
    lim.check_clip(3, 10, 10, "k")
    with pytest.raises(DecodeLimitError, match="max_clip_frames=4"):
        lim.check_clip(5, 2, 2, "k")
    with pytest.raises(DecodeLimitError, match="max_clip_pixels=300"):
        lim.check_clip(4, 10, 10, "k")
    with pytest.raises(DecodeError, match="0x5"):
        lim.check_image(0, 5, "k")


def test_clipspec_validation():
    with pytest.raises(ValueError):
        ClipSpec(num_frames=0)
    with pytest.raises(ValueError, match="not both"):
        ClipSpec(num_frames=2, stride=2, fps=5.0)
    with pytest.raises(ValueError, match="no stride or fps"):
        ClipSpec(num_frames=2, stride=2, sampling="uniform")
    with pytest.raises(ValueError):
        ClipSpec(num_frames=2, sampling="middle")
    with pytest.raises(Exception):  # frozen
        ClipSpec(num_frames=2).num_frames = 3


def test_frame_indices_start_stride_fps_uniform():
    assert ClipSpec(num_frames=4).frame_indices(10) == [0, 1, 2, 3]
    assert ClipSpec(num_frames=4, stride=3).frame_indices(10) == [0, 3, 6, 9]
    assert ClipSpec(num_frames=3, fps=12.0).frame_indices(20, 24.0) == [0, 2, 4]
    assert ClipSpec(num_frames=3, fps=10.0).frame_indices(20, 25.0) == [0, 2, 5]
    assert ClipSpec(num_frames=5, sampling="uniform").frame_indices(9) == [0, 2, 4, 6, 8]
    assert ClipSpec(num_frames=4, sampling="uniform").frame_indices(2) == [0, 0, 1, 1]
    assert ClipSpec(num_frames=1, sampling="uniform").frame_indices(9) == [4]


def test_frame_indices_errors():
    with pytest.raises(DecodeError) as e:
        ClipSpec(num_frames=4, stride=3).frame_indices(9, key="v")
    assert (e.value.reason, e.value.key) == ("too_short", "v")
    with pytest.raises(DecodeError) as e:
        ClipSpec(num_frames=1).frame_indices(0, key="v")
    assert e.value.reason == "no_video"


def test_random_sampling_seed_generator_and_global_rng():
    spec = ClipSpec(num_frames=4, stride=2, sampling="random", seed=7)
    starts = {spec.frame_indices(100, key=f"k{i}")[0] for i in range(50)}
    assert len(starts) > 10 and min(starts) >= 0 and max(starts) <= 100 - 7
    # seed + key: the same clip every time, whatever the global RNG
    a = spec.frame_indices(100, key="x")
    torch.manual_seed(123)
    assert spec.frame_indices(100, key="x") == a
    assert [i - a[0] for i in a] == [0, 2, 4, 6]
    # an explicit generator wins over the seed
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert spec.frame_indices(100, key="x", generator=g1) == spec.frame_indices(
        100, key="x", generator=g2)
    # no seed, no generator: torch's global RNG
    free = ClipSpec(num_frames=4, sampling="random")
    torch.manual_seed(3)
    b = [free.frame_indices(1000) for _ in range(5)]
    torch.manual_seed(3)
    assert [free.frame_indices(1000) for _ in range(5)] == b
    # a clip that exactly fits has one start
    assert ClipSpec(num_frames=3, stride=2, sampling="random").frame_indices(5) == [0, 2, 4]


def _layouts():
    hwc = (torch.arange(30 * 40 * 4, dtype=torch.int32).reshape(30, 40, 4) * 13).to(torch.uint8)
    return {
        "rgb": hwc[..., :3].contiguous().permute(2, 0, 1),
        "rgb_of_rgba": hwc.permute(2, 0, 1)[:3],
        "crop": hwc.permute(2, 0, 1)[:, 3:20, 5:33],
        "clip": torch.stack([hwc, hwc + 1]).permute(0, 3, 1, 2),
        "bool": (hwc > 99).permute(2, 0, 1),
        "int8": hwc.view(torch.int8).permute(2, 0, 1),
        "float": hwc.float().permute(2, 0, 1),  # torch's own copy
        "transposed": hwc[:, :, 0].t(),
        "contiguous": hwc.permute(2, 0, 1).contiguous(),
    }


@pytest.mark.parametrize("name", list(_layouts()))
def test_layout_copies_equal_torchs(name):
    """Decoded pixels (HWC memory viewed as CHW) take NumPy's faster copy; every layout comes
    out as torch's .contiguous() and copy_() give it, in new memory."""
    from fastmm import _layout

    t = _layouts()[name]
    expected = t.contiguous()
    got = _layout.contiguous(t)
    assert got.is_contiguous() and got.dtype == t.dtype and torch.equal(got, expected)
    if not t.is_contiguous():
        assert got.data_ptr() != t.data_ptr()
    out = torch.zeros_like(expected)
    assert _layout.copy_into(out, t) is out and torch.equal(out, expected)
