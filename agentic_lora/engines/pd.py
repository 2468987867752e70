"""Prefill.decode-disaggregated engines: a PD group is one fleet member with role servers.

In a PD deployment a request is prefilled on a prefill server and decoded on a decode server;
both must hold the exact adapter, or the output mixes two sets of weights. The model here:

* For **routing** (the router plugin, Session affinity, :class:`~agentic_lora.engines.routing.EngineHealth`)
  a PD group is one fleet member, named by the group and reached at its dispatch address: the
  SGLang router started with ``--pd-disaggregation`` in front of its role servers.
* For **publication, readiness, incarnations, repair and reclaim** every role server is an engine
  of its own, named ``<group>.prefill`` and ``<group>.decode<i>``. The registry's existing rules
  therefore count each role server without a special case: a commit needs READY from every role
  server under its current incarnation, and a restart of any one of them drops it from the
  version's holders until the repairer loaded the version there again.
* A group is **dispatchable** for a version only while *every* one of its role servers holds it
  (:meth:`PDFleet.dispatchable`, applied by :class:`PDGuard` on every dispatch). A group one role
  of which lacks the version is not offered to the router at all, so no request reaches it.

Plain engines and PD groups can be mixed in one fleet; a plain engine is its own only role.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.errors import ConfigurationError

__all__ = [
    "PDFleet",
    "PDGroup",
    "Role",
    "RoleHealth",
    "check_disaggregation_mode",
    "members_holding",
    "parse_pd_group",
]


class Role(enum.StrEnum):
    """What a server of a fleet member does (SGLang's ``--disaggregation-mode``)."""

    PLAIN = "null"
    PREFILL = "prefill"
    DECODE = "decode"


# A role server's name is an engine name (a store directory too): '<group>.decode<i>' must fit
# the backends' 64-character engine names, and no '.' keeps it unambiguous.
_GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$")


def _url(value: Any, what: str) -> str:
    url = str(value).strip()
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{what}: base URL {url!r} is not http(s)")
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class PDGroup:
    """One PD group: a prefill server, one or more decode servers, and the router in front.

    ``router`` is the group's dispatch address (the SGLang router with ``--pd-disaggregation``);
    it must run with retries off, like any SGLang router in front of engines.
    """

    name: str
    prefill: str
    decode: tuple[str, ...]
    router: str

    @property
    def member(self) -> EngineRef:
        """The group as one fleet member for routing: its name at its dispatch address."""
        return EngineRef(self.name, self.router)

    def role_servers(self) -> tuple[tuple[EngineRef, Role], ...]:
        """Every role server as an engine of its own, prefill first, with its role."""
        servers = [(EngineRef(f"{self.name}.prefill", self.prefill), Role.PREFILL)]
        servers += [
            (EngineRef(f"{self.name}.decode{i}", url), Role.DECODE)
            for i, url in enumerate(self.decode)
        ]
        return tuple(servers)


def parse_pd_group(value: Any, index: int) -> PDGroup:
    """A group from ``NAME=prefill=URL,decode=URL[,decode=URL...],router=URL`` or a mapping
    ``{"name", "prefill", "decode" (a URL or a list), "router"}``; ValueError if malformed."""
    if isinstance(value, PDGroup):
        return value
    if isinstance(value, Mapping):
        name = str(value.get("name", ""))
        raw_decode = value.get("decode", ())
        fields: dict[str, list[str]] = {
            "prefill": [value["prefill"]] if "prefill" in value else [],
            "decode": [raw_decode] if isinstance(raw_decode, str) else list(raw_decode),
            "router": [value["router"]] if "router" in value else [],
        }
        unknown = sorted(set(value) - {"name", *fields})
        if unknown:
            raise ValueError(f"PD group #{index}: unknown keys {unknown}")
    elif isinstance(value, str):
        name, _, spec = value.partition("=")
        fields = {"prefill": [], "decode": [], "router": []}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            role, sep, url = part.partition("=")
            if not sep or role.strip() not in fields:
                raise ValueError(
                    f"PD group #{index}: expected role=URL with role prefill, decode or router, "
                    f"got {part!r}"
                )
            fields[role.strip()].append(url)
    else:
        raise ValueError(f"PD group #{index}: expected 'NAME=prefill=URL,...', got {value!r}")
    name = name.strip()
    if not _GROUP_NAME.match(name):
        raise ValueError(
            f"PD group #{index}: name {name!r} must be 1-48 letters, digits, '_' or '-' (its "
            "role servers are named '<group>.prefill', '<group>.decode<i>')"
        )
    for role in ("prefill", "router"):
        if len(fields[role]) != 1:
            raise ValueError(f"PD group {name!r}: needs exactly one {role} URL")
    if not fields["decode"]:
        raise ValueError(f"PD group {name!r}: needs at least one decode URL")
    return PDGroup(
        name=name,
        prefill=_url(fields["prefill"][0], f"PD group {name!r} prefill"),
        decode=tuple(_url(u, f"PD group {name!r} decode") for u in fields["decode"]),
        router=_url(fields["router"][0], f"PD group {name!r} router"),
    )


@dataclass(frozen=True, slots=True)
class PDFleet:
    """A fleet of plain engines and PD groups, seen both ways (see module docstring)."""

    engines: tuple[EngineRef, ...] = ()
    groups: tuple[PDGroup, ...] = ()

    @property
    def has_groups(self) -> bool:
        return bool(self.groups)

    @property
    def members(self) -> tuple[EngineRef, ...]:
        """The routing fleet: plain engines, then one member per group (its dispatch address)."""
        return self.engines + tuple(g.member for g in self.groups)

    def servers(self) -> tuple[tuple[EngineRef, Role], ...]:
        """Every server that holds adapters, with its role: plain engines, then role servers."""
        plain = tuple((e, Role.PLAIN) for e in self.engines)
        return plain + tuple(s for g in self.groups for s in g.role_servers())

    @property
    def publication_engines(self) -> tuple[EngineRef, ...]:
        """The engines publication, readiness, repair and reclaim drive: every server."""
        return tuple(ref for ref, _ in self.servers())

    def roles_of(self, member: str) -> tuple[str, ...]:
        """The servers that must all hold a version for ``member`` to serve it."""
        for g in self.groups:
            if g.name == member:
                return tuple(ref.name for ref, _ in g.role_servers())
        return (member,)

    def member_of(self) -> dict[str, str]:
        """Server name -> the fleet member it belongs to (a plain engine is its own member)."""
        owner = {e.name: e.name for e in self.engines}
        for g in self.groups:
            owner.update((ref.name, g.name) for ref, _ in g.role_servers())
        return owner

    def requirements(self) -> tuple[tuple[str, frozenset[str]], ...]:
        """``(member, the servers that must all hold a version for it)``, in fleet order."""
        return tuple((m.name, frozenset(self.roles_of(m.name))) for m in self.members)

    def dispatchable(self, holders: Iterable[str]) -> tuple[str, ...]:
        """The members, in fleet order, every server of which is among ``holders``."""
        return members_holding(self.requirements(), holders)

    def check_distinct(self) -> None:
        """Raise ConfigurationError (``duplicate_engine``) on a name or URL used twice anywhere:
        every registry receipt is keyed by server name, and one server in two roles would let
        one READY stand for two."""
        names = [m.name for m in self.members] + [
            ref.name for g in self.groups for ref, _ in g.role_servers()
        ]
        urls = [ref.base_url for ref, _ in self.servers()] + [g.router for g in self.groups]
        for label, values in (("name", names), ("URL", urls)):
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ConfigurationError(
                    f"duplicate engine {label}(s): {dupes}",
                    check="duplicate_engine",
                    duplicates=dupes,
                )


def members_holding(
    requirements: tuple[tuple[str, frozenset[str]], ...], holders: Iterable[str]
) -> tuple[str, ...]:
    """The members whose every server is among ``holders`` (``requirements``: member -> servers)."""
    held = frozenset(holders)
    return tuple(member for member, servers in requirements if servers <= held)


class RoleHealth(EngineHealth):
    """Server health (what the repairer's incarnation probe marks) folded into member health.

    The repairer probes servers (``g1.prefill``, ``g1.decode0``); routing knows members (``g1``).
    A server that does not answer makes its member unhealthy in ``members``; the member is
    healthy again once every one of its servers answers. Only members this object marked down
    are marked healthy again, so an operator's mark on a member stands.
    """

    def __init__(self, members: EngineHealth, fleet: PDFleet) -> None:
        self._owner = fleet.member_of()
        super().__init__(self._owner)
        self._pd = fleet
        self._members = members
        self._downed: set[str] = set()

    def mark_unhealthy(self, engine: str) -> None:
        super().mark_unhealthy(engine)
        member = self._owner[engine]
        if self._members.is_healthy(member):
            self._members.mark_unhealthy(member)
            self._downed.add(member)

    def mark_healthy(self, engine: str) -> None:
        super().mark_healthy(engine)
        member = self._owner[engine]
        if member in self._downed and all(self.is_healthy(r) for r in self._pd.roles_of(member)):
            self._downed.discard(member)
            self._members.mark_healthy(member)


def check_disaggregation_mode(info: Mapping[str, Any], *, engine: str, role: Role) -> None:
    """Raise ConfigurationError (``pd_role``) when a server's ``disaggregation_mode`` (SGLang
    server info) is not the role the settings give it; a server that reports none passes."""
    mode = info.get("disaggregation_mode")
    if mode is None:
        return
    if str(mode) != role.value:
        hint = (
            "configure it inside a PD group"
            if role is Role.PLAIN
            else f"start it with --disaggregation-mode {role.value}"
        )
        raise ConfigurationError(
            f"engine {engine} runs with disaggregation_mode={mode!r}, but the settings give it "
            f"the role {role.value!r}: {hint}",
            check="pd_role",
            engine=engine,
            mode=str(mode),
            role=role.value,
        )
