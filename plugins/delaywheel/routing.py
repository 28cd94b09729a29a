"""Several stores: which store a topic lives in, and `Stores`, the facade that sends, consumes and cancels by it.

Nothing changes inside a store: each keeps its own lanes, locks, deliverers and consumer offsets, and a topic's
messages (pending, delivered, retried) live in one store. What several stores add is the rule that picks the store.

**The rule.** Rendezvous (highest-random-weight) hashing of the topic over the configured store names: each store
scores `blake2b(name, topic)` and the highest score wins. It depends on the names only, never on their order or on
the process (Python's `hash()` is salted per process; blake2b is not), so every producer, consumer, deliverer and
Spark executor agrees. Adding a store moves only the topics it now wins, about 1/N of them with N stores after the
addition, and removing one moves only its own; a ring of virtual nodes does as well only with many points per store,
and a modulo moves nearly every topic.

**The routing table** wins over the hash, topic by topic: `orders=b` pins a topic to a store (kept where it was when a
store is added, or put on a store of its own); `orders=a>b` moves it: new sends go to b, while a still holds what was
sent before (its deliverers deliver it there, into a's topic), so consumers and cancels read both until a holds
nothing more of the topic (docs/stores.md, "Moving a topic"). A topic's *sources* are the stores it may have messages
in: its current store first, then those it moves from.

**Ids are per store.** Each store numbers its messages with its own sequence, so the same id may name a message in
each store: a cancel by id names the topic (whose single source is the store) or the store itself; a cancel by key
asks every store, as a key's messages may sit in any topic, unless a topic narrows it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from delaywheel.config import ConfigError, Settings, load_settings
from delaywheel.consume import topics
from delaywheel.consume.position import Seeked, UnknownOffset
from delaywheel.ops.cancel import CancelResult
from delaywheel.produce.validation import RESERVED_TOPIC_PREFIXES, Message, check_now, check_topic, prepare
from delaywheel.store import Store


def score(store: str, topic: str) -> int:
    """A store's weight for a topic: 64 bits of blake2b over both (stable across processes and machines)."""
    digest = hashlib.blake2b(topic.encode(), digest_size=8, key=store.encode(), person=b"delaywheel").digest()
    return int.from_bytes(digest, "big")


def home(topic: str, names: Collection[str]) -> str:
    """The store the hash gives `topic` among `names` (ties, which need equal 64-bit digests, go to the lower name)."""
    if not names:
        raise ConfigError("no stores to route to")
    return max(sorted(names), key=lambda name: score(name, topic))


def moved_topics(
    topic_names: Iterable[str], before: Collection[str], after: Collection[str]
) -> dict[str, tuple[str, str]]:
    """Topics whose hashed store differs between two sets of store names, as topic -> (old, new): what to pin
    (`topic=old`) or move (`topic=old>new`) in the routing table before the change takes effect."""
    moved = {}
    for topic in topic_names:
        old, new = home(topic, before), home(topic, after)
        if old != new:
            moved[topic] = (old, new)
    return moved


class Router:
    """The rule and the routing table over a set of store names; checks that every route names a configured store."""

    def __init__(self, names: Collection[str], routes: Iterable[tuple[str, tuple[str, ...]]] = ()):
        self.names = tuple(names)
        if not self.names:
            raise ConfigError("stores: none configured (DELAYWHEEL_STORES, or stores in airflow.cfg's [delaywheel])")
        self.routes = dict(routes)
        self._store_for = functools.lru_cache(maxsize=4096)(self._route)  # per router: its names and routes
        for topic, stores in self.routes.items():
            if topic.startswith(RESERVED_TOPIC_PREFIXES):
                raise ConfigError(
                    f"routes: {topic!r} is a group's retry or dead-letter topic, which every store keeps"
                    " for its own topics: it cannot be routed"
                )
            unknown = [name for name in stores if name not in self.names]
            if unknown:
                raise ConfigError(
                    f"routes: topic {topic!r} names store(s) {', '.join(unknown)} that are not configured"
                    f" (stores: {', '.join(self.names)})"
                )

    @classmethod
    def configured(cls, settings: Settings) -> Router:
        """The configured stores' rule and routing table (`stores`, `routes`)."""
        return cls([name for name, _ in settings.stores], settings.routes)

    def store_for(self, topic: str) -> str:
        """Where `topic`'s new messages go: its route's current store, else its hashed one. Remembered for the last
        4,096 topics: a batch has few topics, and hashing each message's over the store names costs tens of times a
        lookup of the remembered store."""
        return self._store_for(topic)

    def _route(self, topic: str) -> str:
        route = self.routes.get(check_topic(topic))
        return route[-1] if route else home(topic, self.names)

    def sources(self, topic: str) -> tuple[str, ...]:
        """Every store that may hold `topic`'s messages: the current one first, then those it moves from. A group's
        retry and dead-letter topics are written by each store's own retry ladder, for the group's topics in that
        store, so every store may hold them."""
        if check_topic(topic).startswith(RESERVED_TOPIC_PREFIXES):
            return self.names
        route = self.routes.get(topic)
        return (route[-1], *reversed(route[:-1])) if route else (home(topic, self.names),)


@dataclass(frozen=True)
class Pulled:
    """A batch and the store it came from: its ack goes to that store (each store keeps its own offsets)."""

    store: str
    batch: topics.Batch


class SendManyError(Exception):
    """A batch spanning several stores failed in one store after other stores had committed their parts (each part
    is one store's all-or-nothing COPY; stores share no transaction). `sent` maps each committed message's position
    in the input to its id; the cause is the failed store's error."""

    def __init__(self, store: str, sent: dict[int, int], pending: int):
        super().__init__(
            f"send_many: store {store!r} failed; {len(sent)} message(s) committed in other stores,"
            f" {pending} not sent (resend those: Stores.send_many again with them)"
        )
        self.store = store
        self.sent = sent


class Stores:
    """Several stores behind one object: sends, pulls, consumes and cancels go to the store(s) of their topic.

    Not thread-safe, as `Store` is not: one per thread. Each store's `Store` is opened on first use and closed with
    this object. One store's own calls (a transaction on its `conn`, `prepare`, `retire`) go through `store(name)` or
    `for_topic(topic)`: to enqueue an order's timeout in the order's transaction, open it on
    `stores.for_topic(topic).conn`.
    """

    def __init__(
        self,
        stores: Iterable[tuple[str, str]] | None = None,
        settings: Settings | None = None,
        *,
        routes: Iterable[tuple[str, tuple[str, ...]]] | None = None,
    ):
        self.settings = settings or load_settings()
        self.urls = dict(self.settings.stores if stores is None else stores)
        self.router = Router(self.urls, self.settings.routes if routes is None else routes)
        self._open: dict[str, Store] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return self.router.names

    def store(self, name: str) -> Store:
        """The store called `name` (a ConfigError naming the configured ones otherwise)."""
        if name not in self.urls:
            raise ConfigError(f"store {name!r} is not configured (stores: {', '.join(self.names)})")
        if name not in self._open:
            self._open[name] = Store(self.urls[name], self.settings)
        return self._open[name]

    def for_topic(self, topic: str) -> Store:
        """The store `topic`'s new messages go to."""
        return self.store(self.router.store_for(topic))

    def close(self) -> None:
        for store in self._open.values():
            store.close()
        self._open.clear()

    def __enter__(self) -> Stores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # producing
    def send(self, topic: str, body: Any, **options: Any) -> int:
        """`Store.send` on the topic's store; the id is that store's (module docstring, "Ids are per store")."""
        return self.for_topic(topic).send(topic, body, **options)

    def send_many(self, messages: Iterable[Message], *, now: datetime | None = None) -> list[int]:
        """Send a batch split by topic, one `Store.send_many` per store; ids in input order. Each store's part is all
        or nothing. A batch spanning stores is checked whole first (`validation.prepare`, by `now` or this machine's
        clock), so a bad message refuses it before any store writes; a store failing after another committed (down,
        or its clock placing a message at the edge of a limit differently) raises `SendManyError` saying which
        went in."""
        batch = list(messages)
        parts: dict[str, list[int]] = {}
        clock = check_now(now) or datetime.now(UTC)  # (each store checks `now` against its own clock)
        for position, message in enumerate(batch):
            if not isinstance(message, Message):
                prepare(message, clock, self.settings)  # raises InvalidMessage, as Store.send_many would
            parts.setdefault(self.router.store_for(message.topic), []).append(position)
        if len(parts) > 1:
            for message in batch:
                prepare(message, clock, self.settings)
        ids: dict[int, int] = {}
        for done, (name, positions) in enumerate(parts.items()):
            try:
                sent = self.store(name).send_many([batch[p] for p in positions], now=now)
            except Exception as exc:
                if done == 0:
                    raise  # nothing committed anywhere: the store's own error, as Store.send_many raises it
                raise SendManyError(name, ids, len(batch) - len(ids)) from exc
            ids.update(zip(positions, sent, strict=True))
        return [ids[p] for p in range(len(batch))]

    # delivering
    def deliver_due(self, *, now: datetime | None = None) -> dict[str, int]:
        """`Store.deliver_due` on every store: how many each delivered."""
        return {name: self.store(name).deliver_due(now=now) for name in self.names}

    # consuming
    def pull(self, topic: str, group: str, max_messages: int = 100, **options: Any) -> Pulled:
        """A batch of `topic` for `group` from its first source that read one (the current store first; rows the tag
        filter skipped count: their ack moves the group on); an empty batch from the current store if none did.
        `options`: `Store.pull`'s (tags, start)."""
        first: Pulled | None = None
        for name in self.router.sources(topic):
            pulled = Pulled(name, self.store(name).pull(topic, group, max_messages, **options))
            if pulled.batch:
                return pulled
            first = first or pulled
        assert first is not None
        return first

    def ack(self, pulled: Pulled, failed: set[int] | None = None) -> topics.AckResult:
        return self.store(pulled.store).ack(pulled.batch, failed)

    def release(self, pulled: Pulled) -> None:
        self.store(pulled.store).release(pulled.batch)

    def consume(
        self,
        topic: str,
        group: str,
        handler: Callable[[list[topics.Delivered]], Collection[int] | None],
        **options: Any,
    ) -> dict[str, Any]:
        """`Store.consume` over the topic's sources: returns each source store's `ConsumeTotals` by name. With one
        source (every topic not moving), that store's loop. While the topic moves, one loop per source on a thread
        of its own, its own store's connection, sharing `stop` (an error in one loop sets it, stopping the others,
        then is raised); the handler is called by one loop at a time (a lock), so it need not be thread-safe.
        `limit` needs one source (a loop cannot stop the others at an exact count)."""
        sources = self.router.sources(topic)
        if len(sources) == 1:
            return {sources[0]: self.store(sources[0]).consume(topic, group, handler, **options)}
        if options.get("limit") is not None:
            raise ValueError(
                f"topic {topic!r} is moving ({' and '.join(sources)} hold it): consume it without a limit"
                " (or each store on its own: --store)"
            )
        options["stop"] = options.get("stop") or threading.Event()
        turn = threading.Lock()

        def one_at_a_time(messages: list[topics.Delivered]) -> Collection[int] | None:
            with turn:
                return handler(messages)

        totals: dict[str, Any] = {}
        errors: list[BaseException] = []

        def loop(name: str) -> None:
            try:
                totals[name] = self.store(name).consume(topic, group, one_at_a_time, **options)
            except BaseException as exc:  # raised below, after the other loops were stopped
                errors.append(exc)
                options["stop"].set()

        for name in sources:
            self.store(name)  # opened here, on this thread: the dict is not written by the loops
        threads = [threading.Thread(target=loop, args=(name,), name=f"consume-{name}") for name in sources]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # joined in slices: the calling thread stays free for SIGTERM / SIGINT handlers
                thread.join(0.2)
        if errors:
            raise errors[0]
        return totals

    def messages(self, topic: str, group: str, **options: Any) -> Iterator[topics.Delivered]:
        """`Store.messages` on the topic's store; a moving topic is consumed with `consume` (one loop per source)."""
        sources = self.router.sources(topic)
        if len(sources) > 1:
            raise ValueError(f"topic {topic!r} is moving ({' and '.join(sources)} hold it): use consume()")
        return self.store(sources[0]).messages(topic, group, **options)

    def seek(self, topic: str, group: str, **target: Any) -> dict[str, Seeked]:
        """`Store.seek` in each store that holds `topic` (`sources`), results by store: each store keeps its own
        offsets. A store where the group has no offset on the topic is left out; if none has one, the first store's
        `UnknownOffset` is raised. `to_offset` names a position in one store (each numbers its own rows), so it needs
        a topic held by one store."""
        sources = self.router.sources(topic)
        if target.get("to_offset") is not None and len(sources) > 1:
            raise ValueError(
                f"to_offset names a position in one store, and {topic!r} is held by {' and '.join(sources)}:"
                " seek each store with --store, or seek by time"
            )
        done: dict[str, Seeked] = {}
        unknown: list[UnknownOffset] = []
        for name in sources:
            try:
                done[name] = self.store(name).seek(topic, group, **target)
            except UnknownOffset as exc:
                unknown.append(exc)
        if not done:
            raise unknown[0]
        return done

    # cancelling
    def cancel(
        self,
        *,
        message_id: int | None = None,
        key: str | None = None,
        topic: str | None = None,
        store: str | None = None,
        reason: str = "cancelled",
    ) -> dict[str, list[CancelResult]]:
        """Cancel by id or key, as `Store.cancel` does, in the stores that may hold the message; results by store.

        By id: `store`, or `topic` when the topic has a single source (the same id may name a message in each
        store), or nothing with one store. By key: `store`; else `topic`'s sources; else every store. A topic narrows which stores are asked,
        not which messages: in those stores every pending message with the key is cancelled, whatever its topic
        (as `Store.cancel` does)."""
        if store is not None:
            names: tuple[str, ...] = (store,)
        elif topic is not None:
            names = self.router.sources(topic)
        elif message_id is None or len(self.names) == 1:
            names = self.names
        else:
            names = ()
        if message_id is not None and len(names) != 1:
            where = f"topic {topic!r} is moving ({' and '.join(names)} hold it)" if names else "no topic or store given"
            raise ValueError(f"cancel by id needs the message's store: each store numbers its own messages; {where}")
        return {name: self.store(name).cancel(message_id=message_id, key=key, reason=reason) for name in names}

    # operating
    def stats(self) -> dict[str, dict[str, Any]]:
        """`Store.stats` of every store, by name."""
        return {name: self.store(name).stats() for name in self.names}
