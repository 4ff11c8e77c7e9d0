"""Protocol revisions: the one a job needs, and whether the workers that would run it speak it.

A job gives a later revision's field only where it uses it (``Job.to_json`` leaves the rest
out), so a plain job is one every v1 worker reads. A job that gives one needs a worker that
speaks that revision (its heartbeat's ``protocol``, ``WorkerInfo``): an older one refuses the
field it does not know (``invalid_job``), or, for a field of the result, leaves it out. A
producer that sees the workers refuses such a job before it enqueues it (``unmet``) unless every
live worker of its queue speaks it (``Spoken``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from producers.protocol.job import Job

PROTOCOL_REVISION = "1.4"  # what a worker speaks (its heartbeat's ``protocol``): additions to v1 only
FIRST_REVISION = "1.0"  # what a heartbeat without ``protocol`` speaks: a worker from before 1.1
# job fields of revisions after 1.1 and the revision of each: written only where given (Job.to_json)
LATER_FIELDS = {"score": "1.2", "tools": "1.3"}
LATER_MESSAGE_FIELDS = {"tool_calls": "1.3", "tool_call_id": "1.3"}  # of a chat message, likewise
LATER_SAMPLING_FIELDS = {"prompt_logprobs": "1.2"}  # of ``sampling``: null where not asked for
# result fields a reader may need beside those: a worker of an earlier revision leaves them out
LATER_RESULT_FIELDS = {"prompt_text": "1.4", "prompt_first_token": "1.4"}


@dataclass(frozen=True)
class Need:
    """A revision after 1.1 that a job needs, and its first field of that revision."""

    revision: str
    field: str  # ``tools``, ``messages.2.tool_calls``, ``sampling.prompt_logprobs``, a result's ``prompt_text``


def revision_key(revision: str) -> tuple[int, int]:
    """A revision as numbers, so ``1.10`` comes after ``1.9``; one that is not ``<major>.<minor>``
    (a hand-written heartbeat) counts as the first."""
    found = re.match(r"(\d+)\.(\d+)", revision)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def job_needs(job: Job, reads: Iterable[str] = ()) -> Need | None:
    """The latest revision ``job`` needs, with its first field of that revision; None for a job
    of 1.1's fields alone (every v1 worker runs it). ``reads``: result fields the reader needs
    besides (``LATER_RESULT_FIELDS``: an OpenAI echo reads ``prompt_text``)."""
    needs = [Need(revision, name) for name, revision in LATER_FIELDS.items() if getattr(job, name) is not None]
    needs += [Need(revision, f"sampling.{name}") for name, revision in LATER_SAMPLING_FIELDS.items()
              if job.sampling.get(name) is not None]
    for i, message in enumerate(job.messages or ()):
        needs += [Need(revision, f"messages.{i}.{name}") for name, revision in LATER_MESSAGE_FIELDS.items()
                  if getattr(message, name) is not None]
    needs += [Need(LATER_RESULT_FIELDS[name], name) for name in reads]
    return max(needs, key=lambda need: revision_key(need.revision), default=None)  # the first of the latest


@dataclass(frozen=True)
class Spoken:
    """The revisions the live workers of one queue speak. The queue is shared: any of them may take
    any job from it, so a job is read by all of them only up to ``oldest``."""

    oldest: str  # the revision every live worker of the queue reads
    latest: str
    workers: int  # the queue's live workers
    at_oldest: int  # of them, those that speak ``oldest`` and nothing later


def spoken_by(revisions: Iterable[str | None]) -> Spoken | None:
    """What the live workers of a queue speak, from their ``protocol`` (None: a worker from before
    1.1); None for no worker."""
    spoken = [revision or FIRST_REVISION for revision in revisions]
    if not spoken:
        return None
    oldest, latest = min(spoken, key=revision_key), max(spoken, key=revision_key)
    at_oldest = sum(revision_key(revision) == revision_key(oldest) for revision in spoken)
    return Spoken(oldest, latest, len(spoken), at_oldest)


def unmet(need: Need | None, spoken: Spoken | None) -> bool:
    """Whether a job of ``need`` must be refused on a queue whose live workers speak ``spoken``.

    NOTE: the oldest live worker decides, not the latest: a worker takes whatever job comes next on
    its queue, so a job only some of them read may go to one that fails it ``invalid_job``. No live
    worker (``spoken`` None) is no refusal: a queue holds its jobs for the workers that come later,
    which may speak any revision."""
    return need is not None and spoken is not None and revision_key(spoken.oldest) < revision_key(need.revision)


def unmet_message(need: Need, spoken: Spoken, workers: str) -> str:
    """Why a job of ``need`` is refused: the revision, and what ``workers`` (``live workers of queue
    'bulk'``) speak, naming the oldest where they differ; the caller puts the field's name first."""
    if spoken.at_oldest == spoken.workers:
        who = f"the {workers} speak {spoken.oldest}"
    else:
        verb = "speaks" if spoken.at_oldest == 1 else "speak"
        who = (f"{spoken.at_oldest} of the {spoken.workers} {workers} {verb} only {spoken.oldest} (the others up to"
               f" {spoken.latest}; the queue is shared, so any of them may take the job)")
    return f"needs protocol revision {need.revision}, and {who}; send it once they are upgraded, or leave the field out"
