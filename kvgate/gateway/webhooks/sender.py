"""The task in each gateway that delivers webhook events from the outbox (outbox.py), at least once.

Every poll it claims the events due on the Redis server's clock (each held one claim lease, the delivery timeout
and a margin, so an event whose gateway died mid-delivery is due again after it) and POSTs each to its tenant's
receiver, signed as Standard Webhooks (webhook-id: the event's id, the same on every attempt, which receivers dedupe
on; webhook-timestamp; webhook-signature). A 2xx answer delivers it; anything else is retried after a backoff that
doubles from --webhook-backoff up to an hour, until --webhook-retry after the event was written, when it is counted
failed. It also watches background responses: the first gateway to see one end writes its event.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Awaitable, Callable

from standardwebhooks import Webhook

from .outbox import Claimed, Outbox
from .targets import Listen, Targets, route

log = logging.getLogger(__name__)

CLAIM = 32  # events one poll takes
WATCH = 100  # background responses one poll looks at
CLAIM_MARGIN_S = 5.0
MAX_BACKOFF_S = 3600.0
RESPONSE_EVENTS = {"completed": "response.completed", "failed": "response.failed",
                   "cancelled": "response.cancelled", "incomplete": "response.incomplete"}


@dataclass(frozen=True, slots=True)
class Timing:
    retry_s: float
    backoff_s: float
    timeout_s: float
    poll_s: float

    def backoff_ms(self, attempts: int) -> int:
        return int(min(self.backoff_s * 2 ** max(0, attempts - 1), max(MAX_BACKOFF_S, self.backoff_s)) * 1000)


def signed_headers(secret: str, event_id: str, now_ms: int, body: bytes) -> dict[str, str]:
    at = datetime.fromtimestamp(now_ms // 1000, tz=timezone.utc)
    return {"content-type": "application/json", "user-agent": "kvgate-webhooks", "webhook-id": event_id,
            "webhook-timestamp": str(now_ms // 1000), "webhook-signature": Webhook(secret).sign(event_id, at, body)}


# a background response's status and tenant once it ended ("gone": its record expired or was deleted); None: running
Ended = Callable[[str], Awaitable[tuple[str, str] | None]]


class WebhookSender:
    def __init__(self, outbox: Outbox, targets: Targets, timing: Timing, *, allow_private: bool, listen: Listen,
                 ended: Ended, count: Callable[[str], None]):
        """`count(outcome)`: the process's metrics (delivered, retried, failed, dropped)."""
        self.outbox, self.targets, self.timing, self.ended, self.count = outbox, targets, timing, ended, count
        self.allow_private, self.listen = allow_private, listen
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvgate-webhooks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=10)

    async def _run(self) -> None:
        import httpx  # here: the gateway imports it only where webhooks are on

        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as http:
            while True:
                busy = False
                try:
                    now_ms, due = await self.outbox.claim(CLAIM, int((self.timing.timeout_s + CLAIM_MARGIN_S) * 1000))
                    await asyncio.gather(*(self._deliver(http, e, now_ms) for e in due))
                    await self._look_at_responses(now_ms)
                    busy = len(due) == CLAIM
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # Redis away for a moment: the next poll tries again
                    log.warning("webhooks: %r", e)
                if not busy:
                    await asyncio.sleep(self.timing.poll_s)

    async def _deliver(self, http, e: Claimed, now_ms: int) -> None:
        target = self.targets.of(e.tenant)
        if target is None:  # the tenant's receiver was taken out of the configuration since the event was written
            await self.outbox.done(e.id, "dropped")
            self.count("dropped")
            return
        try:
            way = await asyncio.to_thread(route, target.url, f"tenant {e.tenant!r}'s webhook URL", self.allow_private,
                                          self.listen)
            answer = await http.post(way.url, content=e.body, timeout=self.timing.timeout_s,
                                     headers={**signed_headers(target.secret, e.id, now_ms, e.body), **way.headers},
                                     extensions=way.extensions)
            error = None if 200 <= answer.status_code < 300 else f"HTTP {answer.status_code}"
        except Exception as ex:  # refused, unreachable, timed out: all retried the same way
            error = f"{type(ex).__name__}: {ex}"
        if error is None:
            await self.outbox.done(e.id)
            self.count("delivered")
            return
        t = self.timing
        outcome = await self.outbox.retry(e.id, t.backoff_ms(e.attempts), int(t.retry_s * 1000), error)
        self.count("retried" if outcome == "retry" else "failed")
        if outcome == "failed":
            log.warning("webhook event %s to tenant %r failed for good after %d attempts: %s", e.id, e.tenant,
                        e.attempts, error)

    async def _look_at_responses(self, now_ms: int) -> None:
        running = []
        for rid in await self.outbox.watched(WATCH):
            with contextlib.suppress(Exception):  # one response that cannot be read holds up no other
                ended = await self.ended(rid)
                if ended is None:
                    running.append(rid)
                    continue
                status, tenant = ended
                kind = RESPONSE_EVENTS.get(status)
                if kind is None:  # gone before anyone saw it end: no event to send
                    await self.outbox.unwatch(rid)
                else:
                    await self.outbox.response_ended(rid, kind, tenant, now_ms // 1000)
        await self.outbox.looked_at(running, now_ms)
