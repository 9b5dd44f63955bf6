"""A primary of the Redis Cluster SIGKILLed mid-run (its replica deaf for a moment first, so acknowledged writes are
really lost) with a worker SIGKILLed in the same run: the chaos run of tests/reliability/test_failover.py on a
3+3 cluster. Replicated durability (WAIT per shard on a link to its primary): every job has exactly one result, equal
to the one Redis keeps, lost 0, answered twice 0. Redis's default asynchronous replication: every job is accounted
for from the SDK's view (answered, reported lost, or refused at submit), the fleet is quiet at the end, and the report
says what was lost or repeated.
Reproduce: `.venv/bin/pytest -s tests/cluster/test_cluster_failover.py`."""
from __future__ import annotations

import pytest

from tests.reliability.test_failover import run_failover


@pytest.mark.chaos
def test_a_cluster_primary_and_a_worker_sigkilled_in_one_run_leave_every_job_accounted_for(own_cluster, namespace,
                                                                                          tmp_path):
    outcome, text = run_failover(namespace, tmp_path, "primary", group=own_cluster)
    accounted = outcome["answered"] + len(outcome["lost_then_answered"]) + len(outcome["lost"]) + \
        len(outcome["submit_failed"])
    assert accounted == outcome["jobs"], text
    assert outcome["pending"] == 0, text
    assert outcome["answered"] > outcome["jobs"] // 2, text  # the fleet kept serving through the failover


@pytest.mark.chaos
def test_replicated_durability_on_a_cluster_rides_out_a_primary_and_a_worker_sigkill_with_one_result_per_job(
        own_cluster, namespace, tmp_path):
    outcome, text = run_failover(namespace, tmp_path, "replicated", group=own_cluster)
    assert outcome["answered"] == outcome["jobs"], text
    assert (outcome["lost"], outcome["lost_then_answered"], outcome["submit_failed"]) == ([], [], []), text
    assert outcome["answered_twice"] == [], text
    assert (outcome["ran_again"], outcome["answer_forgotten"], outcome["pending"]) == ([], [], 0), text
