"""Routing policies for kvgate.

A policy sees requests and workers only as plain data (``RequestView``, ``WorkerView``)
and answers with a ``Choice`` (or ``Hold``: not yet); it never touches HTTP. See ``policies.base``.
"""

from policies.base import Choice, EngineLoad, Hold, Outcome, Policy, RequestView, WorkerView
from policies.loader import available_policies, load_policy

__all__ = [
    "Choice", "EngineLoad", "Hold", "Outcome", "Policy", "RequestView", "WorkerView",
    "available_policies", "load_policy",
]
