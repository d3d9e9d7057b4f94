"""Work objects and each group's communication thread: collectives that finish after they return.

``Done`` is the Work of a collective that already ran. ``Later`` is one whose last steps run on
the thread that waits for it (point-to-point: ``p2p``). ``Joined`` waits for several.
``Pending`` is the Work of a collective still running on its group's ``CommThread``:
``wait()`` blocks until it finished and raises its error there, and its future completes (or
fails) at the same moment, so C++ waiters such as DDP's reducer block on it too. A group's
thread runs its jobs one at a time in submission order, which is the order every rank issues
them, so the header exchanges and gloo calls stay in step across ranks. A collective that runs
on the caller's thread first waits for the thread to finish what it holds (``drain``).
"""

from __future__ import annotations

import collections
import datetime
import functools
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist


class Done(dist._Work):
    """A Work for a collective that already ran: ``wait()`` returns at once."""

    def __init__(self, result: list) -> None:
        super().__init__()
        self._result = result
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list:
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future


def _result_or_raise(settled: torch.futures.Future) -> list:
    result, error = settled.value()
    if error is not None:
        raise error
    return result


def _wait_all(works: list, result: list, _collected: torch.futures.Future) -> list:
    for w in works:
        w.wait()  # all finished: raises the first failure as it was raised
    return result


class _Outcome(dist._Work):
    """What Pending and Later share: a result, an error once finished, and a future that
    completes or fails with them.

    The future fails the way C++ sees: DDP's reducer reads a finished future's value as its
    tensors, and ``Future.set_exception`` stores the exception as that value (Python alone
    raises it), so the reducer read an exception object as tensors and crashed the process
    when a peer died. A callback that raises fails its future for C++ too (its error then reads
    "Got the following error when running the callback: DistBackendError: ..."). The callback
    holds no reference to the Work: C++ holds it, out of Python's cycle collector's sight."""

    def __init__(self, result: list, op: str) -> None:
        super().__init__()
        self._result = result
        self._op = op
        self._error: BaseException | None = None
        self._settled = torch.futures.Future()
        self._future = self._settled.then(_result_or_raise)

    def _complete_future(self) -> None:
        """Complete the future with the outcome; once the Work reads as finished (its error
        set), and holding no lock: callbacks run here, and may wait for this Work (Joined's)."""
        self._settled.set_result((self._result, self._error))

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future


class Pending(_Outcome):
    """A Work for a collective its group's communication thread has yet to finish."""

    def __init__(self, result: list, op: str) -> None:
        super().__init__(result, op)
        self._done = threading.Event()

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        self._complete_future()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # c10d passes timedelta(0) for "no timeout": the group's own timeout bounds the transfer.
        seconds = timeout.total_seconds() if timeout else 0
        if not self._done.wait(seconds or None):
            raise dist.DistBackendError(
                f"torchtpu.distributed: tpu_dist: {self._op} did not finish within "
                f"wait(timeout={seconds:g} s)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class Later(_Outcome):
    """A Work whose remaining steps, ``finish()`` (returning the peer rank), run once, on the
    first thread to wait for it or to find its gloo works (``deps``) completed."""

    def __init__(self, op: str, finish: Callable[[], int], result: list, deps: list) -> None:
        super().__init__(result, op)
        self._finish = finish
        self._deps = deps
        self._lock = threading.Lock()
        self._ran = False
        self._source = -1

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        finished_here = False
        with self._lock:
            if not self._ran:
                self._ran = finished_here = True
                try:
                    self._source = self._finish()
                except BaseException as e:  # noqa: BLE001 (raised below, and by every wait)
                    self._error = e
        if finished_here:
            self._complete_future()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._ran and all(w.is_completed() for w in self._deps):
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 (completed, with an error wait() raises)
                pass
        return self._ran

    def _source_rank(self) -> int:
        """The peer rank (for recv from any source: the sender), once waited for."""
        self.wait()
        return self._source


class Joined(dist._Work):
    """One Work for several: done when every one is; waiting raises the first failure."""

    def __init__(self, works: list[dist.Work], result: list) -> None:
        super().__init__()
        self._works = works
        self._result = result
        self._future = torch.futures.collect_all([w.get_future() for w in works]).then(
            functools.partial(_wait_all, works, result))

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future


class CommThread:
    """One group's jobs, run in submission order on a thread started at the first job."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.thread: threading.Thread | None = None

    def submit(self, run: Callable[[], None], work: Pending) -> None:
        with self._cond:
            if self._closed:
                raise dist.DistBackendError(
                    f"torchtpu.distributed: tpu_dist: process group {self._name!r} was shut down")
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, daemon=True,
                                               name=f"tpu_dist comm {self._name}")
                self.thread.start()
            self._jobs.append((run, work))
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every submitted job has finished (at once when there are none)."""
        if self.thread is None or threading.current_thread() is self.thread:
            return
        with self._cond:
            while self._jobs or self._busy:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                run, work = self._jobs.popleft()
                self._busy = True
            try:
                run()
                error = None
            except BaseException as e:  # noqa: BLE001 (raised where the Work is waited for)
                error = e
            work.finish(error)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
