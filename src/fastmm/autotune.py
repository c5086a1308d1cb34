"""``num_workers="auto"``, ``prefetch_factor="auto"`` and ``cpu_budget=`` (issue 55): a loader
that sets its own worker count and prefetch depth while it runs, from what it measures each
period: the share of the time the loop waited for batches, the CPU its workers used, the idle
cores it may use, and the loop's rate against the rate before a change (docs/loader.md, "A loader
that tunes itself").

The loader may start up to ``most`` workers (``most_workers``); it starts the first ``workers``
of them and hands them batches, and starts more when the tuner calls for them. Those it stops
handing batches to wait idle, using no CPU. With "auto", each batch's random draws are seeded
from the epoch's base seed and the batch's place in the epoch (``batch_seed``), not from the
worker that makes it: a change of count changes no draw, and a state resumes at any count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import sys
import time
from typing import Callable, NamedTuple

from .config import ConfigError
from .doctor import usable_cores

log = logging.getLogger("fastmm")

AUTO = "auto"
PERIOD_S = 1.0  # one adjustment period
WAITING = 0.05  # the loop waited this share of a period or more: it wants more workers
NOT_WAITING = 0.01  # it waited less: maybe fewer do
IDLE_WORKERS = 0.10  # the workers waited this share of their time with every batch given made
# (transport at 2 workers, prefetch 2: 12-15% while the loop waited 10-15%; prefetch 4: 7% and 3%)
BLOCKED = 0.25  # with no core idle, one more worker is tried where they were blocked this much
CALM_PERIODS = 3  # periods without waiting before a worker is taken away
TRIAL_PERIODS = 3  # a trial of another count runs this many periods at least (after one settling)
TRIAL_MOST_PERIODS = 8  # and on, up to this many, while its gain is within its noise
BEFORE_PERIODS = 5  # judged against the rates of this many periods before it, at most
TRIAL_GAIN = 0.03  # more workers kept where they made this much more batches a second, fewer
# where they made less than this much fewer
RETRY_S = 60.0  # a count whose trial made nothing more is not tried again for this long
STEP_CORES = 0.5  # the loop's own process used this many cores: its step competes with workers
FIRST_PREFETCH = 2  # torch's default
MOST_PREFETCH = 8
WORKER_MEMORY = 256 * 2**20  # available memory a worker is counted to need, for the cap


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    """What "auto" was asked for: the count (``workers``), the depth (``prefetch``), or both,
    within ``cpu_budget`` (a fraction of the usable cores, or None) and ``most`` workers."""

    workers: bool
    prefetch: bool
    cpu_budget: float | None
    most: int


def most_workers(cpu_budget: float | None, cores: int | None = None,
                 available: int | None = None) -> int:
    """The cap: twice the cores the workers may use (this process's, or the budget's share of
    them; a worker waiting on storage leaves its core idle, and the tuner adds workers only
    while cores are idle), at least one, and no more than the available memory holds at
    ``WORKER_MEMORY`` each."""
    cores = usable_cores() if cores is None else cores
    share = 1.0 if cpu_budget is None else cpu_budget
    by_cpu = max(1, math.floor(2 * share * cores + 1e-9))
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return max(1, min(by_cpu, available // WORKER_MEMORY))


FRACTION = "a fraction of the machine's cores above 0 and at most 1 (0.5: half of them)"


def _fraction(value) -> bool:
    """Whether ``value`` is a CPU budget: a number above 0 and at most 1."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1


def _budget(value, name: str) -> float | None:
    if value is None:
        return None
    if not _fraction(value):
        raise ValueError(f"{name} should be {FRACTION}, but got {name}={value!r}")
    return float(value)


def _from_env() -> tuple[object, object]:
    """FASTMM_NUM_WORKERS ("auto" or a whole number) and FASTMM_CPU_BUDGET, raw or None."""
    raw = os.environ.get("FASTMM_NUM_WORKERS", "").strip()
    workers = None
    if raw:
        if raw.lower() == AUTO:
            workers = AUTO
        else:
            try:
                workers = int(raw)
            except ValueError:
                workers = -1
            if workers < 0:
                raise ConfigError(f"FASTMM_NUM_WORKERS={raw!r}: use 'auto' or a whole number "
                                  "of workers (0: none)")
    budget = os.environ.get("FASTMM_CPU_BUDGET", "").strip()
    if not budget:
        return workers, None
    try:
        value = float(budget)
    except ValueError:
        value = None
    if not _fraction(value):
        raise ConfigError(f"FASTMM_CPU_BUDGET={budget!r}: use {FRACTION}")
    return workers, value


def settings(num_workers, prefetch_factor,
             cpu_budget) -> tuple[object, object, AutoSettings | None]:
    """The loader's arguments with the environment applied (FASTMM_NUM_WORKERS overrides
    ``num_workers``; FASTMM_CPU_BUDGET gives ``cpu_budget`` where it was not), "auto" replaced:
    torch's ``num_workers`` and ``prefetch_factor`` (the cap, and the depth to start at), and
    what the tuner may do (None: nothing is tuned)."""
    env_workers, env_budget = _from_env()
    if env_workers is not None:
        num_workers = env_workers
    budget = _budget(cpu_budget, "cpu_budget")
    if budget is None:
        budget = env_budget
    auto_workers = isinstance(num_workers, str) and num_workers == AUTO
    auto_prefetch = isinstance(prefetch_factor, str) and prefetch_factor == AUTO
    if not auto_workers and budget is not None and cpu_budget is not None:
        raise ValueError("cpu_budget applies to num_workers='auto' (the workers it may run); "
                         f"with num_workers={num_workers!r} set the count instead")
    if not auto_workers and not auto_prefetch:
        return num_workers, prefetch_factor, None
    if auto_prefetch and not auto_workers and num_workers == 0:
        raise ValueError("prefetch_factor='auto' needs workers: num_workers='auto' or above 0")
    most = most_workers(budget) if auto_workers else num_workers
    auto_prefetch = auto_prefetch or (auto_workers and prefetch_factor is None)
    return (most, FIRST_PREFETCH if auto_prefetch else prefetch_factor,
            AutoSettings(auto_workers, auto_prefetch, budget if auto_workers else None, most))


def first_workers(settings: AutoSettings) -> int:
    """How many workers "auto" starts with: two, or fewer where the cap or the budget's cores
    say so (it adds more within the first seconds while the loop waits)."""
    first = min(settings.most, 2)
    if settings.cpu_budget is not None:
        first = min(first, max(1, math.floor(settings.cpu_budget * usable_cores() + 1e-9)))
    return first


def batch_seed(base_seed: int, epoch: int, position: int) -> int:
    """The seed of one batch's random draws with "auto": the same whichever worker makes it."""
    digest = hashlib.blake2b(f"{base_seed}:{epoch}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # (torch.manual_seed takes below 2**63)


class Change(NamedTuple):
    """One change the tuner made: ``at_s`` seconds after the loader's first batch was asked
    for, ``setting`` ("num_workers" or "prefetch_factor") from ``old`` to ``new``, and why."""

    at_s: float
    setting: str
    old: int
    new: int
    why: str


class Trial(NamedTuple):
    """Another worker count tried: more kept where they make the loop faster (idle cores may
    be the step's own, between its parallel parts: more workers there slow it); fewer kept
    where the loop is not TRIAL_GAIN slower (the cores they free go to a CPU-heavy step)."""

    back_to: int  # the count before it
    before: list  # batches a second in each of the last periods before it
    rates: list  # batches a second in each period of the trial
    fewer: bool  # a trial of fewer workers


def gain_and_noise(before: list, after: list) -> tuple[float, float]:
    """How much faster ``after``'s periods ran than ``before``'s (their mean rates, as a
    fraction of before's), and the standard error of that fraction from the periods' spread
    (pooled over both; 0 with fewer than three periods in all). A period's rate varies with
    the batches in it and with the machine: a trial is judged only beyond that."""
    mean_b, mean_a = sum(before) / len(before), sum(after) / len(after)
    if mean_b <= 0:
        return math.inf, 0.0
    dof = len(before) + len(after) - 2
    if dof < 1:
        return mean_a / mean_b - 1, 0.0
    spread = (sum((r - mean_b) ** 2 for r in before) + sum((r - mean_a) ** 2 for r in after))
    error = math.sqrt(spread / dof * (1 / len(before) + 1 / len(after)))
    return mean_a / mean_b - 1, error / mean_b


class Reading(NamedTuple):
    """Counters read at one moment (cumulative seconds): the workers' CPU time, summed; the
    idle time of the cores this process may run on, summed; the CPU time of the loader's
    processes (the workers and this one), summed; the time the workers waited for a task with
    every batch they were given made, summed; the time they waited, ready, for a core, summed."""

    workers_cpu_s: float
    idle_cpu_s: float
    own_cpu_s: float
    tasks_waited_s: float = 0.0
    workers_ready_s: float = 0.0


class Period(NamedTuple):
    """What one period measured, for the tuner's decision.

    wait: the share of the period the loop waited for batches.
    cpu: the cores the workers used.
    idle: the cores the machine left idle (of those the loader may use).
    idle_workers: the share of the workers' time they waited for a task with every batch they
        were given made (the loop had not taken them yet).
    blocked: the share of the workers' time they were neither running, nor ready to run and
        waiting for a core, nor waiting for a task: blocked (storage, a lock, a remote read).
    rate: batches handed out a second.
    loop_cpu: the cores the loop's own process used (its step, its reading)."""

    wait: float
    cpu: float
    idle: float
    idle_workers: float
    blocked: float
    rate: float
    loop_cpu: float


def read_processes(pids: Callable[[], list]) -> Callable[[], Reading]:
    """A reader of the workers' CPU time and their time ready for a core (``pids()``: the
    started workers' pids; ``ready_seconds``), of the idle time of this process's cores (its
    affinity: ``idle_seconds``), and of this process's CPU time, from /proc (the processes'
    through psutil)."""
    import psutil

    try:
        mine = set(os.sched_getaffinity(0))
    except AttributeError:
        mine = None
    me = psutil.Process()

    def read() -> Reading:
        used = ready = 0.0
        for pid in pids():
            try:
                times = psutil.Process(pid).cpu_times()
                used += times.user + times.system
            except (psutil.Error, OSError):
                pass  # gone: its replacement counts from its own start
            ready += ready_seconds(pid)
        times = me.cpu_times()
        return Reading(used, idle_seconds(mine), used + times.user + times.system,
                       workers_ready_s=ready)

    return read


def ready_seconds(pid: int) -> float:
    """The seconds process ``pid`` has waited, ready to run, for a core (the second field of
    /proc/PID/schedstat); 0 where the kernel keeps no such count or the process is gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def idle_seconds(cpus: set | None, stat: str = "/proc/stat") -> float:
    """The idle and I/O-wait seconds of the CPUs numbered ``cpus`` (all where None), summed,
    from ``stat``, whose lines name their CPU (psutil's per-CPU list leaves offline CPUs out,
    so a place in it is not a CPU's number)."""
    try:
        with open(stat) as f:
            lines = f.read().splitlines()
    except OSError:  # (not Linux)
        import psutil

        times = psutil.cpu_times()
        return times.idle + getattr(times, "iowait", 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    idle = 0
    for line in lines:
        name, *fields = line.split()
        if (name[:3] == "cpu" and name[3:].isdigit() and len(fields) >= 5
                and (cpus is None or int(name[3:]) in cpus)):
            idle += int(fields[3]) + int(fields[4])  # idle, iowait
    return idle / tick


class Tuner:
    """Decides, once a period, how many of the started workers get batches and how deep they
    prefetch (``workers``, ``prefetch``), from the loop's waiting (``waited``) and ``read()``.

    More workers while the loop waits for data and cores are idle (twice as many while it
    waits most of the time), or one more while it waits with no core idle where the workers
    were ``BLOCKED`` (neither running, nor ready for a core, nor waiting for a task): on
    trial either way, kept only if the loop gets ``TRIAL_GAIN`` more batches a second, beyond
    the noise of its rates; one fewer on trial while the loop's own process uses ``STEP_CORES`` or
    more (its step competes with the workers), kept unless the loop loses ``TRIAL_GAIN``;
    fewer once it has not waited for ``CALM_PERIODS`` periods and one fewer carries the load
    (their CPU fits in one fewer), never below a count at which it waited after such a cut;
    fewer at once when the workers used more than ``cpu_budget``; a deeper prefetch while
    the loop waits though the workers spent a tenth of their time or more with every batch
    they were given made (batch times vary: the workers wait for the loop at times, and it
    for them at others), one less after ten periods without waiting.

    Args:
        settings: what "auto" was asked for.
        workers: the count to start at.
        prefetch: the depth to start at.
        read: the counters (``Reading``) of the workers attached (or ``attach`` later).
        room: ``room(workers, prefetch)``: why a larger setting would not fit (shared
            memory), or None.
        cores: the cores this process may use (the budget's base).
        clock: seconds, monotonic.
    """

    def __init__(self, settings: AutoSettings, workers: int, prefetch: int,
                 read: Callable[[], Reading] | None = None,
                 room: Callable[[int, int], str | None] | None = None, cores: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings, self.workers, self.prefetch = settings, workers, prefetch
        self._clock = clock
        self._cores = usable_cores() if cores is None else cores
        self.changes: list[Change] = []  # over the loader's life
        self._start = clock()
        self._calm = 0  # periods in a row the loop did not wait
        self._cut_to = None  # the count the last cut (the loop not waiting) went down to
        self._floor = 1  # no cut below this count (one made the loop wait)
        self._settling = False  # the period after a change: the pipeline refills, not judged
        # batches a second in the periods at the current settings (since the last change, and
        # before a trial taken back)
        self._rates: list[float] = []
        self._trial: Trial | None = None
        self._tried: dict[int, float] = {}  # count -> when its trial made nothing more
        self.epoch_changes = 0
        self._said = False
        self._read = self._room = None
        if read is not None:
            self.attach(read, room or (lambda workers, prefetch: None))

    def attach(self, read: Callable[[], Reading],
               room: Callable[[int, int], str | None]) -> None:
        """Measure a new iterator's workers (the loader keeps its tuner from one to the next:
        a new epoch starts where the last one settled). Its first period, with the workers
        starting, is not judged: a rate from it would flatter the next count tried."""
        self._settling = True
        self._read, self._room = read, room
        self._begin_period()

    def detach(self) -> None:
        """Its iterator's workers are gone: measure nothing until the next one attaches."""
        self._read = lambda: Reading(0.0, 0.0, 0.0)
        self._room = lambda workers, prefetch: None

    def _begin_period(self) -> None:
        self._period_start, self._last = self._clock(), self._read()
        self._waited = 0.0
        self._batches = 0

    def waited(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a batch."""
        self._waited += seconds

    def tick(self) -> list[Change]:
        """A batch was handed out. Once a period has passed, the changes it calls for
        (applied to ``workers`` and ``prefetch`` already), else []."""
        self._batches += 1
        now = self._clock()
        elapsed = now - self._period_start
        if elapsed < PERIOD_S:
            return []
        reading = self._read()
        wait = self._waited / elapsed
        worker_s = elapsed * max(1, self.workers)  # (those parked neither run nor wait)
        # the share of the workers' time spent waiting for a task, every batch given made
        idle_workers = min(1.0, max(0.0, reading.tasks_waited_s - self._last.tasks_waited_s)
                           / worker_s)
        cpu = max(0.0, reading.workers_cpu_s - self._last.workers_cpu_s) / elapsed
        # the shares of the workers' time running, ready for a core, and (the rest) blocked
        running = cpu * elapsed / worker_s
        ready = max(0.0, reading.workers_ready_s - self._last.workers_ready_s) / worker_s
        blocked = max(0.0, 1.0 - running - ready - idle_workers)
        own = max(0.0, reading.own_cpu_s - self._last.own_cpu_s) / elapsed
        # idle cores this loader may use: a CPU quota (usable_cores) leaves host cores idle
        idle = min(max(0.0, reading.idle_cpu_s - self._last.idle_cpu_s) / elapsed,
                   max(0.0, self._cores - own))
        rate = self._batches / elapsed
        self._begin_period()
        if self._settling:
            self._settling = False
            return []
        if self._trial is None:
            self._rates.append(rate)
        changes = self._decide(now - self._start, Period(
            wait, cpu, idle, idle_workers, blocked, rate, max(0.0, own - cpu)))
        self._settling = bool(changes)
        self.changes.extend(changes)
        self.epoch_changes += len(changes)
        return changes

    def _decide(self, at: float, period: Period) -> list[Change]:
        """The changes one ``period`` calls for, ``at`` seconds since the tuner began."""
        wait, cpu, idle, idle_workers, blocked, rate, loop_cpu = period
        s, n = self.settings, self.workers
        per_worker = cpu / n if n else 0.0
        budget = None if s.cpu_budget is None else s.cpu_budget * self._cores
        said = f"the loop waited {wait:.0%} of the last period; the workers used {cpu:.2f} cores"
        if s.workers and budget is not None and cpu > budget and n > 1:
            over = math.ceil((cpu - budget) / max(per_worker, 1e-9))
            self._trial = None
            return [self._set_workers(at, max(1, n - max(1, over)),
                                      f"{said}, over the budget of {budget:.2f}")]
        if self._trial is not None:
            return self._judge_trial(at, rate)
        # a trial (fewer or more) is judged against the periods before it: TRIAL_PERIODS at least
        judged = len(self._rates) >= TRIAL_PERIODS
        if (s.workers and n > max(1, self._floor) and wait < 0.5 and loop_cpu >= STEP_CORES
                and judged and self._may_try(at, n - 1)):
            return [self._try_workers(at, n - 1, f"{said}; the loop's own process used "
                                                 f"{loop_cpu:.2f} cores", fewer=True)]
        if wait >= WAITING:
            self._calm = 0
            if self._cut_to == n:
                self._floor = n + 1  # the cut to n made it wait: no cut to n again
            fits = budget is None or cpu + per_worker <= budget
            if s.workers and n < s.most and idle >= 0.5 and fits and judged:
                more = n if wait >= 0.5 else 1
                if budget is not None and per_worker > 0:
                    more = min(more, max(1, math.floor((budget - cpu) / per_worker)))
                new = min(s.most, n + more)
                if self._may_try(at, new):
                    return [self._try_workers(at, new, f"{said}; {idle:.2f} cores idle")]
            if idle_workers >= IDLE_WORKERS:  # more depth, not more workers, for these
                if (s.prefetch and self.prefetch < MOST_PREFETCH
                        and self._room(n, self.prefetch + 1) is None):
                    return [self._set_prefetch(
                        at, self.prefetch + 1, f"{said}, though they spent {idle_workers:.0%} "
                        "of their time with every batch they were given made (batch times "
                        "vary)")]
            elif (s.workers and n < s.most and fits and idle < 0.5 and blocked >= BLOCKED
                  and judged and self._may_try(at, n + 1)):
                return [self._try_workers(at, n + 1, f"{said}; no core idle, the workers "
                                                     f"blocked {blocked:.0%} of their time")]
            return []
        if wait < NOT_WAITING:
            self._calm += 1
            if (s.workers and self._calm >= CALM_PERIODS and n > self._floor
                    and cpu <= 0.9 * (n - 1)):
                self._calm = 0
                self._cut_to = n - 1
                return [self._set_workers(at, n - 1, f"the loop did not wait for "
                                          f"{CALM_PERIODS} periods; the workers used "
                                          f"{cpu:.2f} cores, which {n - 1} carry")]
            if s.prefetch and self._calm >= 10 and self.prefetch > FIRST_PREFETCH:
                self._calm = 0
                return [self._set_prefetch(at, self.prefetch - 1,
                                           "the loop did not wait for 10 periods")]
        return []

    def _may_try(self, at: float, workers: int) -> bool:
        """Whether ``workers`` may be tried: not within RETRY_S of a trial that showed it no
        better, and the slab pool would fit in shared memory."""
        return (at - self._tried.get(workers, -math.inf) >= RETRY_S
                and self._room(workers, self.prefetch) is None)

    def _try_workers(self, at: float, new: int, why: str, fewer: bool = False) -> Change:
        """Another count on trial (``_judge_trial``) against the loop's rates before it (its
        last BEFORE_PERIODS periods).

        Args:
            at: seconds since the tuner began.
            new: the count tried.
            why: what called for it, for the change's record.
            fewer: a trial of fewer workers (else more).
        """
        self._trial = Trial(self.workers, self._rates[-BEFORE_PERIODS:], [], fewer)
        return self._set_workers(at, new, f"{why}: {new} tried, kept " + (
            f"unless the loop gets {TRIAL_GAIN:.0%} fewer batches" if fewer else
            f"if the loop gets {TRIAL_GAIN:.0%} more batches"))

    def _judge_trial(self, at: float, rate: float) -> list[Change]:
        """One period of a trial, judged by its gain over the rates before it and that gain's
        standard error (``gain_and_noise``) after TRIAL_PERIODS. More workers are kept where
        the gain is TRIAL_GAIN and a standard error more, taken back where it is under
        TRIAL_GAIN, and run on, to TRIAL_MOST_PERIODS, in between (then taken back). Fewer
        are kept where the loop lost under TRIAL_GAIN of its batches, taken back where it
        lost that and a standard error more, and run on in between (then taken back): the
        same margin both ways, so that a worker saved never costs the loop more than it
        would take to add one. The count shown no better is not tried again for RETRY_S."""
        trial = self._trial
        trial.rates.append(rate)
        gain, noise = gain_and_noise(trial.before, trial.rates)
        if trial.fewer:
            unsure, kept = -TRIAL_GAIN - noise <= gain < -TRIAL_GAIN, gain >= -TRIAL_GAIN
        else:
            unsure, kept = TRIAL_GAIN <= gain < TRIAL_GAIN + noise, gain >= TRIAL_GAIN + noise
        if len(trial.rates) < TRIAL_PERIODS or (unsure and
                                                 len(trial.rates) < TRIAL_MOST_PERIODS):
            return []
        self._trial = None
        self._tried[trial.back_to if kept else self.workers] = at
        if kept:
            self._rates = list(trial.rates)
            return []
        mean = sum(trial.rates) / len(trial.rates)
        change = self._set_workers(at, trial.back_to, f"{self.workers} workers made {mean:.1f} "
                                   f"batches a second over {len(trial.rates)} periods, "
                                   f"{gain:+.0%} (+/- {noise:.0%}) against {trial.back_to}")
        # back where the rates before the trial were read: they count for the next one
        self._rates = list(trial.before)
        return [change]

    def _set_workers(self, at: float, new: int, why: str) -> Change:
        change = Change(round(at, 3), "num_workers", self.workers, new, why)
        self.workers, self._rates = new, []  # rates read at the old count judge nothing now
        return change

    def _set_prefetch(self, at: float, new: int, why: str) -> Change:
        change = Change(round(at, 3), "prefetch_factor", self.prefetch, new, why)
        self.prefetch, self._rates = new, []
        return change

    def settled(self) -> str:
        """The line said at an epoch's end: where it settled, to pin."""
        pin = []
        if self.settings.workers:
            pin.append(f"num_workers={self.workers}")
        if self.settings.prefetch:
            pin.append(f"prefetch_factor={self.prefetch}")
        return (f"fastmm: 'auto' settled at {', '.join(pin)} after {len(self.changes)} "
                f"change(s) ({self.epoch_changes} this epoch); pin them with "
                f"DataLoader(..., {', '.join(pin)})")

    def say_settled(self) -> None:
        """At an epoch's end: said after the first epoch, then after each that changed them."""
        if self.epoch_changes or not self._said:
            print(self.settled(), file=sys.stderr, flush=True)
        self._said, self.epoch_changes = True, 0


class Tuning:
    """A multi-process iterator's side of "auto": the loader's tuner measuring this iterator's
    workers, each task's seed, the time the loop waits, and the tuner's changes applied to the
    tasks (``table``) and the slab pool. Only as many workers start as the tuner says (two at
    first); the iterator starts more when ``retune`` says so. An IterableDataset's workers each
    read their own part of the stream: all of them start and get tasks.

    Args:
        loader: the loader (it keeps the tuner from one iterator to the next).
        iterable: whether the dataset is an IterableDataset.
        receiver: the iterator's Receiver: its task table, slab pool and worker processes
            (their pids are measured), and ``room`` (would a larger setting fit in shared
            memory).
    """

    def __init__(self, loader, iterable: bool, receiver):
        table, workers = receiver.table, receiver.workers
        # (num_workers set again after the loader was made: no more than it says)
        settings = dataclasses.replace(loader.autotune,
                                       most=min(loader.autotune.most, table.num_workers))
        if iterable:
            settings = dataclasses.replace(settings, workers=False)
        tuner = loader._tuner
        if tuner is None or tuner.settings != settings:
            tuner = loader._tuner = Tuner(
                settings, first_workers(settings) if settings.workers else table.num_workers,
                loader.prefetch_factor)
        # (not the iterator: the loader keeps the tuner, and must not keep the iterator)
        processes = read_processes(lambda: [p.pid for p in workers.started()])
        tuner.attach(lambda: processes()._replace(tasks_waited_s=receiver.tasks_waited_s),
                     receiver.room)
        self.tuner, self.seeded = tuner, settings.workers
        self._table, self._slab_pool = table, receiver.slab_pool
        self.changes: list[tuple[int, Change]] = []  # (time.monotonic_ns(), change), telemetry's
        self._apply()

    def seed(self, base_seed: int, epoch: int, position: int) -> int | None:
        """A task's seed: its batch's own where the worker count changes, else None."""
        return batch_seed(base_seed, epoch, position) if self.seeded else None

    def timed_wait(self, wait, *args):
        """``wait(*args)`` (the loop waiting for a batch), its time told to the tuner."""
        began = time.perf_counter()
        event = wait(*args)
        self.tuner.waited(time.perf_counter() - began)
        return event

    def retune(self) -> bool:
        """A batch was handed out: apply what the tuner decided this period, if anything;
        whether it changed."""
        changes = self.tuner.tick()
        if not changes:
            return False
        now = time.monotonic_ns()
        self.changes += [(now, change) for change in changes]
        for change in changes:
            log.info("fastmm: %s %d -> %d: %s", change.setting, change.old, change.new,
                     change.why)
        self._apply()
        return True

    def _apply(self) -> None:
        self._table.set_shape(self.tuner.workers, self.tuner.prefetch)
        self._slab_pool.keep_free(self.tuner.workers * (self.tuner.prefetch + 1))
