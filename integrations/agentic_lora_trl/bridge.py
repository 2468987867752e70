"""The one bridge between TRL's synchronous trainer and agentic-lora's asyncio objects.

TRL calls the rollout function and the callbacks on its training thread, synchronously. The
:class:`~agentic_lora.Deployment` (registry, Sessions, publisher, reclaimer) lives on an asyncio
event loop. :class:`DeploymentThread` runs that loop on a thread of its own and owns the
Deployment on it: it is built, started, used and closed there and nowhere else. The trainer side
hands it coroutines::

    with DeploymentThread.from_settings(settings, backend_options={...}) as thread:
        status = thread.run(thread.deployment.status())       # blocks the caller until done
        future = thread.submit(some_coroutine())               # returns at once

Rules:

* Every coroutine runs on the bridge's loop, so the Deployment is only ever touched from one
  thread; nothing of it is shared with the training thread.
* ``run`` from the bridge's own thread would wait for itself: it raises instead.
* :meth:`DeploymentThread.close` (also on ``with`` exit and, if forgotten, at interpreter exit)
  cancels the coroutines still submitted (a rollout's Sessions close on the way out), runs the
  closers registered with :meth:`DeploymentThread.on_close` (the publisher stops there, newest
  first), closes the Deployment, cancels whatever task is left on the loop, shuts the loop's
  executor down, stops the loop and joins the thread. No thread and no task outlives it.
* Once closing has begun, :meth:`~DeploymentThread.run` and :meth:`~DeploymentThread.submit`
  raise :class:`~agentic_lora_trl.errors.BridgeClosedError` and schedule nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import enum
import logging
import threading
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from typing import Any
from typing import Self
from typing import TypeVar

from agentic_lora import AgenticLoRASettings
from agentic_lora import Deployment
from agentic_lora_trl.errors import BridgeClosedError

__all__ = ["BridgeState", "DeploymentThread"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BridgeState(enum.Enum):
    """Where a :class:`DeploymentThread` is in its life (it only ever moves forward)."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class DeploymentThread:
    """An asyncio event loop on its own thread, owning one :class:`~agentic_lora.Deployment`.

    ``build`` makes the Deployment; it is called on the loop (an engine transport opens its
    connection pool on the loop that uses it), then the Deployment is started there.
    """

    def __init__(self, build: Callable[[], Deployment], *, name: str = "agentic-lora-trl") -> None:
        self._build = build
        self._name = name
        self._state = BridgeState.NEW
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._deployment: Deployment | None = None
        self._submitted: set[asyncio.Task[Any]] = set()
        self._closers: list[Callable[[], Awaitable[None]]] = []

    @classmethod
    def from_settings(cls, settings: AgenticLoRASettings, **options: Any) -> DeploymentThread:
        """A bridge whose Deployment is ``Deployment.from_settings(settings, **options)``."""
        return cls(lambda: Deployment.from_settings(settings, **options))

    # --- what it is ------------------------------------------------------------------------

    @property
    def state(self) -> BridgeState:
        return self._state

    @property
    def deployment(self) -> Deployment:
        """The Deployment (use it only inside coroutines given to :meth:`run`/:meth:`submit`).

        Still there while the bridge closes, for the closers; gone once it closed.
        """
        if self._deployment is None or self._state not in (
            BridgeState.RUNNING,
            BridgeState.CLOSING,
        ):
            raise BridgeClosedError(f"{self._name} is {self._state.value}", state=self._state.value)
        return self._deployment

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The bridge's event loop (for ``call_soon_threadsafe``; never run it elsewhere)."""
        if self._loop is None or self._state is not BridgeState.RUNNING:
            raise BridgeClosedError(f"{self._name} is {self._state.value}", state=self._state.value)
        return self._loop

    @property
    def thread(self) -> threading.Thread | None:
        """The loop's thread (None before :meth:`start`)."""
        return self._thread

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the bridge's own thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the loop's thread, then build and start the Deployment on it.

        If the Deployment cannot be built or started, the loop is stopped and its thread joined
        before the error is raised: a failed start leaves nothing running.
        """
        with self._lock:
            if self._state is not BridgeState.NEW:
                raise BridgeClosedError(
                    f"{self._name} was started before ({self._state.value})",
                    state=self._state.value,
                )
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=self._serve, args=(loop,), name=self._name, daemon=True
            )
            self._loop, self._thread = loop, thread
            thread.start()
        try:
            self._deployment = asyncio.run_coroutine_threadsafe(self._open(), loop).result()
        except BaseException:
            self._stop_and_join()
            with self._lock:
                self._state = BridgeState.CLOSED
            raise
        with self._lock:
            self._state = BridgeState.RUNNING
        # A daemon thread, closed at interpreter exit if its owner forgot to: atexit handlers run
        # while daemon threads still live (a non-daemon loop thread would hang the exit instead).
        atexit.register(self.close)
        logger.info("deployment thread started", extra={"bridge": self._name})
        return self

    def close(self) -> None:
        """Cancel what is still submitted, run the closers, close the Deployment, stop the loop
        and join its thread (see the module docstring). Idempotent; the first error of a closer
        or of the Deployment's close is raised once everything stopped."""
        with self._lock:
            if self._state in (BridgeState.CLOSING, BridgeState.CLOSED):
                return
            if self._state is BridgeState.NEW:
                self._state = BridgeState.CLOSED
                return
            if self.in_loop_thread():
                raise RuntimeError("a DeploymentThread cannot be closed from its own loop")
            self._state = BridgeState.CLOSING
        atexit.unregister(self.close)
        loop = self._loop
        assert loop is not None
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        finally:
            self._stop_and_join()
            with self._lock:
                self._state = BridgeState.CLOSED
            logger.info("deployment thread closed", extra={"bridge": self._name})

    def __enter__(self) -> Self:
        """Start the bridge (if it is not running yet); the ``with`` block's end closes it."""
        return self if self._state is BridgeState.RUNNING else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- handing work over -----------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the bridge's loop; returns its future at once.

        Cancelling the future cancels the coroutine. Raises BridgeClosedError (and closes
        ``coro`` unstarted) once the bridge is not running.
        """
        with self._lock:
            if self._state is not BridgeState.RUNNING:
                coro.close()
                raise BridgeClosedError(
                    f"{self._name} is {self._state.value}; nothing was submitted",
                    state=self._state.value,
                )
            loop = self._loop
            assert loop is not None
            # Scheduled under the lock: close() sees every coroutine submitted before it began.
            return asyncio.run_coroutine_threadsafe(self._tracked(coro), loop)

    def run(self, coro: Coroutine[Any, Any, T], *, timeout: float | None = None) -> T:
        """Run ``coro`` on the bridge's loop and block the calling thread until it ends.

        Its result is returned and its exception raised here. After ``timeout`` seconds the
        coroutine is cancelled and TimeoutError raised. Calling this from the bridge's own
        thread would wait forever for itself: RuntimeError.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("DeploymentThread.run called on its own loop; await the coroutine")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self._name}: no result within {timeout} s") from None
        except concurrent.futures.CancelledError:
            if self._state in (BridgeState.CLOSING, BridgeState.CLOSED):
                raise BridgeClosedError(
                    f"{self._name} closed while the coroutine ran; it was cancelled",
                    state=self._state.value,
                ) from None
            raise
        except BaseException:
            # KeyboardInterrupt on the caller's thread: do not leave the coroutine running.
            future.cancel()
            raise

    def call_soon(self, callback: Callable[..., object], *args: Any) -> None:
        """Call ``callback(*args)`` on the bridge's loop (thread-safe; returns at once)."""
        self.loop.call_soon_threadsafe(callback, *args)

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Await ``closer()`` on the loop when the bridge closes, before the Deployment closes
        (closers run newest first)."""
        self._closers.append(closer)

    # --- on the loop -----------------------------------------------------------------------

    @staticmethod
    def _serve(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    async def _open(self) -> Deployment:
        deployment = self._build()
        try:
            await deployment.start()
        except BaseException:
            await deployment.aclose()
            raise
        return deployment

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._submitted.add(task)
        try:
            return await coro
        finally:
            self._submitted.discard(task)

    async def _shutdown(self) -> None:
        errors: list[BaseException] = []
        await _cancel_all(set(self._submitted))
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception as exc:
                logger.exception("a closer of %s failed", self._name, extra={"bridge": self._name})
                errors.append(exc)
        if self._deployment is not None:
            try:
                await self._deployment.aclose()
            except Exception as exc:
                logger.exception("closing the deployment failed", extra={"bridge": self._name})
                errors.append(exc)
        await _cancel_all(asyncio.all_tasks() - {asyncio.current_task()})
        loop = asyncio.get_running_loop()
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()
        if errors:
            raise errors[0]

    def _stop_and_join(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # already stopped
                loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _cancel_all(tasks: set[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until each really ended (their ``finally`` blocks ran)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
