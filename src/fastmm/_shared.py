"""Tables in shared memory that every process of a loader writes a row of: the main process's
row first, then one per worker (worker ids beyond ``rows - 1`` share rows), so no write needs
a lock."""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.sharedctypes

import torch.utils.data


def row_of(worker_id: int | None, rows: int) -> int:
    """The row of the main process (``worker_id`` None) or of a worker."""
    return 0 if worker_id is None else 1 + worker_id % (rows - 1)


def this_worker() -> int | None:
    """This process's worker id, None in the main process."""
    info = torch.utils.data.get_worker_info()
    return None if info is None else info.id


class SharedArray:
    """An array in shared memory that worker processes inherit as they start (fork or spawn);
    pickled at any other time, the copy gets a fresh array of its own."""

    def __init__(self, typecode: str, size: int):
        self._spec = (typecode, size)
        self._array = multiprocessing.sharedctypes.RawArray(typecode, size)

    def __getstate__(self):
        state = dict(self.__dict__)
        if multiprocessing.context.get_spawning_popen() is None:
            state["_array"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self._array is None:
            self._array = multiprocessing.sharedctypes.RawArray(*self._spec)
