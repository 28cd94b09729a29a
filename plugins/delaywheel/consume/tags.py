"""A consumer group's tag filter: RocketMQ's subscribe expression, `*` (every message) or `TAG1 || TAG2` (messages
whose tag is one of those). A message carries one tag string (`Delivered.tags`), compared whole and exactly; a message
without a tag matches only `*`. The expression is parsed once, before anything is read: a set of tags, or None for
every message, and what cannot be parsed is refused with the reason (ValueError).
"""

from __future__ import annotations

from delaywheel.produce.validation import MAX_TAGS_CHARS, storable

ALL = "*"
SEPARATOR = "||"
MAX_TAGS = 256  # tags in one expression
MAX_EXPRESSION_CHARS = 16_384


def parse(expression: object) -> frozenset[str] | None:
    """The tags `expression` accepts, or None for `*` (and for None: no filter). Around each tag, spaces are
    dropped, as RocketMQ does; a tag is any text a message's tag may be (up to MAX_TAGS_CHARS) but `||`. Refused
    with a ValueError naming what is wrong: an empty expression or tag, `*` beside tags, a tag that starts or ends
    with `|` (`A|||B` would read two ways), more than MAX_TAGS tags or MAX_EXPRESSION_CHARS characters."""
    if expression is None:
        return None
    if not isinstance(expression, str):
        raise ValueError(f"tags must be a string such as 'TAG1 || TAG2' or '*', not {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"tags: the expression is {len(expression):,} characters, above {MAX_EXPRESSION_CHARS:,}")
    if not storable(expression):
        raise ValueError("tags: the expression holds text no message's tag can hold (NUL, a lone surrogate)")
    if not expression.strip():
        raise ValueError("tags: the expression is empty; '*' takes every message")
    if expression.strip() == ALL:
        return None
    parts = [part.strip() for part in expression.split(SEPARATOR)]
    if len(parts) > MAX_TAGS:
        raise ValueError(f"tags: {len(parts)} tags, above the limit of {MAX_TAGS}")
    for n, part in enumerate(parts, 1):
        if not part:
            raise ValueError(f"tags: tag {n} of {expression[:80]!r} is empty (write 'A || B', with no empty tag)")
        if part == ALL:
            raise ValueError("tags: '*' takes every message and stands alone, not beside other tags")
        if part.startswith("|") or part.endswith("|"):
            raise ValueError(f"tags: tag {n}, {part[:80]!r}, starts or ends with '|': a tag may not hold '||'")
        if len(part) > MAX_TAGS_CHARS:
            raise ValueError(f"tags: tag {n} is {len(part)} characters; a message's tag has at most {MAX_TAGS_CHARS}")
    return frozenset(parts)


def matches(accepted: frozenset[str] | None, tag: str | None) -> bool:
    """Whether a message with `tag` passes the filter `accepted` (`parse`'s result)."""
    return accepted is None or tag in accepted


def render(accepted: frozenset[str] | None) -> str:
    """The expression of `accepted`, tags in sorted order: `parse(render(a)) == a`."""
    return ALL if accepted is None else f" {SEPARATOR} ".join(sorted(accepted))
