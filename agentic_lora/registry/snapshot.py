"""The registry's snapshot for journal compaction: its whole state as JSON-able data and back.

The image includes the remembered results of recent calls (the idempotency window), so a registry
rebuilt from a snapshot plus the journal's later rows answers a replayed call exactly as the live
one would have. Sets are written sorted so the same state always gives the same image.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from agentic_lora.foundation.identity import VersionRef
from agentic_lora.registry.state import LeaseRecord
from agentic_lora.registry.state import NameRecord
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import SessionRecord
from agentic_lora.registry.state import VersionRecord
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import from_wire
from agentic_lora.registry.types import to_wire

__all__ = ["dump_state", "load_state"]


def dump_state(state: RegistryState) -> dict[str, Any]:
    """A JSON-able image of everything, including remembered results of recent calls."""
    return {
        "seq": state.seq,
        "default": state.default_version,
        "default_revision": state.default_revision,
        "rolled_back_from": state.rolled_back_from,
        "pending": state._pending,
        "incarnations": state._incarnations,
        "engines": list(state.engines),
        "members": {e: m.value for e, m in state._members.items()},
        "versions": [
            {
                "version_id": v.version_id,
                "digest": v.digest,
                "lora_name": v.lora_name,
                "state": v.state.value,
                "attempt": v.attempt,
                "ready": [to_wire(r) for r in v.ready.values()],
                "cleaned": sorted(v.cleaned),
                "reclaim_id": v.reclaim_id,
                "reclaimed": sorted(v.reclaimed),
                "session_refs": v.session_refs,
                "commit_receipt": to_wire(v.commit_receipt),
                "reloads": v.reloads,
            }
            for v in state._versions.values()
        ],
        "sessions": [
            [k, s.state.value, to_wire(s.binding), s.lease] for k, s in state._sessions.items()
        ],
        "now": state.now,
        "leases": [
            [
                lease.owner,
                lease.incarnation,
                lease.ttl,
                lease.expires_at,
                sorted(lease.sessions),
                sorted(lease.names),
            ]
            for lease in state._leases.values()
        ],
        "owners": state._owners,
        "dead_leases": [[k, why] for k, why in state._dead_leases.items()],
        "names": [
            [n, rec.session_key, rec.lease, rec.closed_at, rec.why]
            for n, rec in state._names.items()
        ],
        "done": state._done.to_state(),
    }


def load_state(state: RegistryState, image: dict[str, Any]) -> None:
    """Inverse of :func:`dump_state` (on a fresh state with the same fleet and capacity)."""
    state.seq = int(image["seq"])
    state.default_version = image["default"]
    state.default_revision = int(image["default_revision"])
    # Images written before rollbacks existed have neither key: no rollback, no reload.
    state.rolled_back_from = image.get("rolled_back_from")
    state._pending = image["pending"]
    state._incarnations = dict(image["incarnations"])
    # Images written before membership existed have neither key: the configured fleet, ACTIVE.
    state.engines = tuple(image.get("engines", state.engines))
    state._members = {
        e: MemberState(image.get("members", {}).get(e, MemberState.ACTIVE.value))
        for e in state.engines
    }
    state._versions = {}

    def known(version_id: str) -> VersionRef:
        # Completes receipts written before they carried a ref (see types.from_wire).
        return state._versions[version_id].ref

    for raw in image["versions"]:
        v = VersionRecord(
            VersionRef(raw["version_id"], raw["digest"], raw["lora_name"], int(raw["attempt"]))
        )
        state._versions[v.version_id] = v
        v.state = VersionState(raw["state"])
        for r in raw["ready"]:
            receipt = from_wire(r)
            v.ready[receipt.engine] = receipt
        v.cleaned = set(raw["cleaned"])
        v.reclaim_id = raw["reclaim_id"]
        v.reclaimed = set(raw["reclaimed"])
        v.session_refs = int(raw["session_refs"])
        v.commit_receipt = from_wire(raw["commit_receipt"], known)
        v.reloads = int(raw.get("reloads", 0))
    state._sessions = {
        k: SessionRecord(SessionState(st), from_wire(b, known), lease)
        for k, st, b, lease in image["sessions"]
    }
    state.now = float(image["now"])
    state._leases = {}
    for owner, incarnation, ttl, expires_at, sessions, names in image["leases"]:
        lease = LeaseRecord(owner, incarnation, float(ttl), float(expires_at))
        lease.sessions = set(sessions)
        lease.names = set(names)
        state._leases[lease.lease_id] = lease
    state._owners = dict(image["owners"])
    state._dead_leases = OrderedDict((k, why) for k, why in image["dead_leases"])
    state._names = {}
    state._name_of = {}
    for n, key, lease_id, closed_at, why in image["names"]:
        rec = NameRecord(key, lease_id)
        rec.closed_at = closed_at
        rec.why = why
        state._names[n] = rec
        state._name_of[key] = n
    state._done.load_state(image["done"], known)
