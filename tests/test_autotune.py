"""num_workers="auto" (issue 55): the tuner's decisions from given measurements, the arguments
and variables, and with real worker processes: each sample once in the sampler's order, the
same batches and draws whatever the tuner does, resume at another count, telemetry."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

import fastmm
from fastmm import autotune
from fastmm.autotune import AutoSettings, Change, Reading, Tuner
from fastmm.config import ConfigError
from fastmm.telemetry import Telemetry

from _resume_job import Augmented

GiB = 2**30


class Machine:
    """The tuner's view of a made-up machine: a clock, the CPU its workers used, the idle
    (the loader's own CPU: its workers'), their waits for tasks and for a core."""

    def __init__(self):
        self.t = self.cpu = self.idle = self.own = self.tasks_waited = self.ready = 0.0

    def clock(self) -> float:
        return self.t

    def read(self) -> Reading:
        return Reading(self.cpu, self.idle, self.own, self.tasks_waited, self.ready)

    def period(self, tuner: Tuner, wait: float, cpu: float, idle: float,
               done: float = 0.0, batches: int = 1, loop: float = 0.0,
               ready: float | None = None) -> list[Change]:
        """One period in which the loop got ``batches`` and waited ``wait`` of the time, the
        workers spent ``done`` of theirs waiting for a task with every batch they were given
        made, used ``cpu`` cores, waited ``ready`` cores' worth for a core (by default all the
        time they neither ran nor waited for a task: none blocked), the loop's own process
        used ``loop``, and ``idle`` cores were idle: the changes it brought."""
        if ready is None:
            ready = max(0.0, tuner.workers * (1.0 - done) - cpu)
        tuner.waited(wait)
        for _ in range(batches - 1):
            assert tuner.tick() == []  # (within the period)
        self.t += 1.0
        self.tasks_waited += done * tuner.workers
        self.ready += ready
        self.cpu += cpu
        self.own += cpu + loop
        self.idle += idle
        return tuner.tick()


def _tuner(machine, workers=2, most=8, prefetch=2, budget=None, room=None, cores=8,
           auto_prefetch=True) -> Tuner:
    """A tuner past its first period (the workers starting: not judged)."""
    tuner = Tuner(AutoSettings(True, auto_prefetch, budget, most), workers, prefetch,
                  machine.read, room or (lambda w, p: None), cores=cores, clock=machine.clock)
    assert machine.period(tuner, 1.0, 0.0, cores, batches=1) == []
    return tuner


def _moves(changes) -> list[tuple]:
    return [(c.setting, c.old, c.new) for c in changes]


def _steady(m: Machine, t: Tuner, wait: float, cpu: float, idle: float, **period) -> None:
    """The periods a count runs, judged, before a trial of another may begin (its rates are
    what the trial is judged against): TRIAL_PERIODS in all, the last one given by the test
    (``period``: Machine.period's other arguments)."""
    for _ in range(autotune.TRIAL_PERIODS - 1):
        assert m.period(t, wait, cpu, idle, **period) == []


def _kept(m: Machine, t: Tuner, wait: float, cpu: float, idle: float, batches: int) -> None:
    """A trial's settling period and its three judged ones, the loop faster throughout."""
    for _ in range(4):
        assert m.period(t, wait, cpu, idle, batches=batches) == []


def test_more_workers_while_the_loop_waits_and_cores_are_idle():
    m = Machine()
    t = _tuner(m)
    _steady(m, t, 0.2, 2, 5, batches=10)
    assert _moves(m.period(t, wait=0.2, cpu=2, idle=5, batches=10)) == [("num_workers", 2, 3)]
    assert "5.00 cores idle: 3 tried" in t.changes[-1].why
    _kept(m, t, 0.6, 3, 4, batches=14)
    assert _moves(m.period(t, 0.6, 3, 4, batches=14)) == [("num_workers", 3, 6)]  # doubled
    _kept(m, t, 0.6, 6, 2, batches=25)
    assert _moves(m.period(t, 0.6, 6, 2, batches=25)) == [("num_workers", 6, 8)]  # the cap
    _kept(m, t, 0.6, 8, 0, batches=30)
    assert t.workers == 8 and "waited 60%" in t.changes[-1].why
    assert [c.at_s for c in t.changes] == [4.0, 9.0, 14.0]  # (the first period not judged)


def test_workers_added_on_idle_cores_go_back_where_the_loop_gets_no_faster():
    """Cores idle between a CPU step's parallel parts are the step's: more workers there make
    the loop slower, and are taken back (and not tried again for a minute)."""
    m = Machine()
    t = _tuner(m, auto_prefetch=False)
    _steady(m, t, 0.2, 1.0, 0.8, batches=10)
    assert _moves(m.period(t, 0.2, 1.0, 0.8, batches=10)) == [("num_workers", 2, 3)]
    m.period(t, 0.2, 1.2, 0.6, batches=9)  # settling
    changes = [c for _ in range(3) for c in m.period(t, 0.2, 1.2, 0.6, batches=9)]
    assert _moves(changes) == [("num_workers", 3, 2)]
    m.period(t, 0.2, 1.0, 0.8, batches=10)
    for _ in range(20):
        assert m.period(t, 0.2, 1.0, 0.8, batches=10) == []
    assert t.workers == 2


def test_no_more_workers_without_an_idle_core_but_a_deeper_prefetch_if_they_idle():
    m = Machine()
    t = _tuner(m)
    assert m.period(t, wait=0.3, cpu=1.9, idle=0.1, done=0.05) == []  # busy workers, no core
    assert _moves(m.period(t, wait=0.3, cpu=1.0, idle=0.1, done=0.5)) == [
        ("prefetch_factor", 2, 3)]
    assert "spent 50% of their time with every batch they were given made" in t.changes[-1].why
    m.period(t, wait=0.12, cpu=1.2, idle=0.2, done=0.12)  # settling
    # transport's loop and workers at prefetch 3: each waits a tenth of its time or more
    assert _moves(m.period(t, wait=0.12, cpu=1.2, idle=0.2, done=0.12)) == [
        ("prefetch_factor", 3, 4)]
    m2 = Machine()
    t_fixed = _tuner(m2, auto_prefetch=False)
    assert m2.period(t_fixed, wait=0.3, cpu=1.0, idle=0.1, done=0.5) == []


def test_with_no_core_idle_one_more_worker_is_tried_only_where_they_were_blocked():
    """No core idle (another job fills them) and the workers blocked most of their time (a
    remote read): one more overlaps it, on trial, kept only if it pays. Workers that spent
    that time ready and waiting for a core (transport's, decode's on two cores) get none."""
    m = Machine()
    t = _tuner(m, workers=2, auto_prefetch=False)
    blocked = dict(cpu=0.6, idle=0.1, ready=0.1, batches=20)  # blocked 65% of their time
    _steady(m, t, 0.3, **blocked)
    assert _moves(m.period(t, 0.3, **blocked)) == [("num_workers", 2, 3)]
    assert "3 tried" in t.changes[-1].why and "blocked 65% of their time" in t.changes[-1].why
    m.period(t, 0.3, **blocked)  # settling
    for _ in range(3):  # no gain: back to 2
        changes = m.period(t, 0.3, **blocked)
    assert _moves(changes) == [("num_workers", 3, 2)]
    assert "made 20.0 batches a second over 3 periods, +0% (+/- 0%)" in changes[0].why
    m.period(t, 0.3, **blocked)
    for _ in range(20):  # not tried again for a minute
        assert m.period(t, 0.3, **blocked) == []
    m2 = Machine()
    t2 = _tuner(m2, workers=2, auto_prefetch=False)
    for _ in range(autotune.TRIAL_PERIODS):
        m2.period(t2, 0.3, **blocked)
    assert t2.workers == 3
    m2.period(t2, 0.3, 0.9, 0.05, ready=0.15, batches=22)  # settling
    for _ in range(3):
        assert m2.period(t2, 0.25, 0.9, 0.05, ready=0.15, batches=22) == []  # 10% more: kept
    assert t2.workers == 3
    for cpu, done in ((1.15, 0.12), (1.95, 0.0)):  # waiting for a core: none tried
        m3 = Machine()
        t3 = _tuner(m3, workers=2, auto_prefetch=False)
        for _ in range(10):
            assert m3.period(t3, 0.3, cpu, 0.1, done=done, batches=20) == []


def test_a_trial_is_judged_beyond_the_noise_of_its_rates():
    """Rates that vary from period to period. More workers: a few percent up, but within the
    noise, runs on to its most periods and is not kept; no gain goes back after the first
    three; clearly faster is kept after three. Fewer, with the same 3% margin: 2% slower is
    kept after three; 4% slower, within the noise of 3%, runs on to its most periods and goes
    back; 20% slower goes back after three."""
    assert autotune.gain_and_noise([10, 10], [11, 11]) == (pytest.approx(0.1), 0.0)
    gain, noise = autotune.gain_and_noise([9, 11, 10], [9.5, 11.5, 10.5])
    assert gain == pytest.approx(0.05) and noise == pytest.approx(0.0816, abs=1e-3)

    def more_on_trial(trial_batches) -> tuple[Tuner, int]:
        m = Machine()
        t = _tuner(m, workers=2, auto_prefetch=False)
        for batches in (36, 44, 40):
            m.period(t, 0.3, 0.6, 0.1, ready=0.1, batches=batches)
        assert t.workers == 3  # no core idle, the workers blocked: one more on trial
        m.period(t, 0.3, 0.9, 0.1, ready=0.1, batches=40)  # settling
        for ran, batches in enumerate(trial_batches, 1):
            if m.period(t, 0.3, 0.9, 0.1, ready=0.1, batches=batches) or t._trial is None:
                return t, ran
        return t, len(trial_batches)

    t, ran = more_on_trial((44, 40, 43, 41, 44, 41, 44, 42, 40))  # +6% +/- 4-7%
    assert ran == autotune.TRIAL_MOST_PERIODS and t.workers == 2
    assert "+6% (+/- 4%)" in t.changes[-1].why
    t, ran = more_on_trial((42, 38, 40))  # +0%: back after three
    assert ran == 3 and t.workers == 2
    t, ran = more_on_trial((52, 46, 50))  # +23% +/- 8%: kept after three
    assert ran == 3 and t.workers == 3

    def fewer_on_trial(trial_batches) -> tuple[Tuner, int]:
        m = Machine()
        t = _tuner(m, workers=3, auto_prefetch=False)
        for batches in (18, 22, 20):
            m.period(t, 0.03, 1.5, 0.1, batches=batches, loop=1.2)
        assert t.workers == 2  # one fewer on trial
        m.period(t, 0.03, 1.0, 0.1, batches=20, loop=1.2)  # settling
        for ran, batches in enumerate(trial_batches, 1):
            if m.period(t, 0.03, 1.0, 0.1, batches=batches, loop=1.2) or t._trial is None:
                return t, ran
        return t, len(trial_batches)

    t, ran = fewer_on_trial((20, 19, 20))  # -2%: kept after three
    assert ran == 3 and t.workers == 2 and len(t.changes) == 1
    t, ran = fewer_on_trial((20, 19, 19, 18, 20, 20, 18, 20))  # -4% +/- 4-6%: run on, back
    assert ran == autotune.TRIAL_MOST_PERIODS and t.workers == 3
    assert "-4% (+/- " in t.changes[-1].why
    t, ran = fewer_on_trial((16, 16, 16))  # -20%: back after three
    assert ran == 3 and t.workers == 3


def test_a_trial_taken_back_leaves_the_rates_before_it_to_judge_the_next():
    """Back at the count it left, the periods read there before the trial still count: the
    next trial (here of one more) begins after the settling period, not three later."""
    m = Machine()
    t = _tuner(m, workers=2, auto_prefetch=False)
    at_two = dict(batches=20, loop=0.6, ready=0.1)  # the workers blocked 30% of their time
    _steady(m, t, 0.1, 1.3, 0.1, **at_two)
    assert _moves(m.period(t, 0.1, 1.3, 0.1, **at_two)) == [("num_workers", 2, 1)]
    m.period(t, 0.3, 0.7, 0.8, batches=14, loop=0.6)  # settling
    changes = [c for _ in range(3) for c in m.period(t, 0.3, 0.7, 0.8, batches=14, loop=0.6)]
    assert _moves(changes) == [("num_workers", 1, 2)]  # 30% fewer batches: back
    m.period(t, 0.1, 1.3, 0.1, **at_two)  # settling
    assert _moves(m.period(t, 0.1, 1.3, 0.1, **at_two)) == [("num_workers", 2, 3)]
    assert t._trial.before == [20.0] * 4  # the three at 2 before the first trial, and one


def test_beside_a_cpu_heavy_step_one_fewer_worker_is_tried_and_kept_unless_slower():
    """The loop's own process busy (its step on the CPU): once steady, one fewer worker on
    trial, kept where the loop gets as many batches (the freed core goes to the step), taken
    back where it gets fewer; the count shown no better is not tried again for a minute."""
    m = Machine()
    t = _tuner(m, workers=3, auto_prefetch=False)
    for _ in range(2):
        assert m.period(t, 0.03, 1.5, 0.1, batches=10, loop=1.2) == []
    assert _moves(m.period(t, 0.03, 1.5, 0.1, batches=10, loop=1.2)) == [("num_workers", 3, 2)]
    assert "own process used 1.20 cores: 2 tried" in t.changes[-1].why
    _kept(m, t, 0.03, 1.0, 0.1, batches=10)  # as many batches with 2
    assert t.workers == 2
    assert _moves(m.period(t, 0.03, 1.0, 0.1, batches=10, loop=1.2)) == [("num_workers", 2, 1)]
    m.period(t, 0.2, 0.6, 0.1, batches=8, loop=1.2)  # settling
    changes = [c for _ in range(3) for c in m.period(t, 0.2, 0.6, 0.1, batches=8, loop=1.2)]
    assert _moves(changes) == [("num_workers", 1, 2)]  # fewer batches with 1: back
    for _ in range(20):  # 1 and 3 shown no better: it stays at 2
        assert m.period(t, 0.03, 1.0, 0.1, batches=10, loop=1.2) == []
    m2 = Machine()  # the loop waiting half the time: it wants more workers, never fewer
    t2 = _tuner(m2, workers=3, auto_prefetch=False)
    for _ in range(12):
        m2.period(t2, 0.6, 2.9, 1.0, batches=10, loop=1.2)
    assert t2.changes and min(c.new for c in t2.changes) >= 3


def test_over_the_cpu_budget_workers_are_cut_at_once():
    m = Machine()
    t = _tuner(m, workers=6, budget=0.5, cores=8)  # 4 cores
    assert _moves(m.period(t, wait=0.0, cpu=6.0, idle=1)) == [("num_workers", 6, 4)]
    assert "over the budget of 4.00" in t.changes[-1].why


def test_the_budget_bounds_what_is_added():
    m = Machine()
    t = _tuner(m, workers=2, budget=0.5, cores=8)
    _steady(m, t, 0.9, 2.0, 6, batches=10)
    assert _moves(m.period(t, wait=0.9, cpu=2.0, idle=6, batches=10)) == [("num_workers", 2, 4)]
    _kept(m, t, 0.9, 4.0, 4, batches=20)
    assert m.period(t, wait=0.9, cpu=4.0, idle=4, batches=20) == []  # a fifth would not fit
    assert t.workers == 4


def test_a_calm_loop_loses_a_worker_but_not_below_a_count_that_made_it_wait():
    m = Machine()
    t = _tuner(m, workers=4, auto_prefetch=False)
    assert m.period(t, 0.0, 1.0, 6) == [] and m.period(t, 0.0, 1.0, 6) == []
    assert _moves(m.period(t, 0.0, 1.0, 6)) == [("num_workers", 4, 3)]
    m.period(t, 0.0, 1.0, 6)
    _steady(m, t, 0.2, 3.0, 4)
    assert _moves(m.period(t, 0.2, 3.0, 4)) == [("num_workers", 3, 4)]  # cut too far
    _kept(m, t, 0.0, 1.0, 6, batches=2)
    for _ in range(5):
        assert m.period(t, 0.0, 1.0, 6) == []  # 3 made it wait: it stays at 4


def test_busy_workers_are_kept_though_the_loop_does_not_wait():
    m = Machine()
    t = _tuner(m, workers=4, auto_prefetch=False)
    for _ in range(6):
        assert m.period(t, 0.0, 3.9, 3) == []  # all four needed to keep up


def test_prefetch_goes_back_down_after_ten_calm_periods():
    m = Machine()
    t = _tuner(m, workers=8, most=8, prefetch=4)
    changes = [c for _ in range(11) for c in m.period(t, 0.0, 7.9, 0)]
    assert _moves(changes) == [("prefetch_factor", 4, 3)]


def test_no_step_past_what_shared_memory_holds():
    m = Machine()
    t = _tuner(m, room=lambda workers, prefetch: "the slab pool will not fit")
    for _ in range(autotune.TRIAL_PERIODS + 2):
        assert m.period(t, wait=0.5, cpu=1.0, idle=5) == []


def test_idle_host_cores_past_a_cpu_quota_are_not_idle_for_the_loader():
    """In a container limited to 2 cores' worth of CPU on a larger host, the host's idle cores
    are none of the loader's: with its workers using the quota, no worker is added."""
    m = Machine()
    t = _tuner(m, cores=2, auto_prefetch=False)
    for _ in range(autotune.TRIAL_PERIODS + 3):
        assert m.period(t, wait=0.3, cpu=2.0, idle=14.0) == []
    m2 = Machine()
    t2 = _tuner(m2, cores=8, auto_prefetch=False)
    for _ in range(autotune.TRIAL_PERIODS):
        m2.period(t2, wait=0.3, cpu=2.0, idle=6.0)
    assert "cores idle" in t2.changes[-1].why


def _cgroup_tree(root, v1_quota=None, v2_max=None, path="a/b"):
    """A cgroup file tree as the kernel lays it out (v1 cpu controller, or v2 unified)."""
    if v1_quota is not None:
        d = root / "cpu,cpuacct" / path
        d.mkdir(parents=True)
        (d / "cpu.cfs_quota_us").write_text(f"{v1_quota}\n")
        (d / "cpu.cfs_period_us").write_text("100000\n")
        (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
        (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
        return f"4:cpu,cpuacct:/{path}\n3:memory:/{path}\n"
    d = root / path
    d.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (d / "cpu.max").write_text(f"{v2_max}\n")
    (root / "a" / "cpu.max").write_text("max 100000\n")
    return f"0::/{path}\n"


@pytest.mark.parametrize("layout, quota", [
    ({"v1_quota": 250000}, 2.5), ({"v1_quota": -1}, None),
    ({"v2_max": "150000 100000"}, 1.5), ({"v2_max": "max 100000"}, None),
    ({"v2_max": "garbage"}, None),
])
def test_the_cgroup_cpu_quota_is_read_from_v1_and_v2(tmp_path, layout, quota):
    from fastmm import doctor

    lines = _cgroup_tree(tmp_path / "fs", **layout)
    (tmp_path / "self").write_text(lines)
    assert doctor.cgroup_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "self")) == quota


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def test_a_real_cgroup_quota_caps_the_usable_cores():
    """A child in a cgroup of its own with a CPU quota of 1.5 cores (v1 or v2, where this
    machine lets root make one) counts 2 usable cores, whatever its affinity."""
    import subprocess
    import sys

    if os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):  # v1
        base, name, value = "/sys/fs/cgroup/cpu", "cpu.cfs_quota_us", "150000"
    elif "cpu" in _read("/sys/fs/cgroup/cgroup.subtree_control").split():  # v2
        base, name, value = "/sys/fs/cgroup", "cpu.max", "150000 100000"
    else:
        pytest.skip("no cgroup CPU controller to use here")
    group = os.path.join(base, f"fastmm-test-{os.getpid()}")
    try:
        os.mkdir(group)
        with open(os.path.join(group, name), "w") as f:
            f.write(value)
    except OSError as e:
        if os.path.isdir(group):
            os.rmdir(group)
        pytest.skip(f"cannot make a cgroup with a CPU quota here: {e}")
    try:
        code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                "from fastmm import doctor; print(doctor.cgroup_cpu_quota(), "
                "len(os.sched_getaffinity(0)), doctor.usable_cores())")
        out = subprocess.run([sys.executable, "-c", code, group], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        quota, affinity, usable = out.stdout.split()
        assert float(quota) == 1.5 and int(usable) == min(2, int(affinity))
    finally:
        os.rmdir(group)


def test_idle_time_is_read_by_each_cpus_number(tmp_path):
    """/proc/stat leaves offline CPUs out: CPU 2 is the second line when CPU 1 is offline."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 900 30 0 0 0 0 0\ncpu0 5 0 5 400 10 0 0 0 0 0\n"
                    "cpu2 5 0 5 500 20 0 0 0 0 0\nintr 1 2 3\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert autotune.idle_seconds({2}, str(stat)) == pytest.approx(520 / tick)
    assert autotune.idle_seconds(None, str(stat)) == pytest.approx(930 / tick)
    assert autotune.idle_seconds({1}, str(stat)) == 0
    assert autotune.idle_seconds(None) > 0  # this machine's


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no schedstat kept")
def test_the_workers_time_ready_for_a_core_is_read_apart_from_their_blocked_time():
    """Three processes spinning on one core wait, ready, for it two thirds of the time; three
    sleeping ones (blocked, as on a remote read) hardly at all."""
    import subprocess
    import sys

    def ready_over(code: str) -> float:
        procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
        try:
            read = autotune.read_processes(lambda: [p.pid for p in procs])
            time.sleep(0.5)  # (the interpreters starting)
            before, began = read(), time.monotonic()
            time.sleep(1.0)
            after, took = read(), time.monotonic() - began
            return (after.workers_ready_s - before.workers_ready_s) / took
        finally:
            for p in procs:
                p.kill()
                p.wait()

    spin = "import os, time\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n" \
           "t = time.time()\nwhile time.time() - t < 5: pass"
    assert ready_over(spin) >= 1.0  # of 3 processes' 3 seconds: 2 ready, 1 running
    assert ready_over("import time; time.sleep(5)") < 0.1
    assert autotune.ready_seconds(2**22 + 1) == 0.0  # no such process


def test_the_cap_is_twice_the_cores_or_the_budgets_share_and_memory():
    assert autotune.most_workers(None, cores=16, available=64 * GiB) == 32
    assert autotune.most_workers(0.5, cores=16, available=64 * GiB) == 16
    assert autotune.most_workers(0.01, cores=16, available=64 * GiB) == 1
    assert autotune.most_workers(None, cores=16, available=GiB) == 4  # 256 MiB a worker


def test_arguments_and_variables(monkeypatch):
    monkeypatch.delenv("FASTMM_NUM_WORKERS", raising=False)
    monkeypatch.delenv("FASTMM_CPU_BUDGET", raising=False)
    monkeypatch.setattr(autotune, "usable_cores", lambda: 6)
    data = list(range(10))
    loader = fastmm.DataLoader(data, num_workers="auto", cpu_budget=0.5)
    assert loader.num_workers == 6 and loader.prefetch_factor == 2
    assert loader.autotune == AutoSettings(True, True, 0.5, 6)
    fixed_depth = fastmm.DataLoader(data, num_workers="auto", prefetch_factor=4)
    assert fixed_depth.autotune.prefetch is False and fixed_depth.prefetch_factor == 4
    depth_only = fastmm.DataLoader(data, num_workers=2, prefetch_factor="auto")
    assert depth_only.autotune == AutoSettings(False, True, None, 2)
    assert fastmm.DataLoader(data, num_workers=2).autotune is None
    with pytest.raises(ValueError, match="cpu_budget applies to num_workers='auto'"):
        fastmm.DataLoader(data, num_workers=2, cpu_budget=0.5)
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="fraction of the machine's cores"):
            fastmm.DataLoader(data, num_workers="auto", cpu_budget=bad)
    with pytest.raises(ValueError, match="needs workers"):
        fastmm.DataLoader(data, prefetch_factor="auto")
    with pytest.raises(TypeError, match="num_workers should be an integer"):
        fastmm.DataLoader(data, num_workers="many")
    monkeypatch.setenv("FASTMM_NUM_WORKERS", "auto")
    assert fastmm.DataLoader(data, num_workers=5).autotune.workers  # the variable wins
    monkeypatch.setenv("FASTMM_NUM_WORKERS", "1")
    assert fastmm.DataLoader(data, num_workers="auto").num_workers == 1
    monkeypatch.setenv("FASTMM_CPU_BUDGET", "0.25")
    monkeypatch.setenv("FASTMM_NUM_WORKERS", "auto")
    assert fastmm.DataLoader(data).num_workers == 3
    for name, value in (("FASTMM_NUM_WORKERS", "lots"), ("FASTMM_NUM_WORKERS", "-2"),
                        ("FASTMM_CPU_BUDGET", "2"), ("FASTMM_CPU_BUDGET", "x")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=name):
            fastmm.DataLoader(data)
        monkeypatch.setenv(name, "auto" if name == "FASTMM_NUM_WORKERS" else "0.5")


def test_a_batch_seed_depends_on_the_batch_only():
    seeds = {autotune.batch_seed(7, e, p) for e in range(3) for p in range(100)}
    assert len(seeds) == 300 and all(0 <= s < 2**63 for s in seeds)
    assert autotune.batch_seed(7, 0, 5) == autotune.batch_seed(7, 0, 5)


# -- with real workers -----------------------------------------------------------------------


@pytest.fixture
def four_cores(monkeypatch):
    """num_workers="auto" may start four workers, whatever this machine has."""
    monkeypatch.delenv("FASTMM_NUM_WORKERS", raising=False)
    monkeypatch.delenv("FASTMM_CPU_BUDGET", raising=False)
    monkeypatch.setattr(autotune, "usable_cores", lambda: 2)


def _scripted(monkeypatch, script: list[tuple[int, int]]):
    """The tuner decides at every batch, as ``script`` says: (num_workers, prefetch_factor)
    at each tick, then nothing."""
    monkeypatch.setattr(autotune, "PERIOD_S", 0.0)
    steps = iter(script)

    def decide(self, at, period):
        workers, prefetch = next(steps, (self.workers, self.prefetch))
        changes = []
        if workers != self.workers:
            changes.append(self._set_workers(at, workers, "scripted"))
        if prefetch != self.prefetch:
            changes.append(self._set_prefetch(at, prefetch, "scripted"))
        self._settling = False
        return changes

    monkeypatch.setattr(Tuner, "_decide", decide)


def _auto_loader(dataset_size=60, **kw):
    kw = {"batch_size": 3, "shuffle": True, "num_workers": "auto"} | kw
    return fastmm.DataLoader(Augmented(dataset_size), generator=torch.Generator().manual_seed(5),
                             **kw)


def _epochs(loader, epochs=2) -> list[list]:
    return [[b.tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("in_order", [True, False])
def test_auto_gives_each_sample_once_in_the_samplers_order(four_cores, monkeypatch, in_order):
    _scripted(monkeypatch, [(4, 2), (1, 3), (3, 8), (2, 2)])
    loader = _auto_loader(in_order=in_order)
    ours = [row[0] for b in _epochs(loader, 1)[0] for row in b]
    order = [i for b in torch.utils.data.DataLoader(
        Augmented(60), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
        for i in b[:, 0].tolist()]
    assert (ours if in_order else sorted(ours)) == (order if in_order else list(range(60)))


def test_the_batches_and_draws_do_not_depend_on_what_the_tuner_does(four_cores, monkeypatch):
    _scripted(monkeypatch, [])
    steady = _epochs(_auto_loader(persistent_workers=True), 2)
    _scripted(monkeypatch, [(1, 2), (4, 5), (4, 5), (2, 3), (3, 2), (1, 8)])
    moved = _epochs(_auto_loader(persistent_workers=True), 2)
    assert moved == steady
    assert steady[0] != steady[1]  # each epoch its own draws, with the same workers


@pytest.mark.parametrize("persistent", [False, True])
def test_auto_resumes_mid_epoch_at_another_count(four_cores, monkeypatch, persistent):
    _scripted(monkeypatch, [(2, 2), (4, 3)])
    full = [b for e in _epochs(_auto_loader(persistent_workers=persistent), 2) for b in e]
    for stop in (1, 7, 20, 25):
        _scripted(monkeypatch, [(3, 2)])
        loader = _auto_loader(persistent_workers=persistent)
        head = []
        while len(head) < stop:
            for b in loader:
                head.append(b.tolist())
                if len(head) == stop:
                    break
        state = json.loads(json.dumps(loader.state_dict()))
        monkeypatch.setattr(autotune, "usable_cores", lambda: 1.5)  # another machine
        _scripted(monkeypatch, [(1, 2), (3, 4)])
        again = _auto_loader(persistent_workers=persistent)
        assert again.num_workers == 3
        again.load_state_dict(state)
        tail = []
        while len(head) + len(tail) < len(full):
            tail += [b.tolist() for b in again]
        assert head + tail == full, f"stopped at {stop}"
        monkeypatch.setattr(autotune, "usable_cores", lambda: 2)


def test_each_change_is_in_the_telemetry_and_the_settings_are_said(four_cores, monkeypatch,
                                                                  capsys):
    _scripted(monkeypatch, [(3, 2), (3, 4)])
    tm = Telemetry(trace=True)
    batches = list(tm.watch(_auto_loader()))
    assert len(batches) == 20
    tuned = tm.summary()["tuned"]
    assert (tuned["num_workers"], tuned["prefetch_factor"]) == (3, 4)
    assert [(c["setting"], c["old"], c["new"], c["why"]) for c in tuned["changes"]] == [
        ("num_workers", 2, 3, "scripted"), ("prefetch_factor", 2, 4, "scripted")]
    assert "num_workers 2 -> 3" in tm.table()
    assert any(name == "prefetch_factor 2 -> 4" for name, _, _ in tm._loop_events)
    said = capsys.readouterr().err
    assert "'auto' settled at num_workers=3, prefetch_factor=4" in said
    assert "DataLoader(..., num_workers=3, prefetch_factor=4)" in said


def test_a_killed_worker_is_replaced_with_nothing_changed(four_cores, monkeypatch):
    """on_worker_failure="respawn": the replacement gets its predecessor's batches again,
    with their own seeds, so the batches and draws are those of the run without deaths."""
    def run(kills: set[int]) -> list:
        _scripted(monkeypatch, [(2, 2), (3, 3), (4, 2)])
        it = iter(_auto_loader(dataset_size=200, on_worker_failure="respawn"))
        out, picker = [], random.Random(1)
        for n, batch in enumerate(it):
            out.append(batch.tolist())
            if n in kills:
                started = [w for w in it._workers if w is not None]
                os.kill(started[picker.randrange(len(started))].pid, signal.SIGKILL)
        assert it.fastmm_worker_replacements >= (len(kills) + 1) // 2
        return out

    assert run({3, 9, 20, 41}) == run(set())


class Phased(torch.utils.data.Dataset):
    """Batches slow to make in one phase of five and quick in the next: the loop (slow in the
    quick phase) waits for the worker at times, and the worker for the loop at others."""

    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(0.06 if (i // 5) % 2 == 0 else 0.0)
        return torch.tensor([i])


def test_prefetch_deepens_where_the_worker_and_the_loop_wait_for_each_other_in_turn(
        four_cores):
    """One worker, in order: while it is ahead it has made every batch it was given, and waits
    for the loop; while it is behind, the loop waits for it. A deeper prefetch lets it run on
    while ahead, so "auto" deepens it."""
    loader = fastmm.DataLoader(Phased(), batch_size=1, num_workers=1, prefetch_factor="auto")
    began = time.monotonic()
    for batch in loader:
        time.sleep(0.0 if (int(batch) // 5) % 2 == 0 else 0.06)
        if loader._tuner.prefetch > 2 or time.monotonic() - began > 20:
            break
    assert loader._tuner.prefetch > 2, loader._tuner.changes
    assert "with every batch they were given made" in loader._tuner.changes[0].why


def test_num_workers_set_again_after_the_loader_was_made_is_the_cap(four_cores, monkeypatch):
    _scripted(monkeypatch, [])
    loader = _auto_loader()
    loader.num_workers = 1
    it = iter(loader)
    assert len([b for b in it]) == 20
    assert it._tuning.tuner.workers == it._tuning.tuner.settings.most == 1
