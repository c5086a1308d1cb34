"""Property tests (hypothesis): the tar reader against Python's tarfile, whole and cut short;
a state machine of next / state_dict + reload / worker kill / new epoch whose invariant is
that each id arrives exactly once per epoch; and the one check on names from outside."""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import fastmm  # noqa: E402
from fastmm.sources.shards import iter_members  # noqa: E402

from _resume_job import Augmented  # noqa: E402

_segment = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF,
                                          exclude_characters="/\\"), min_size=1, max_size=40)
_name = st.lists(_segment, min_size=1, max_size=5).map("/".join)
_members = st.lists(st.tuples(_name, st.binary(max_size=2000)), max_size=8,
                    unique_by=lambda m: m[0])
_formats = st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])


def _tar_bytes(members, fmt) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _read(raw: bytes):
    with tempfile.TemporaryFile() as f:
        f.write(raw)
        f.flush()
        return list(iter_members(f, read_data=True))


@settings(max_examples=300, deadline=None)
@given(members=_members, fmt=_formats)
def test_tar_reader_reads_what_tarfile_wrote(members, fmt):
    try:
        raw = _tar_bytes(members, fmt)
    except ValueError:  # a name this format cannot hold (ustar: long names)
        assume(False)
    ours = [(m.name, m.size, m.data) for m in _read(raw)]
    assert all(m.problem is None for m in _read(raw))
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        theirs = [(ti.name, ti.size, tar.extractfile(ti).read()) for ti in tar.getmembers()]
    assert ours == theirs


@settings(max_examples=300, deadline=None)
@given(members=_members.filter(bool), fmt=_formats, cut=st.floats(0, 1, exclude_max=True))
def test_a_cut_tar_gives_a_prefix_then_says_so(members, fmt, cut):
    try:
        raw = _tar_bytes(members, fmt)
    except ValueError:
        assume(False)
    whole = [(m.name, m.data) for m in _read(raw)]
    cut_raw = raw[: int(len(raw) * cut)]
    got = _read(cut_raw)  # never raises
    good = [(m.name, m.data) for m in got if m.problem is None]
    assert good == whole[: len(good)]  # what comes out is intact, in order
    if len(good) < len(whole):
        assert got and got[-1].problem is not None  # the damage is reported, last


class OncePerEpoch(RuleBasedStateMachine):
    """A loader driven through batches, checkpoints (JSON state into a fresh loader), worker
    kills (respawned) and epoch ends: within an epoch no id twice, at its end every id."""

    N = 23

    @initialize(persistent=st.booleans(), prefetch=st.integers(1, 3))
    def start(self, persistent, prefetch):
        self.options = dict(persistent_workers=persistent, prefetch_factor=prefetch)
        self.loader = self._make()
        self.it = iter(self.loader)
        self.seen: list[int] = []
        self.epochs = 0

    def _make(self):
        return fastmm.DataLoader(Augmented(self.N), batch_size=3, shuffle=True, num_workers=2,
                                 on_worker_failure="respawn", **self.options)

    def _take(self) -> bool:
        try:
            batch = next(self.it)
        except StopIteration:
            assert sorted(self.seen) == list(range(self.N)), "an epoch lost or repeated ids"
            self.seen, self.epochs = [], self.epochs + 1
            self.it = iter(self.loader)
            return False
        self.seen += [row[0] for row in batch.tolist()]
        return True

    @rule(steps=st.integers(1, 4))
    def next_batches(self, steps):
        for _ in range(steps):
            if not self._take():
                break

    @rule()
    def checkpoint_and_reload(self):
        state = json.loads(json.dumps(self.loader.state_dict()))
        del self.it
        self.loader = self._make()
        self.loader.load_state_dict(state)
        self.it = iter(self.loader)

    @precondition(lambda self: hasattr(self.it, "_workers"))
    @rule(which=st.integers(0, 1))
    def kill_a_worker(self, which):
        worker = self.it._workers[which]
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)

    @rule()
    def finish_the_epoch(self):
        while self._take():
            pass

    @invariant()
    def no_id_twice_in_an_epoch(self):
        assert len(self.seen) == len(set(self.seen))

    def teardown(self):
        self.__dict__.pop("it", None)


TestOncePerEpoch = pytest.mark.slow(OncePerEpoch.TestCase)
TestOncePerEpoch.settings = settings(max_examples=25, stateful_step_count=15, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# -- one check for every name from outside ---------------------------------------------------

from fastmm.sources.base import name_problem  # noqa: E402
from fastmm.sources.s3 import split_url  # noqa: E402

_hostile_part = st.sampled_from(["", ".", "..", "a\\b", "x\0y", "\ud800", "ok", "é", "a.jpg"])
_hostile_name = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(_hostile_part, _segment), min_size=1, max_size=5).map("/".join),
    st.lists(_segment, min_size=1, max_size=3).map(lambda p: "/" + "/".join(p)),
)


@settings(max_examples=500, deadline=None)
@given(name=_hostile_name)
def test_a_name_that_passes_stays_under_any_root_and_in_its_bucket(name):
    """Whatever passes joins onto a root as itself (no part dropped, merged or climbing out),
    keeps its bucket in an s3:// URL, and can be a file name."""
    if name_problem(name) is not None:
        return
    assert os.path.normpath(os.path.join("/root/dir", name)) == "/root/dir/" + name
    assert split_url(f"s3://bucket/prefix/{name}") == ("bucket", f"prefix/{name}")
    assert "\0" not in name and "\\" not in name
    name.encode("utf-8")


@pytest.mark.parametrize("name, why", [
    ("a/b.jpg", None), ("é/ü.jpg", None), ("..a/b..c", None),
    ("", "empty name"), ("/etc/passwd", "absolute name"), ("a//b", "empty path part"),
    ("a/", "empty path part"), ("../x", "'..'"), ("a/./b", "'.'"), ("a\\..\\b", "backslash"),
    ("a\0b", "NUL"), ("a\ud800", "lone surrogate"), (7, "not a string"),
])
def test_name_problem_names_each_kind_of_hostile_name(name, why):
    got = name_problem(name)
    assert got is None if why is None else why in got
