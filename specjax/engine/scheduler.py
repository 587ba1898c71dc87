"""Requests, the FCFS admission queue and KV-row accounting (host only; shared by the real
engine and the simulator).

KV capacity is ``num_rows`` cache rows of ``slots`` entries each. A request is admitted only
when a row is free (HasSlot of Algorithm 2) and *reserves its whole row* for its life: the
row holds prompt + max_new_tokens + the largest verify block, so a running request can never
run out of cache and nothing is ever preempted or truncated. A request that could not fit
even an empty row is rejected with a clear error at submission; capacity pressure only
queues work.
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable

from specjax.errors import SpecjaxError
from specjax.serving_types import Request, RequestOutput, Running  # noqa: F401  (re-exported: the engine's names)


class Scheduler:
    def __init__(self, num_rows: int, slots: int, block_headroom: int):
        if num_rows < 1:
            raise SpecjaxError(f"the engine needs at least one KV row, got {num_rows}")
        self.num_rows = num_rows
        self.slots = slots
        self.block_headroom = block_headroom  # K_max + 1: the verify block written past the length
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Running] = []  # FCFS order
        self._uids = itertools.count()

    def row_need(self, req: Request) -> int:
        return len(req.prompt) + req.max_new_tokens + self.block_headroom

    def check(self, req: Request) -> None:
        """Raise SpecjaxError if ``req`` can never be served by this engine."""
        if len(req.prompt) == 0:
            raise SpecjaxError(f"request {req.id}: empty prompt")
        if req.max_new_tokens < 1:
            raise SpecjaxError(f"request {req.id}: max_new_tokens must be >= 1, got {req.max_new_tokens}")
        need = self.row_need(req)
        if need > self.slots:
            raise SpecjaxError(f"request {req.id}: prompt ({len(req.prompt)} tokens) + max_new_tokens "
                               f"({req.max_new_tokens}) + verify headroom ({self.block_headroom}) = {need} exceeds the "
                               f"engine's {self.slots} KV slots per request; raise the engine's slots (--slots) or lower max_new_tokens")

    def submit(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    @property
    def free_rows(self) -> int:
        return self.num_rows - len(self.running)

    def admit(self, now: float, speculate: bool = True, max_new: int | None = None,
              joins: Callable[[Request], bool] | None = None) -> list[Running]:
        """Start the FCFS prefix of the waiting queue that fits the free rows (at most
        ``max_new``; with ``joins``, only while the queue's head may join the running batch);
        each takes its row at once."""
        n = min(self.free_rows, len(self.waiting))
        if max_new is not None:
            n = min(n, max_new)
        out = []
        while len(out) < n and (joins is None or joins(self.waiting[0])):
            out.append(self.start(self.waiting.popleft(), speculate, now))
        return out

    def start(self, req: Request, speculate: bool, now: float) -> Running:
        out = RequestOutput(req.id, [], "length", len(req.prompt), req.arrival, admitted=now)
        r = Running(next(self._uids), req, speculate, out, ctx_len=len(req.prompt))
        self.running.append(r)
        return r

    def release(self, r: Running) -> None:
        self.running.remove(r)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
