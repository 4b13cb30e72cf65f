"""Ray Serve request routing for the model replicas of ``flashasr serve --ray``: a live stream stays
on one replica.

A WebSocket session's partials and finals carry the session's ``affinity`` key (the ingress sets
it, :mod:`.ray_serve`). Its first request goes to the least-loaded of two random replicas (Serve's
"power of two choices", as every other request); the replica it lands on is remembered, and every
later request of the session goes there and only there (queued at the handle while that replica is
full), so partials coalesce in that replica's scheduler and a session's audio never moves. The
session moves only when its replica is gone (died, scaled down). Entries unused for
``ttl_s`` (default 600 s, twice the WebSocket idle timeout) are forgotten.

Uploads have no key: each goes to the less loaded of two random replicas, its pieces in one call
(they are batched with other requests' pieces there).

Follows Ray Serve's custom request router interface (``ray.serve.request_router``, Ray 2.60).
"""

from __future__ import annotations

import random
import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.serve.request_router import FIFOMixin

AFFINITY_KWARG = "affinity"


class StreamAffinityRouter(FIFOMixin, RequestRouter):
    """Sticky routing for requests with an ``affinity`` keyword argument (see the module docstring)."""

    def initialize_state(self, ttl_s: float = 600.0, **kwargs):
        self.ttl_s = float(ttl_s)
        self.sticky: dict[str, tuple[ReplicaID, float]] = {}  # key -> (replica, last use)
        self._pruned = time.monotonic()

    def _key(self, pending: Optional[PendingRequest]) -> str | None:
        if pending is None:
            return None
        key = pending.kwargs.get(AFFINITY_KWARG) if isinstance(pending.kwargs, dict) else None
        return str(key) if key else None

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = self._key(pending_request)
        if key is not None:
            got = self.sticky.get(key)
            if got is not None:
                for r in candidate_replicas:
                    if r.replica_id == got[0]:
                        self.sticky[key] = (got[0], time.monotonic())
                        return [[r]]
                self.sticky.pop(key, None)  # its replica is gone: the session moves once
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(list(candidate_replicas), 2)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = self._key(pending_request)
        now = time.monotonic()
        if key is not None:
            self.sticky[key] = (replica_id, now)
        if now - self._pruned > 60:
            self._pruned = now
            for k, (_r, t) in list(self.sticky.items()):
                if now - t > self.ttl_s:
                    del self.sticky[k]

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        for k, (r, _t) in list(self.sticky.items()):
            if r == replica_id:
                del self.sticky[k]


__all__ = ["StreamAffinityRouter", "AFFINITY_KWARG"]
