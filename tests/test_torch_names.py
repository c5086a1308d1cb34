"""Every private torch name fastmm uses is listed in fastmm/_torch.py and still where it was:
a torch upgrade that moves one fails here, naming it. And no other module reaches into torch's
internals (a private name used outside _torch.py would escape that check)."""

from __future__ import annotations

import pathlib
import re

import pytest

from fastmm import _torch

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "fastmm"


@pytest.mark.parametrize("name", _torch.PRIVATE)
def test_each_private_torch_name_is_where_fastmm_expects_it(name):
    _torch.private(name)  # ImportError naming the symbol and this torch's version


def test_a_name_torch_moved_is_named_in_the_error():
    with pytest.raises(ImportError, match=r"torch's private torch\.utils\.data\._gone"):
        _torch.private("torch.utils.data:_gone")


# torch's private modules (a part starting with "_") and underscore names taken from torch
_PRIVATE_USE = re.compile(r"(\btorch(\.\w+)*\._[A-Za-z]\w*|from torch[\w.]* import .*\b_[A-Za-z]\w*)")


def test_no_module_but_torch_names_reaches_into_torch():
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "_torch.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE_USE.search(code):
                found.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
