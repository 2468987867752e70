"""The registry's journal on a full filesystem: fail-stop, nothing acknowledged lost, a clean reopen.

:func:`full_disk_journal` is the scenario, shared by the chaos test
(``tests/chaos/test_full_disk.py``) and ``bench/chaos.py`` (which reports its times). It runs in a
child process (this module run as ``python -m tests.chaos.full_disk``) so the filesystem it fills
is its own:

* ``tmpfs`` mode: the child runs in a mount namespace of its own (``unshare --mount``; else a user
  namespace too, ``unshare -rm``) with a small tmpfs (``size=``) mounted under its work directory;
  filling it gives the kernel's real ``ENOSPC``. Nothing of it is visible outside the child, and
  it goes with the child;
* ``fsize`` mode (where no namespace can be had): the child lowers its own ``RLIMIT_FSIZE`` to a
  little above the journal's size, so the journal's next growth gets the kernel's real ``EFBIG``
  (``SIGXFSZ`` ignored).

In the child, a :class:`~agentic_lora.assembly.deployment.Deployment` (its journal on that
filesystem, scripted engines at the HTTP edge) runs eight agent loops (open a Session, two
turns, close) and a publication every round of eight closes, recording every write the product
acknowledged (a binding returned, a release returned, a publication PUBLISHED). Then the disk fills up. The
registry must fail-stop at its next journal write: every later call raises ``JOURNAL_ERROR`` and
readiness says ``registry_failed``. The process is then "restarted" (the failed registry is
closed without another write, the rest abandoned), space is freed, and a new Deployment opens
the same journal. Verdicts (:func:`problems_of`): the reopen replays; every acknowledged write is
in it (bindings with their version, releases released, publications committed); every version's
Session refs are exactly the Sessions holding it; a new publication and a new Session work.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import faulthandler
import json
import os
import resource
import signal
import sys
import time
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import JournalError
from agentic_lora.errors import error_code
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet

__all__ = ["MODES", "DiskReport", "full_disk_journal", "problems_of"]

REPO_ROOT = Path(__file__).resolve().parents[2]
MODES = ("tmpfs", "fsize")
#: The child's filesystem: big enough for the journal's first rows, small enough to fill fast.
TMPFS_SIZE = "4m"
AGENTS = 8
#: Acknowledged Session closes before the disk is filled (the load is running by then).
WARMUP_CLOSES = 24
#: A hang guard only: every wait here ends on an event, never on elapsed time.
PATIENCE = 120.0
_FILL_CHUNK = 64 * 1024


@dataclass
class DiskReport:
    """What the child measured; times in seconds on its monotonic clock."""

    mode: str
    #: The kernel error the disk-filling write got (ENOSPC, or EFBIG in fsize mode).
    fill_error: str | None = None
    #: The registry's stop: its error code and the cause's text.
    failed_code: str | None = None
    failed_cause: str | None = None
    #: From the disk being full to the registry's fail-stop (its next journal write).
    stopped_after_full_s: float | None = None
    ready_reasons: list[str] = field(default_factory=list)
    #: A call made once stopped: its error code.
    call_when_stopped: str | None = None
    #: Acknowledged writes before the stop, and what the reopened journal had of them.
    acknowledged: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    refs_mismatch: list[str] = field(default_factory=list)
    #: Requests (agents' turns and closes, publications) that failed, by code.
    failed_requests: dict[str, int] = field(default_factory=dict)
    #: Reopen once space is freed: the replay's time, and back to normal (a new publication
    #: committed and a new Session served), from the moment space was freed.
    reopen_s: float | None = None
    back_to_normal_s: float | None = None
    publication_after: str | None = None
    session_after: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def problems_of(report: DiskReport) -> list[str]:
    """Every verdict of the scenario that did not hold (empty: all held)."""
    problems = []
    if report.error is not None:
        problems.append(f"the scenario failed: {report.error}")
    expected_fill = "ENOSPC" if report.mode == "tmpfs" else "EFBIG"
    if report.fill_error != expected_fill:
        problems.append(f"the disk-filling write got {report.fill_error}, not {expected_fill}")
    if report.failed_code != JournalError.code:
        problems.append(f"the registry did not fail-stop with JOURNAL_ERROR: {report.failed_code}")
    if "registry_failed" not in report.ready_reasons:
        problems.append(f"readiness did not say registry_failed: {report.ready_reasons}")
    if report.call_when_stopped != JournalError.code:
        problems.append(f"a call once stopped got {report.call_when_stopped}, not JOURNAL_ERROR")
    if not report.acknowledged.get("closes") or not report.acknowledged.get("publications"):
        problems.append(f"nothing was acknowledged before the stop: {report.acknowledged}")
    problems.extend(f"acknowledged write lost: {lost}" for lost in report.lost)
    problems.extend(f"refs do not match the Sessions: {m}" for m in report.refs_mismatch)
    if report.publication_after != PublicationOutcome.PUBLISHED.value:
        problems.append(f"a publication after the reopen: {report.publication_after}")
    if report.session_after != "ok":
        problems.append(f"a Session after the reopen: {report.session_after}")
    return problems


# --- the parent's side ---------------------------------------------------------------------------


async def full_disk_journal(workdir: Path, mode: str = "tmpfs") -> DiskReport:
    """Run the scenario in a child process (see the module docstring); its report.

    ``tmpfs`` mode falls back to ``fsize`` when this machine gives no mount namespace.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if mode == "tmpfs":
        for unshare in (["unshare", "--mount", "--propagation", "private"], ["unshare", "-rm"]):
            report = await _child(workdir, "tmpfs", unshare)
            if report is not None:
                return report
    report = await _child(workdir, "fsize", [])
    if report is None:
        raise RuntimeError("the full-disk child said nothing")
    return report


async def _child(workdir: Path, mode: str, prefix: list[str]) -> DiskReport | None:
    """The child's report; None when the mount namespace could not be had (``prefix`` failed)."""
    child = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-m",
        "tests.chaos.full_disk",
        str(workdir),
        mode,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(
            asyncio.shield(communicating := asyncio.ensure_future(child.communicate())),
            PATIENCE * 3,
        )
    except TimeoutError:
        # A hung child: ask it for every task's stack (see _dump_tasks), then kill it, and say
        # where it hung.
        child.send_signal(signal.SIGUSR1)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(communicating), 10)
        child.kill()
        out, err = await communicating
        raise RuntimeError(
            f"the full-disk child hung ({mode}); its tasks:\n{err.decode()[-20000:]}"
        ) from None
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    if not lines:
        if prefix:
            return None  # no namespace here (unshare refused, or mount refused inside it)
        raise RuntimeError(f"the full-disk child failed (rc {child.returncode}): {err.decode()}")
    return DiskReport(**json.loads(lines[-1]))


# --- the child's side ------------------------------------------------------------------------


class Ledger:
    """What the product acknowledged, and what failed, while the disk filled up."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}  # session key -> version of an acknowledged binding
        self.closed: set[str] = set()  # session keys whose release was acknowledged
        self.published: dict[str, int] = {}  # version -> acknowledged default revision
        self.failed: dict[str, int] = {}
        self.warm = asyncio.Event()
        self.stopped = asyncio.Event()
        #: Set on every acknowledged close and on the stop: what the publisher's cadence waits on.
        self.progress = asyncio.Event()

    def close_acknowledged(self, key: str) -> None:
        self.closed.add(key)
        if len(self.closed) >= WARMUP_CLOSES:
            self.warm.set()
        self.progress.set()

    def stop(self) -> None:
        self.stopped.set()
        self.progress.set()

    def failure(self, exc: BaseException) -> None:
        code = error_code(exc)
        self.failed[code] = self.failed.get(code, 0) + 1
        if code == JournalError.code or isinstance(exc.__cause__, JournalError):
            self.stop()

    async def next_round(self) -> bool:
        """Wait until the agents closed another round of Sessions (one each, on average); False
        once the registry stopped.

        The publisher's cadence. Publishing back to back instead livelocks: once every version
        slot is held by open Sessions, each publication is refused at once without a real
        suspension, so the loop never lets those Sessions close or the reclaimer run (seen under
        CI load, where a slow start fills the slots before the warm-up ends).
        """
        target = len(self.closed) + AGENTS
        while len(self.closed) < target and not self.stopped.is_set():
            self.progress.clear()
            await self.progress.wait()
        return not self.stopped.is_set()


async def _agent(d: Deployment, ledger: Ledger, n: int) -> None:
    episode = 0
    while not ledger.stopped.is_set():
        episode += 1
        s: Session = d.versioning.open_session(f"agent{n}-ep{episode}")
        try:
            for t in range(2):
                await s.generate({"text": f"{s.session_id} turn {t}", "sampling_params": {}})
                if s.binding is not None:
                    ledger.bound[s.key] = s.binding.version_id
            await s.close()
            ledger.close_acknowledged(s.key)
        except AgenticLoRAError as exc:
            ledger.failure(exc)
            await asyncio.sleep(0)  # a refused turn costs nothing: let the others run


async def _publisher(d: Deployment, ledger: Ledger) -> None:
    seed = 10
    while await ledger.next_round():
        seed += 1
        try:
            result = await d.publish(f"v{seed}", tiny_snapshot(seed))
        except AgenticLoRAError as exc:
            ledger.failure(exc)
            continue
        if result.outcome is PublicationOutcome.PUBLISHED and result.commit is not None:
            ledger.published[result.version_id] = result.commit.default_revision
        elif not result.ok:
            code = f"{result.outcome.value}:{result.reason}"
            ledger.failed[code] = ledger.failed.get(code, 0) + 1
            if "JOURNAL_ERROR" in (result.reason or "") or "JournalError" in (result.reason or ""):
                ledger.stop()


def _largest_file(directory: Path) -> int:
    return max(p.stat().st_size for p in directory.iterdir())


def _fill(disk: Path, report: DiskReport) -> None:
    """Write a filler file until the kernel refuses (ENOSPC on the tmpfs, EFBIG past the limit)."""
    chunk = b"\0" * _FILL_CHUNK
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    report.fill_error = errno.errorcode[exc.errno]
                    return
                raise
    finally:
        os.close(fd)


async def _abandon(d: Deployment) -> None:
    """What the process's end leaves: background work stopped, the failed registry closed (it
    writes nothing more once stopped, and releases the journal's lock), no other call made."""
    await d.repairer.stop()
    await d.resolver.stop()
    await d.reclaimer.stop()
    lease = d.versioning.lease
    renewer = getattr(lease, "_renewer", None)
    if renewer is not None:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
    registry = d.registry
    assert isinstance(registry, LocalRegistry)
    await registry.aclose()
    await d.backend.aclose()
    await d.versioning.transport.aclose()


def _verify(registry: LocalRegistry, ledger: Ledger, report: DiskReport) -> None:
    core = registry.core
    for version, revision in sorted(ledger.published.items()):
        v = core.peek_version(version)
        if v is None or v.published_revision is None:
            report.lost.append(f"publication of {version} (revision {revision})")
    if core.default_revision < max(ledger.published.values(), default=0):
        report.lost.append(f"default revision {core.default_revision} went back")
    for key, version in sorted(ledger.bound.items()):
        s = core.session(key)
        if key in ledger.closed:
            if s is not None and s.state.holds_ref:
                report.lost.append(f"release of {key} ({s.state.value})")
        elif s is None or s.version_id != version:
            report.lost.append(f"binding of {key} to {version}: now {s}")
    holders: dict[str, int] = {}
    for _key, state, binding, _lease in core.to_state()["sessions"]:
        if SessionState(state).holds_ref and binding is not None:
            vid = binding["ref"]["version_id"]
            holders[vid] = holders.get(vid, 0) + 1
    for v in core.status().versions:
        if v.session_refs != holders.get(v.version_id, 0):
            report.refs_mismatch.append(f"{v.version_id}: {v.session_refs} refs, {holders}")
    report.acknowledged = {
        "bindings": len(ledger.bound),
        "closes": len(ledger.closed),
        "publications": len(ledger.published),
    }


def _deployment(fleet: ScriptedFleet, workdir: Path, disk: Path) -> Deployment:
    settings = fleet.settings(journal_path=disk / "journal.sqlite", owner_id="disk-worker")
    return Deployment.from_settings(
        settings, backend_options={"store_root": str(workdir / "store")}
    )


async def _run(workdir: Path, disk: Path, report: DiskReport) -> None:
    ledger = Ledger()
    with ScriptedFleet() as fleet:
        d = _deployment(fleet, workdir, disk)
        await d.start()
        await d.publish("v10", tiny_snapshot(10))
        ledger.published["v10"] = 1
        load = [asyncio.create_task(_agent(d, ledger, n)) for n in range(AGENTS)]
        load.append(asyncio.create_task(_publisher(d, ledger)))
        await asyncio.wait_for(ledger.warm.wait(), PATIENCE)
        if report.mode == "fsize":
            # No file may grow past its largest now (the journal's WAL) by more than a chunk:
            # the filler stops there, and so does the journal's next growth past it: EFBIG.
            limit = await asyncio.to_thread(_largest_file, disk) + _FILL_CHUNK
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        full_at = time.monotonic()
        await asyncio.to_thread(_fill, disk, report)
        await asyncio.wait_for(ledger.stopped.wait(), PATIENCE)
        registry = d.registry
        assert isinstance(registry, LocalRegistry)
        if registry.failed is not None:
            report.failed_code = JournalError.code
            report.failed_cause = repr(registry.failed)[:300]
            report.stopped_after_full_s = round(time.monotonic() - full_at, 3)
        await asyncio.gather(*load)  # every loop ends once it saw the stop
        report.ready_reasons = list(d.repairer.readiness().reasons)
        try:
            await registry.bind_first(request_id=new_request_id(), session_key="late")
            report.call_when_stopped = "accepted"
        except AgenticLoRAError as exc:
            report.call_when_stopped = exc.code
        report.failed_requests = dict(ledger.failed)
        await _abandon(d)

        # The operator frees space and restarts the registry on the same journal.
        freed_at = time.monotonic()
        if report.mode == "fsize":
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        (disk / "filler").unlink()
        d2 = _deployment(fleet, workdir, disk)
        await d2.start()
        report.reopen_s = round(time.monotonic() - freed_at, 3)
        registry2 = d2.registry
        assert isinstance(registry2, LocalRegistry)
        _verify(registry2, ledger, report)  # before anything of this process binds
        # A publication the stop cut short (its commit unconfirmed) is LOADING in the journal:
        # the resolver aborts and cleans it at start, before the next one can go.
        await asyncio.wait_for(d2.resolver.settled(), PATIENCE)
        try:
            after = await d2.publish("after", tiny_snapshot(99))
            report.publication_after = after.outcome.value
            async with d2.session("after-1") as s:
                await s.generate({"text": "after-1 turn 0", "sampling_params": {}})
            report.session_after = "ok"
        finally:
            report.back_to_normal_s = round(time.monotonic() - freed_at, 3)
            await d2.aclose()


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """On SIGUSR1 (the parent's hang guard): the running stack and every task's await chain to
    stderr, then exit. A plain signal handler, not the loop's: a loop starved by a task that
    never suspends would never run the loop's own handler (nor any ``wait_for`` timeout)."""
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    for task in asyncio.all_tasks(loop):
        print(f"task {task.get_name()}:", file=sys.stderr)
        awaited: Any = task.get_coro()
        while awaited is not None:  # the whole await chain, not only the task's own frame
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                where = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
                print(f"  {where}", file=sys.stderr)
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    sys.stderr.flush()
    os._exit(70)


async def _main(workdir: Path, disk: Path, report: DiskReport) -> None:
    loop = asyncio.get_running_loop()
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: _dump_tasks(loop))
    await _run(workdir, disk, report)


def _child_main(workdir: Path, mode: str) -> None:
    report = DiskReport(mode=mode)
    disk = workdir / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    if mode == "tmpfs":
        import subprocess

        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(disk)],
            capture_output=True,
            check=False,
        )
        if mounted.returncode != 0:
            sys.exit(3)  # no JSON line: the parent tries the next way
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, not death
    try:
        asyncio.run(_main(workdir, disk, report))
    except Exception as exc:
        report.error = f"{type(exc).__name__}: {exc}"[:500]
    print(json.dumps(report.as_dict()), flush=True)


if __name__ == "__main__":
    _child_main(Path(sys.argv[1]), sys.argv[2])
