"""The values several layers share: what a delivery pass did (`PassResult`) and what it wrote into a topic
(`TopicSpan`). Delivery produces them; the store, the consumers' topic watcher, the batch jobs and the Airflow
operators read them. Nothing here imports more than the standard library, so any layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

MAX_ID = 2**63 - 1  # the largest message id: ids are bigint


@dataclass(frozen=True)
class TopicSpan:
    """What delivery wrote into one topic: consumers read in (xid, queue_offset) order, so `first` and `last`
    bound the batch exactly (the Airflow operators put them in the topic's Asset event)."""

    count: int
    first: tuple[str, int]  # (xid, queue_offset) of the first message written
    last: tuple[str, int]

    def merge(self, other: TopicSpan) -> TopicSpan:
        """Both spans as one, whichever was written first (spans of different lanes interleave)."""
        return TopicSpan(
            self.count + other.count,
            min(self.first, other.first, key=_position),
            max(self.last, other.last, key=_position),
        )

    def fields(self) -> dict[str, Any]:
        """The span as an Asset event's extra carries it: size and first/last (xid, queue_offset)."""
        return {
            "count": self.count,
            "first_xid": self.first[0],
            "first_offset": self.first[1],
            "last_xid": self.last[0],
            "last_offset": self.last[1],
        }


def event_extra(topic: str, lane: str, span: TopicSpan) -> dict[str, Any]:
    """A topic Asset event's extra (deliver tasks, the topic watcher): the topic, who wrote or announced the
    batch, and the batch's span."""
    return {"topic": topic, "lane": lane, **span.fields()}


def add_spans(into: dict[str, TopicSpan], spans: dict[str, TopicSpan]) -> None:
    """Merge per-topic spans into `into` (a run's, a lane's, or several lanes' totals)."""
    for topic, span in spans.items():
        into[topic] = into[topic].merge(span) if topic in into else span


def _position(at: tuple[str, int]) -> tuple[int, int]:
    """A (xid, queue_offset) position in read order: xids compare as numbers ("10" after "9")."""
    return int(at[0]), at[1]


@dataclass(frozen=True)
class PassResult:
    """What one delivery pass did, and when the caller should look again."""

    delivered: int
    skipped_cancelled: int
    next_due: datetime | None  # head of the queue after this pass; None when it is empty
    busy: bool = False  # another deliverer holds this level
    more: bool = False  # the batch limit stopped the pass while due messages remained
    topics: dict[str, TopicSpan] = field(default_factory=dict)  # what this pass wrote, per topic
    # the lane's lock (another deliverer's pass) or both its turns (cancels' momentary shared holds, locks.TURNS) were
    # held when the pass began, and it waited (up to levels.LANE_WAIT): a count says how often cancels touch deliveries
    waited: bool = False

    def combine(self, other: PassResult) -> PassResult:
        """Two lanes' passes as one lane's (the last level also serves levels removed from the table)."""
        dues = [d for d in (self.next_due, other.next_due) if d is not None]
        spans = dict(self.topics)
        add_spans(spans, other.topics)
        return PassResult(
            self.delivered + other.delivered,
            self.skipped_cancelled + other.skipped_cancelled,
            min(dues, default=None),
            self.busy or other.busy,
            self.more or other.more,
            spans,
            self.waited or other.waited,
        )
