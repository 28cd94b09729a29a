"""`DueMessagesSensor`: succeeds when a level's head (or the wheel's next message) is due.

Deferrable by default: a lane can be empty for hours, and a deferred sensor waits in the triggerer
instead of holding a worker slot. `deferrable=False` pokes instead (every `poke_interval`, or with
`mode="reschedule"` between pokes without a slot), for deployments without a triggerer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from airflow.sdk import BaseSensorOperator, Context, PokeReturnValue
from airflow.sdk.exceptions import AirflowException

from delaywheel.lanes import lane_name
from delaywheel.reconnect import transient, transient_reason

from .hooks import DelayWheelHook
from .triggers import DueMessagesTrigger


class DueMessagesSensor(BaseSensorOperator):
    """Wait until `level` (1..N) has a due message, or with `wheel=True` until the wheel has one.

    :param level: the delay level (1..N) to wait on (templated; rendered text is read as an integer).
        Exactly one of `level` and `wheel`.
    :param wheel: True to wait on the timing wheel instead of a level (default False; not templated).
    :param delaywheel_conn_id: the Airflow connection of the store (templated; default ``delaywheel_default``).
    :param deferrable: wait in the triggerer (`DueMessagesTrigger`) without holding a worker slot (default True);
        False pokes (every ``poke_interval``, or with ``mode="reschedule"``) for deployments without a triggerer.
    :param trigger_poll_interval: the trigger's `poll_interval`: the longest wait, in seconds, before it looks
        again without a notification (default 5.0; not templated).
    :param now_offset_s: seconds added to the database clock the lane is compared with (default 0.0; not
        templated): tests make a future message due without waiting; production leaves it at 0.

    Other arguments (``timeout``, ``poke_interval``, ``mode``, ``soft_fail``...) are `BaseSensorOperator`'s.

    The XCom value is `{"lane", "due_at", "checked_at"}` of the message that made the lane due, whether a poke or
    the trigger found it. A trigger event whose ``status`` is not "success" fails the task with the event's
    message (`execute_complete`).
    """

    template_fields = ("level", "delaywheel_conn_id")

    def __init__(
        self,
        *,
        level: int | None = None,
        wheel: bool = False,
        delaywheel_conn_id: str = DelayWheelHook.default_conn_name,
        deferrable: bool = True,
        trigger_poll_interval: float = 5.0,
        now_offset_s: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (level is None) == (not wheel):
            raise ValueError("DueMessagesSensor needs exactly one of level=<n> or wheel=True")
        self.level = level
        self.wheel = wheel
        self.delaywheel_conn_id = delaywheel_conn_id
        self.deferrable = deferrable
        self.trigger_poll_interval = trigger_poll_interval
        self.now_offset_s = now_offset_s

    @property
    def lane(self) -> int | None:
        if self.wheel:
            return None
        assert self.level is not None  # __init__ takes exactly one of level and wheel
        return int(self.level)

    def poke(self, context: Context) -> PokeReturnValue:
        """Each poke connects afresh; a poke that finds the database unreachable (a restart) or short of a resource
        (a full disk, too many connections) is "not yet", not a failed task: the next poke, or the trigger, looks
        again."""
        try:
            head, clock = DelayWheelHook(self.delaywheel_conn_id).next_due(self.lane, now_offset_s=self.now_offset_s)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            if not transient(exc):
                raise
            self.log.warning("%s: %s; looking again later", lane_name(self.lane), transient_reason(exc))
            return PokeReturnValue(is_done=False)
        self.log.info("%s: head due %s, now %s", lane_name(self.lane), head, clock)
        if head is None or head > clock:
            return PokeReturnValue(is_done=False)
        return PokeReturnValue(
            is_done=True,
            xcom_value={"lane": lane_name(self.lane), "due_at": head.isoformat(), "checked_at": clock.isoformat()},
        )

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        if (poked := self.poke(context)).is_done:  # already due: no round trip through the triggerer
            return poked.xcom_value
        self.defer(
            trigger=DueMessagesTrigger(
                self.lane, self.delaywheel_conn_id, self.trigger_poll_interval, self.now_offset_s
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout) if self.timeout else None,
        )
        return None

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        """Resumed by the trigger's event: a "success" gives the XCom value (the event without its status, the
        same as a poke's); anything else fails the task with the event's message."""
        if event is None or event.get("status") != "success":
            message = event.get("message", event) if event else "no event"
            raise AirflowException(f"{self.task_id}: waiting for a due message failed: {message}")
        self.log.info("due: %s", event)
        return {key: value for key, value in event.items() if key != "status"}
