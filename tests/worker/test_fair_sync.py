"""A heartbeat's look at fair share (Fair.sync) costs a constant number of commands whatever the number of bands: a
fleet serving 200 LoRA adapters reads 600 bands, and a ZCARD a band (one round trip each, on the worker's loop every
heartbeat) cut W-LORA's fleet to a third of its jobs/s with fair share off and no adapter job at all."""
from __future__ import annotations

from kvgate.producer.keys import PRIORITIES, Keys
from kvgate.worker.fair import Fair


def commands(r) -> int:
    return int(r.info("stats")["total_commands_processed"])


def bands_of(keys: Keys, models: int) -> set[str]:
    return {keys.jobs(f"adapter-{k:03d}", p) for k in range(models) for p in PRIORITIES}


def test_a_look_at_600_bands_with_fair_share_off_is_a_few_commands(queue):
    bands = bands_of(queue.keys, 200)
    fair = Fair(queue.r, queue.keys, "keep", bands)
    before = commands(queue.r)
    fair.sync()
    spent = commands(queue.r) - before - 1  # the INFO that read the count
    assert not fair.active
    assert spent <= 6, f"Fair.sync sent {spent} commands for {len(bands)} bands"


def test_a_tenant_left_in_any_band_keeps_fair_share_active_after_it_is_turned_off(queue):
    """Turned off, fair share stays active while a band still holds backlogged tenants, so their streams drain: the
    last band in any order counts as much as the first."""
    bands = sorted(bands_of(queue.keys, 200))
    fair = Fair(queue.r, queue.keys, "keep", set(bands))
    for band in (bands[0], bands[-1], bands[len(bands) // 2]):
        queue.r.zadd(Keys.fair_backlog(band), {"tenant-a": 1.0})
        fair.sync()
        assert fair.active and not fair.on, band
        queue.r.delete(Keys.fair_backlog(band))
        fair.sync()
        assert not fair.active, band
