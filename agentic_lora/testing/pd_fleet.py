"""Scripted PD groups: prefill and decode SGLang engines behind a scripted SGLang PD router.

:class:`ScriptedPDRouter` stands in for ``sglang_router --pd-disaggregation``: a ``/generate``
goes to the group's prefill server *and* one decode server (round robin), each with the
router's bootstrap fields, and the answer is the decode server's (the prefill's when it
refuses). Both role servers are :class:`~agentic_lora.testing.sglang_engine.ScriptedSGLangEngine`
instances started in their ``disaggregation_mode``, so a role server that lacks the adapter
refuses the request just as it would alone. The router never retries.

:class:`ScriptedPDFleet` mounts plain engines and PD groups on one respx router and gives the
settings values (``engines`` and ``pd_groups``) that name them.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

import httpx
import respx

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.pd import PDGroup
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine

__all__ = ["ScriptedPDFleet", "ScriptedPDRouter"]


class ScriptedPDRouter:
    """One group's SGLang PD router at ``base_url`` (retries off: one attempt per role)."""

    def __init__(
        self,
        name: str,
        base_url: str,
        prefill: ScriptedSGLangEngine,
        decode: Sequence[ScriptedSGLangEngine],
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.prefill = prefill
        self.decode = tuple(decode)
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self._rooms = itertools.count(1)
        #: The bodies of every ``/generate`` the router received, in order.
        self.generates: list[dict[str, object]] = []

    def mount(self, router: respx.MockRouter) -> None:
        router.post(self.base_url + "/generate").mock(side_effect=self._generate)

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.generates.append(body)
        decode = self.decode[next(self._next_decode)]
        forwarded = {
            **body,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 8998,
            "bootstrap_room": next(self._rooms),
        }
        async with httpx.AsyncClient() as client:
            prefill_reply = await client.post(self.prefill.base_url + "/generate", json=forwarded)
            decode_reply = await client.post(decode.base_url + "/generate", json=forwarded)
        reply = prefill_reply if prefill_reply.status_code != 200 else decode_reply
        return httpx.Response(reply.status_code, content=reply.content, headers=reply.headers)


class ScriptedPDFleet(ScriptedFleet):
    """Plain scripted engines and scripted PD groups at ``127.0.0.1:<base_port + i>``.

    ``groups`` maps a group name to its number of decode servers. Role servers are named as the
    fleet names them (``g1.prefill``, ``g1.decode0``) in :attr:`engines`, which holds every
    server (and :attr:`refs` their refs); :attr:`pd_routers` holds the groups' routers. Use it
    as a context manager while requests are made, like :class:`ScriptedFleet`.
    """

    def __init__(
        self,
        plain: Sequence[str] = (),
        groups: Sequence[tuple[str, int]] = (("g1", 1),),
        *,
        base_port: int = 33000,
        max_loras_per_batch: int = 3,
    ) -> None:
        ports = itertools.count(base_port)

        def engine(name: str, mode: str | None = None) -> ScriptedSGLangEngine:
            return ScriptedSGLangEngine(
                name,
                f"http://127.0.0.1:{next(ports)}",
                max_loras_per_batch=max_loras_per_batch,
                disaggregation_mode=mode,
                report_lora_settings=True,
            )

        self.engines: dict[str, ScriptedSGLangEngine] = {n: engine(n) for n in plain}
        self.plain = tuple(plain)
        self.pd_routers: dict[str, ScriptedPDRouter] = {}
        self.groups: list[PDGroup] = []
        for group, decodes in groups:
            prefill = engine(f"{group}.prefill", "prefill")
            decode = [engine(f"{group}.decode{i}", "decode") for i in range(decodes)]
            router_url = f"http://127.0.0.1:{next(ports)}"
            self.engines.update((e.name, e) for e in (prefill, *decode))
            self.pd_routers[group] = ScriptedPDRouter(group, router_url, prefill, decode)
            self.groups.append(
                PDGroup(group, prefill.base_url, tuple(d.base_url for d in decode), router_url)
            )
        self.refs = tuple(EngineRef(e.name, e.base_url) for e in self.engines.values())
        self.router = respx.mock(assert_all_called=False, assert_all_mocked=True)
        for e in self.engines.values():
            e.mount(self.router)
        for r in self.pd_routers.values():
            r.mount(self.router)

    def settings_values(self) -> dict[str, object]:
        """``engines`` and ``pd_groups`` for :class:`~agentic_lora.config.AgenticLoRASettings`."""
        return {
            "engines": [f"{n}={self.engines[n].base_url}" for n in self.plain],
            "pd_groups": [
                f"{g.name}=prefill={g.prefill},"
                + ",".join(f"decode={d}" for d in g.decode)
                + f",router={g.router}"
                for g in self.groups
            ],
        }
