"""Stopping fairseq's prefetch threads before the interpreter exits.

fairseq's ``BackgroundConsumer`` (``fairseq/data/iterators.py``) is a daemon
thread that collates batches ahead of the trainer; one still collating
(torch code) while the interpreter shut down sometimes aborted the process
after a successful run ("terminate called without an active exception").
"""

import atexit
import queue
import threading
import time


def _prefetch_threads():
    from fairseq.data.iterators import BackgroundConsumer

    return [t for t in threading.enumerate() if isinstance(t, BackgroundConsumer) and t.is_alive()]


def stop_prefetch_threads(timeout: float = 10.0) -> None:
    """Make every live fairseq ``BackgroundConsumer`` (the thread that
    prefetches batches) finish: its count limit is set to what it produced,
    so it stops after the item it is putting, and its queue is emptied so
    that the put returns. Waits at most ``timeout`` seconds in all. A daemon
    thread still collating (torch code) while the interpreter shut down
    sometimes aborted the process after a successful run."""
    deadline = time.monotonic() + timeout
    for thread in _prefetch_threads():
        thread._max_len = 0  # read after each put: `count >= max_len` ends its loop
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.05)


def stop_prefetch_threads_at_exit() -> None:
    atexit.unregister(stop_prefetch_threads)  # once per process, whatever number of trainers
    atexit.register(stop_prefetch_threads)
