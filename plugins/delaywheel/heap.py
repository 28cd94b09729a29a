"""What a long-running delaywheel process does with its heap once it has started.

CPython's collector walks every tracked object each time it collects its oldest generation. In a consumer process the
objects made at start-up (modules, their functions and classes, psycopg's, the settings) are most of that walk,
and a full collection in the middle of a batch holds its message back. Those objects live as long as the process, so
collecting them is wasted: `gc.freeze()` moves them out of the collector's reach, and a full collection then walks
only what the loop made since. The CLI's loops (`deliver`, `advance`, `consume`; the shop example's `sweep`
and `customers`) do it before they start; a process of your own running `Store.consume` or `runner.run` for hours may call it the same way.
"""

from __future__ import annotations

import gc


def freeze_after_startup() -> int:
    """Collect what start-up left as garbage, then freeze the rest (the objects that live as long as the process);
    returns how many objects are frozen. Call it once, when the process's own objects are made, before its loop."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
