"""What the DAGs' trigger forms accept before a run is created (JSON-schema patterns on their Params) and who may
trigger the DAGs that change data. The jobs check everything again; these only spare an operator a failed run."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from airflow.sdk import Param

from delaywheel.produce.validation import MAX_GROUP_CHARS, TOPIC_PATTERN

ISO_8601 = r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}(:?\d{2})?)?$"
TOPIC = f"^{TOPIC_PATTERN.pattern}$"  # the producer's own rule (a form field holds no newline for `$` to let by)
GROUP = f"^[%|A-Za-z0-9_.-]{{1,{MAX_GROUP_CHARS}}}$"  # a consumer group: its retry topic is a topic name too
TABLE = r"^[A-Za-z_][A-Za-z0-9_$]*(\.[A-Za-z_][A-Za-z0-9_$]*)?$"
COLUMN = r"^[A-Za-z_][A-Za-z0-9_$]*$"
# DAG-level permissions (FAB auth manager): this role may see and trigger the DAG; Admin and Op may anyway.
OPERATOR_ACCESS = {"delaywheel_operator": {"DAGs": {"can_read"}, "DAG Runs": {"can_read", "can_create"}}}


def form_moment(value: datetime | str, words: tuple[str, ...], name: str) -> datetime | str:
    """A time field as a form or template renders it: one of `words` as it is, a datetime, or ISO 8601 text; UTC when
    it names no zone (as the forms say). ValueError naming the field otherwise."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    text = str(value).strip()
    if text in words:
        return text
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        either = f"{', '.join(words)} or " if words else ""
        raise ValueError(f"{name} must be {either}an ISO 8601 time, not {text[:60]!r}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def subscription_params() -> dict[str, Any]:
    """The consumer DAGs' `tags` and `start` fields: the group's tag filter and where a new group starts."""
    return {
        "tags": Param(
            "*",
            type="string",
            minLength=1,
            description="Only messages with one of these tags, 'TAG1 || TAG2' ('*': all); the group passes the rest.",
        ),
        "start": Param(
            "earliest",
            type="string",
            pattern=f"^(earliest|latest)$|{ISO_8601}",
            description="A group with no offset yet starts at: earliest (every message kept), latest (from now on)"
            " or an ISO 8601 time (UTC if no offset).",
        ),
    }
