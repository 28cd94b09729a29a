"""delaywheel_group_seek: move a consumer group's offset on a topic, from the trigger form.

- Backwards, to re-read: after a bug in a consumer, seek its group to the time the bug shipped (`to` = time,
  `to_time`) and it is handed every message delivered since, again; `earliest` re-reads every message kept.
- Forwards, to skip: `latest` passes every message delivered so far; a time or an offset (`to_offset`, a message's
  queue_offset) passes those before it.

Only the topic's offset moves. The group's retry topic keeps its pending retries (the group's own failures, still
owed a retry or the dead-letter topic): to move it too, seek `%RETRY%<group>` as the topic. Each seek is recorded in
`delaywheel.group_seeks` (group, topic, what was asked, by whom, when, from where to where); `by` defaults to the
triggering user. A batch a consumer holds while the seek runs moves nothing when it is acked: after a rewind it is read
again with the rest (docs/airflow.md, "Seek a consumer group").

Optional fields may stay empty (the form sends null). The DAG changes data, so in a deployment with the FAB auth
manager it is triggered by the `delaywheel_operator` role (`access_control`), besides the roles allowed every DAG.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from delaywheel.airflow.forms import GROUP, ISO_8601, OPERATOR_ACCESS, TOPIC
from delaywheel.airflow.operators import SeekOperator

with DAG(
    dag_id="delaywheel_group_seek",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["delaywheel", "consumer"],
    doc_md=__doc__,
    access_control=OPERATOR_ACCESS,
    params={
        "topic": Param("orders", type="string", pattern=TOPIC, description="the topic whose offset moves"),
        "group": Param("orders-group", type="string", pattern=GROUP, description="the consumer group"),
        "to": Param(
            "time",
            type="string",
            enum=["time", "offset", "earliest", "latest"],
            description="time: to_time; offset: to_offset; earliest: every message kept; latest: past every one",
        ),
        "to_time": Param(
            None,
            type=["null", "string"],
            pattern=ISO_8601,
            description="with time: the first message delivered at or after this, ISO 8601 (UTC if no offset)",
        ),
        "to_offset": Param(
            None, type=["null", "integer"], minimum=0, description="with offset: the first message at or past it"
        ),
        "by": Param(
            None,
            type=["null", "string"],
            maxLength=200,
            description="who or why, recorded with the seek (empty: the triggering user)",
        ),
    },
):
    SeekOperator(
        task_id="seek",
        topic="{{ params.topic }}",
        group="{{ params.group }}",
        to="{{ params.to }}",
        # an empty field (null) renders as blank, which the operator reads as not given
        to_time="{{ params.to_time or '' }}",
        to_offset="{{ '' if params.to_offset is none else params.to_offset }}",
        by="{{ params.by or '' }}",
    )
