"""A batch line once submitted: the jobs it owns and their results, shared by `kvgate batch` and the gateway's managed
batches. A line runs one job (chat, completions) or one per input (/v1/embeddings) and is answered once, when every
job it owns is final."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvgate.openai.batch import BatchRequest, answer_line, unrun_line
from kvgate.producer.result import Result


@dataclass(slots=True)
class LineRun:
    """A submitted line: the ids of the jobs it owns, in input order, and their results as they come back. It is
    answered once, when every job is final (`complete`)."""

    request: BatchRequest
    job_ids: list[str]
    results: dict[str, Result] = field(default_factory=dict)

    @property
    def submitted(self) -> bool:
        """Every job of the line has an id (a submit cut short leaves the rest to a resubmission)."""
        return len(self.job_ids) == len(self.request.jobs)

    @property
    def complete(self) -> bool:
        return self.submitted and all(j in self.results for j in self.job_ids)

    def add(self, result: Result) -> bool:
        """Take one of the line's results; True once the line has them all."""
        if result.job_id not in self.job_ids:
            raise ValueError(f"job {result.job_id} is not one of line {self.request.line_no}'s jobs {self.job_ids}")
        self.results[result.job_id] = result
        return self.complete

    @property
    def expired(self) -> bool:
        """A job of the line was answered expired: its batch's window (the job's deadline) passed before it started."""
        return any(r.status == "expired" for r in self.results.values())

    def answer(self, seed: str, model: str | None = None) -> dict[str, Any]:
        """The line's one output line: OpenAI's batch_expired line where the window passed first (named as a batch
        that ends expired names the lines it never answered, by `seed`, the batch's id or file digest), else its
        answer; `model`: the model the serving worker reports."""
        if self.expired:
            return unrun_line(seed, self.request.custom_id, "expired")
        return answer_line(self.request, [self.results[j] for j in self.job_ids], model)


def line_runs(requests: list[BatchRequest], job_ids: list[str]) -> list[LineRun]:
    """The lines whose jobs were submitted in this order (every line's jobs in turn, as `submit_jobs` lists them), each
    owning its ids; where fewer ids came back than jobs, the last line is not `submitted` and the rest are left out."""
    runs, ids = [], iter(job_ids)
    for req in requests:
        taken = [j for _, j in zip(req.jobs, ids)]
        if not taken:
            break
        runs.append(LineRun(req, taken))
        if len(taken) < len(req.jobs):
            break
    return runs


def submit_jobs(requests: list[BatchRequest], **extra: Any) -> list[dict[str, Any]]:
    """Every job of the lines, line after line, for one submit_many; `extra`: arguments for all (the tenant)."""
    return [{**args, **extra} for req in requests for args in req.jobs]
