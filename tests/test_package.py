"""The package face loads what is used, and the parts keep their dependency lines: the loader
side without the dataset, sources or decoders; decoding without the transport."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fastmm


def _loaded_after(statement: str) -> set[str]:
    code = (f"import sys; {statement}; "
            "print(' '.join(m for m in sys.modules if m.startswith('fastmm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_fastmm_loads_nothing_until_a_name_is_used():
    assert _loaded_after("import fastmm") == {"fastmm"}


@pytest.mark.slow  # a fresh interpreter imports torch: about 3 s
def test_the_loader_side_loads_without_dataset_sources_or_decoders():
    loaded = _loaded_after("import fastmm.loader")
    assert "fastmm.loader" in loaded
    assert not {m for m in loaded if m.split(".")[1:2] in (["dataset"], ["sources"], ["decode"],
                                                           ["stream"], ["bench"])}, sorted(loaded)


@pytest.mark.slow
def test_decoding_loads_nothing_of_the_transport():
    loaded = _loaded_after("import fastmm.decode.base")
    assert not loaded & {"fastmm.slabs", "fastmm.collate", "fastmm.loader", "fastmm._workers",
                         "fastmm._processes", "fastmm.sources"}, sorted(loaded)


def test_public_names_and_submodules_resolve_on_first_use():
    from fastmm.dataset import MultimodalDataset
    from fastmm.loader import DataLoader

    assert fastmm.DataLoader is DataLoader and fastmm.MultimodalDataset is MultimodalDataset
    assert fastmm.telemetry.Telemetry is not None  # a submodule, without importing it first
    assert set(fastmm.__all__) <= set(dir(fastmm))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        fastmm.NoSuchThing


LOADER_SIDE = ("loader.py", "_workers.py", "_processes.py", "_receiver.py", "_respawn.py",
               "_tasks.py", "_messages.py", "collate.py", "_batch_fill.py", "slabs.py",
               "resume.py", "shared.py", "_torch.py", "_native.py", "offers.py")
MOST_LINES = 250  # a class, with the fastmm classes it is mixed from (issue 52)


def test_no_loader_side_class_is_over_250_lines_with_its_fastmm_bases():
    import ast
    import pathlib

    root = pathlib.Path(fastmm.__file__).parent
    classes = {}
    for name in LOADER_SIDE:
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                classes[node.name] = (node.end_lineno - node.lineno + 1, bases, name)
    for cls, (lines, bases, name) in classes.items():
        total = lines + sum(classes[b][0] for b in bases if b in classes)
        assert total <= MOST_LINES, f"{name}: {cls} and its fastmm bases are {total} lines"
