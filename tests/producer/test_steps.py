"""One piece of Redis logic written as steps runs the same with blocking calls and on asyncio: replies come back,
a call's error is raised where the call was yielded (and may be caught there), Sleep waits, and a cancelled task
still runs the steps' `finally`."""
from __future__ import annotations

import asyncio

import pytest

from kvgate.producer.steps import Sleep, call, returning, run, run_async


class Store:
    def __init__(self, coroutines: bool):
        self.data, self.coroutines = {"a": 1}, coroutines

    def get(self, key):
        if key not in self.data:
            raise KeyError(key)
        return self._reply(self.data[key])

    def _reply(self, value):
        async def later():
            return value
        return later() if self.coroutines else value


def total(store, keys) -> object:
    found = 0
    for key in keys:
        try:
            found += yield call(store.get, key)
        except KeyError:
            found += 100  # the caller's handling, at the yield
        yield Sleep(0)
    return found + (yield from returning(5))


def test_blocking_and_asyncio_drivers_give_the_same_answer_and_errors_reach_the_steps():
    assert run(total(Store(False), ["a", "b", "a"])) == 107
    assert asyncio.run(run_async(total(Store(True), ["a", "b", "a"]))) == 107


def test_an_error_the_steps_do_not_catch_leaves_through_the_driver():
    def steps(store):
        return (yield call(store.get, "missing"))

    with pytest.raises(KeyError):
        run(steps(Store(False)))
    with pytest.raises(KeyError):
        asyncio.run(run_async(steps(Store(True))))


def test_a_cancelled_task_runs_the_steps_finally_block():
    released = []

    def steps():
        try:
            yield lambda: asyncio.sleep(10)
        finally:
            released.append(True)

    async def main():
        task = asyncio.create_task(run_async(steps()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert released == [True]
