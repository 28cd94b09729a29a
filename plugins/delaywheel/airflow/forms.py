"""What the DAGs' trigger forms accept before a run is created (JSON-schema patterns on their Params) and who may
trigger the DAGs that change data. The jobs check everything again; these only spare an operator a failed run."""

from __future__ import annotations

from delaywheel.produce.validation import TOPIC_PATTERN

ISO_8601 = r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?)?(Z|[+-]\d{2}(:?\d{2})?)?$"
TOPIC = f"^{TOPIC_PATTERN.pattern}$"  # the producer's own rule (a form field holds no newline for `$` to let by)
TABLE = r"^[A-Za-z_][A-Za-z0-9_$]*(\.[A-Za-z_][A-Za-z0-9_$]*)?$"
COLUMN = r"^[A-Za-z_][A-Za-z0-9_$]*$"
# DAG-level permissions (FAB auth manager): this role may see and trigger the DAG; Admin and Op may anyway.
OPERATOR_ACCESS = {"delaywheel_operator": {"DAGs": {"can_read"}, "DAG Runs": {"can_read", "can_create"}}}
