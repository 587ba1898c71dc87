"""The engine drafter of a backend's or generator's keyword arguments."""

from __future__ import annotations

from specjax.drafters.base import NoDrafter
from specjax.drafters.device import DeviceDrafter
from specjax.drafters.host import host_drafter
from specjax.drafters.protocol import Drafter
from specjax.errors import require


def as_drafter(drafter=None, draft=None, draft_params=None) -> Drafter:
    """``drafter``: a protocol Drafter as it is, or a host drafter (start / extend / propose /
    finish, base.HostDrafter) to wrap; ``draft`` + ``draft_params``: a device draft model;
    neither: no drafts (K = 0 every step)."""
    if draft is not None:
        require(drafter is None, "give either a host drafter or a device draft model, not both")
        return DeviceDrafter(draft, draft_params)
    if isinstance(drafter, Drafter):
        return drafter
    return host_drafter(drafter if drafter is not None else NoDrafter())
