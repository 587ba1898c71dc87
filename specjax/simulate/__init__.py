"""Event-clock simulation of the serving engine (seed 000 §7.2): the real scheduler, selector
and bookkeeping (``engine.loop.ServingEngine``) over a backend whose forward passes take the
time a performance model says and whose drafts are accepted at measured per-position rates."""

from specjax.simulate.backend import AcceptanceProfile, SimBackend, simulate

__all__ = ["AcceptanceProfile", "SimBackend", "simulate"]
