"""Logic written once for the Client (blocking redis) and the AsyncClient (redis.asyncio).

A step function is a generator that holds the decisions (what to send, how to read a reply, when to retry or wait)
and no I/O: it yields each Redis call as a zero-argument callable and is sent the reply back, or has the call's
error raised at its `yield`, so its own try/except reads as it would around a direct call. `Sleep` asks the driver
to wait. `run` drives a step function with blocking calls, `run_async` awaits each call's reply: the same steps
serve both clients, as ReaderState's logic serves the reader thread and the reader task.

    def backlog(r, stream):
        info = yield lambda: r.xinfo_groups(stream)
        ...
    run(backlog(sync_client, s)) or await run_async(backlog(async_client, s))
"""
from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

Steps = Generator[Any, Any, Any]  # yields Callable[[], reply | Awaitable[reply]] or Sleep


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


class _Driver:
    """What both drivers do between calls: send the reply in (or raise the error there) and take the next call."""

    __slots__ = ("steps", "reply", "error", "value")

    def __init__(self, steps: Steps):
        self.steps, self.reply, self.error, self.value = steps, None, None, None

    def next_call(self) -> Any:
        """The next call, or _DONE once the steps returned (their value is then `value`)."""
        try:
            call = self.steps.send(self.reply) if self.error is None else self.steps.throw(self.error)
        except StopIteration as done:
            self.value = done.value
            return _DONE
        self.reply = self.error = None
        return call

    def failed(self, error: BaseException) -> None:
        """A call's error goes to the steps, which catch it or let it out through the driver. KeyboardInterrupt
        or a cancelled task ends them at once, their `finally` blocks run (a lock is released)."""
        if not isinstance(error, Exception):
            self.steps.close()
            raise error
        self.error = error


_DONE = object()


def run(steps: Steps) -> Any:
    """Drive `steps` with blocking calls; returns what they return, raises what they raise."""
    driver = _Driver(steps)
    while (call := driver.next_call()) is not _DONE:
        try:
            driver.reply = time.sleep(call.seconds) if isinstance(call, Sleep) else call()
        except BaseException as e:
            driver.failed(e)
    return driver.value


async def run_async(steps: Steps) -> Any:
    """Drive `steps` on the event loop: a call's coroutine is awaited, a Sleep is asyncio.sleep."""
    driver = _Driver(steps)
    while (call := driver.next_call()) is not _DONE:
        try:
            if isinstance(call, Sleep):
                await asyncio.sleep(call.seconds)
            else:
                driver.reply = call()
                if inspect.iscoroutine(driver.reply) or asyncio.isfuture(driver.reply):  # a pipeline is awaitable too
                    driver.reply = await driver.reply
        except BaseException as e:
            driver.failed(e)
    return driver.value


def call(fn: Callable[..., Any], *args, **kwargs) -> Callable[[], Any]:
    """A yieldable call with its arguments bound now (a lambda in a loop would see the loop's last values)."""
    return lambda: fn(*args, **kwargs)


def returning(value: Any) -> Steps:
    """Steps that make no call and return `value`: a blocking result where steps are expected."""
    return value
    yield  # a generator
