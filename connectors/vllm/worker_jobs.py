"""A worker's background jobs, by request: what `get_finished` waits for before it names a finished
request in `finished_sending`, and what `handle_preemptions` waits for before vLLM reuses its blocks.

The jobs are a request's store copies and Commits (worker_stores.py) and the Releases of its loads
(worker_loads.py), each run on one of the worker's threads (worker.py). A Release that follows a
copy out of the pool waits first for the copy's CUDA event (`release_after`; None on the CPU, where
the copy has finished when it returns).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvtierd.client import Session
from kvtierd.connectors.daemon_link import DaemonLink
from kvtierd.connectors.vllm.engine_pages import EnginePagesLike
from kvtierd.errors import KvtierError

log = logging.getLogger(__name__)


class RequestJobs:
    """The futures of each request's jobs, and the requests to report once theirs are done. Thread-safe.

    Invariants: `_jobs[r]` holds the futures of request r's jobs not yet reported; `_requests_with_stores`
    are the requests that ever had a StoreSpec (exactly those the scheduler delays), each named once by
    `take_finished`, after vLLM has named it finished and its jobs are done.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the fields below (the load and store threads submit)
        self._jobs: dict[str, list[concurrent.futures.Future]] = {}
        self._requests_with_stores: set[str] = set()
        self._finished_waiting: set[str] = set()

    def expect_stores(self, request_id: str) -> None:
        """The request had a StoreSpec: vLLM keeps its blocks until `take_finished` names it."""
        with self._lock:
            self._requests_with_stores.add(request_id)

    def submit(self, request_id: str, executor: concurrent.futures.Executor, fn: Callable[..., Any],
               *args: Any) -> None:
        future = executor.submit(fn, *args)
        with self._lock:
            self._jobs.setdefault(request_id, []).append(future)

    def futures_of(self, request_ids: set[str]) -> list[concurrent.futures.Future]:
        with self._lock:
            return [f for r in request_ids for f in self._jobs.get(r, ())]

    def take_finished(self, finished_req_ids: set[str]) -> set[str]:
        """The requests with stores that vLLM has named finished (now or before) and whose jobs are done."""
        with self._lock:
            self._finished_waiting |= finished_req_ids & self._requests_with_stores
            for request_id in finished_req_ids - self._requests_with_stores:
                self._jobs.pop(request_id, None)  # load releases only: nobody waits for them
            for request_id, futures in self._jobs.items():
                futures[:] = [f for f in futures if not f.done()]
            done = {r for r in self._finished_waiting if not self._jobs.get(r)}
            for request_id in done:
                self._finished_waiting.discard(request_id)
                self._requests_with_stores.discard(request_id)
                self._jobs.pop(request_id, None)
        return done


def record_event(pages: EnginePagesLike | None) -> torch.cuda.Event | None:
    """A CUDA event after the work queued so far on the current stream (None on CPU)."""
    if pages is None or pages.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def release_after(link: DaemonLink, session: Session, daemon_request_id: str,
                  event: torch.cuda.Event | None) -> None:
    """Release a daemon request once `event` (a copy out of its blocks) has completed; a failure is logged."""
    if event is not None:
        event.synchronize()  # the copy has read the pool blocks
    try:
        session.release(daemon_request_id)
    except KvtierError as error:
        link.failed(session, error)
        log.warning("kvtierd connector: release of %s failed (%s: %s); the daemon reclaims it with "
                    "the session", daemon_request_id, type(error).__name__, error)
