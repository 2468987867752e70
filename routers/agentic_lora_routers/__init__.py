"""Built-in router plugins (entry-point group ``agentic_lora.routers``).

* :class:`SessionAffinityRouter` (``session-affinity``): rendezvous hashing of the Session key
  over the healthy engines, so a Session stays on one engine (and its prefix cache) while that
  engine is healthy; requests without a Session go to the least busy engine.
* :class:`LeastInFlightRouter` (``least-in-flight``): the engine with the fewest requests in
  flight, ties broken in turn.

Both only choose: they never see a writable body and never send.
"""

from __future__ import annotations

from agentic_lora_routers.affinity import SessionAffinityRouter
from agentic_lora_routers.least_in_flight import LeastInFlightRouter

__all__ = ["LeastInFlightRouter", "SessionAffinityRouter"]
