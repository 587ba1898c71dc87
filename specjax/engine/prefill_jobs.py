"""Prefill work as a queue of chunked jobs, shared by the real backend and the simulator.

Admitted requests are grouped into jobs (one prefill batch: the same draft-prefill choice, at
most the largest batch bucket of rows) and each job runs its prompts chunk by chunk
(``buckets.prefill_chunks`` of its longest prompt). ``PrefillQueue.run`` runs chunks first come
first served until a token budget is spent: with no budget a job runs to the end at once
(whole-prompt admission); with one, the serving loop interleaves chunks with the decode steps of
running requests, so that a long arrival delays them by a chunk at a time instead of by its
whole prefill (chunked prefill, as in Sarathi / vLLM).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

from specjax import buckets as bk
from specjax.engine.scheduler import Running


@dataclasses.dataclass
class PrefillJob:
    rs: list[Running]
    run_draft: bool  # also prefill the device draft's cache
    plan: list[tuple[int, int]]  # (start, size) chunks
    next: int = 0  # chunks run so far
    state: Any = None  # the backend's partial state (the real backend: a device StepState)
    nodes: list | None = None  # each row's last chunk in the prefix store (engine.prefix_store)
    started: bool = False  # PrefillQueue.run called ``begin`` for it

    @property
    def done(self) -> bool:
        return self.next >= len(self.plan)


def make_jobs(rs: Sequence[Running], device_draft: bool, max_rows: int, max_chunk: int) -> list[PrefillJob]:
    """Requests admitted with and without the draft prefill go in separate jobs (their states
    differ), each at most ``max_rows`` rows."""
    groups: dict[bool, list[Running]] = {}
    for r in rs:
        groups.setdefault(bool(r.speculate) or not device_draft, []).append(r)
    jobs = []
    for run_draft, grp in groups.items():
        for i in range(0, len(grp), max_rows):
            part = grp[i:i + max_rows]
            plan = bk.prefill_chunks(max(len(r.req.prompt) for r in part), max_chunk)
            jobs.append(PrefillJob(part, run_draft and device_draft, plan))
    return jobs


class PrefillQueue:
    def __init__(self):
        self.jobs: collections.deque[PrefillJob] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def add(self, jobs: Sequence[PrefillJob]) -> None:
        self.jobs.extend(jobs)

    def clear(self) -> None:
        self.jobs.clear()

    def run(self, budget: int | None, run_chunk: Callable[[PrefillJob, int, int], None],
            rows: Callable[[int], int], begin: Callable[[PrefillJob], None] | None = None) -> list[PrefillJob]:
        """Run chunks in order until ``budget`` tokens (padded rows x chunk size, ``rows``: the
        batch bucket of n requests) are spent, at least one chunk (None: every queued chunk).
        ``run_chunk(job, start, size)`` runs one; ``begin(job)``, before a job's first chunk, may
        start it later in its plan (the prefix store: chunks the jobs before it stored). Returns
        the jobs that finished."""
        finished, spent = [], 0
        while self.jobs and (budget is None or spent < budget):
            job = self.jobs[0]
            if not job.started:
                job.started = True
                if begin is not None:
                    begin(job)
            start, size = job.plan[job.next]
            run_chunk(job, start, size)
            job.next += 1
            spent += rows(len(job.rs)) * size
            if job.done:
                finished.append(self.jobs.popleft())
        return finished
