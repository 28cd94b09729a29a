"""`delaywheel` command line: run the embedded database, send, deliver, consume, cancel, inspect."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import getpass
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg

from delaywheel.config import STORE_NAME, ConfigError, format_duration, load_settings, parse_duration
from delaywheel.consume import retry
from delaywheel.consume.tags import parse as parse_tags
from delaywheel.consume.topics import MAX_BATCH, Delivered
from delaywheel.deliver import runner
from delaywheel.dev import embedded
from delaywheel.heap import freeze_after_startup
from delaywheel.lanes import Lane, all_lanes, lane_name
from delaywheel.migrate import MigrationError, migrate
from delaywheel.ops.cancel import KeysFrom
from delaywheel.produce.validation import DLQ_PREFIX, MAX_REQUESTED_LEVEL, RETRY_PREFIX, InvalidMessage
from delaywheel.routing import Router, Stores, home
from delaywheel.store import Store
from delaywheel.types import MAX_ID


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text, "duration")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _moment(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 time, e.g. 2026-11-21T18:30:00+00:00") from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no time zone; add one, e.g. +00:00")
    return moment


def _start(text: str) -> str | datetime:
    """--start: 'earliest', 'latest' or an ISO 8601 time with a zone."""
    return text if text in ("earliest", "latest") else _moment(text)


def _tags(text: str) -> str:
    """--tags: a tag expression, checked while the arguments are parsed (`consume.tags.parse`)."""
    try:
        parse_tags(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _property(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not K=V (a property name, '=', its value)")
    return key, value


def _bounded(low: int, high: int) -> Callable[[str], int]:
    """An argument type: a whole number from `low` to `high`. Anything else is refused while the arguments are parsed,
    with a plain message, before the command connects or says it is ready: a number past what the store's columns
    and parameters hold would otherwise fail in SQL ("bigint out of range")."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {high}")
        return value

    return whole_number


_batch_size = _bounded(1, MAX_BATCH)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 1e9:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


class UsageError(Exception):
    """Bad input found while running a command (a file that cannot be read, a body nested too deep): exit 2."""


def _print(data: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, default=str, indent=2))
    elif isinstance(data, dict):
        for key, value in data.items():
            print(f"{key}: {value}")
    else:
        print(data)


ALL_STORES_ONLY = "--all-stores: only migrate, deliver, stats, retire and group retry-policy take it (a topic command routes by topic)"


def _store_names(args: argparse.Namespace, *, all_stores: bool = False) -> list[str | None]:
    """The stores a command on no topic runs on (docs/stores.md; topic commands route: `_routed`). Without stores
    configured: [None], the one store (the configured URL, else the embedded cluster). With them: `--store NAME`'s;
    else the only one; else, for a command that takes it, every store with `--all-stores`; else an error asking for
    `--store`."""
    if args.all_stores and not all_stores:
        raise UsageError(ALL_STORES_ONLY)
    settings = load_settings()
    names: list[str | None] = [name for name, _ in settings.stores]
    if not names:
        if args.store or args.all_stores:
            raise ConfigError("--store / --all-stores: no stores are configured (DELAYWHEEL_STORES, docs/stores.md)")
        return [None]
    if args.store:
        if args.store not in names:
            raise ConfigError(f"--store {args.store!r}: not a configured store ({', '.join(map(str, names))})")
        return [args.store]
    if len(names) == 1:
        return names
    if args.all_stores and all_stores:
        return names
    raise UsageError(
        f"several stores are configured ({', '.join(map(str, names))}): name one with --store NAME"
        + (" or all with --all-stores" if all_stores else "")
    )


def _routed(args: argparse.Namespace) -> Stores:
    """What a topic command (send, pull, consume, cancel) routes over: with `--store NAME`, that store alone; with
    stores configured, all of them by the routing table; else the one store, named `default`."""
    if args.all_stores:
        raise UsageError(ALL_STORES_ONLY)
    settings = load_settings()
    if args.store or not settings.stores:
        (name,) = _store_names(args)  # --store checked against the configuration; None: the one store
        return Stores([(name or "default", _store_url(name))], settings, routes=())
    return Stores(settings=settings)


def _store_url(name: str | None = None) -> str:
    """Store `name`'s URL (one of `_store_names`); with None, the configured database URL, or with none the embedded
    cluster's (started if need be), said on stderr."""
    settings = load_settings()
    if name is not None:
        return dict(settings.stores)[name]
    url = embedded.database_url(settings)
    if not settings.database_url:
        print(
            f"delaywheel: no database URL configured (DELAYWHEEL_DATABASE_URL): using the embedded cluster, {url}",
            file=sys.stderr,
            flush=True,
        )
    return url


def _store(args: argparse.Namespace) -> Store:
    """The one store a command with no topic runs on (`--store NAME` when several are configured)."""
    (name,) = _store_names(args)
    return Store(_store_url(name))


def cmd_db(args: argparse.Namespace) -> int:
    cluster = embedded.default_cluster()
    if args.action == "start":
        cluster = embedded.start(cluster)
        print(f"running: {cluster.url()} (data in {cluster.data_dir})")
    elif args.action == "stop":
        print(embedded.stop(cluster))
    else:
        state = embedded.status(cluster)
        print(f"{state}: {cluster.url() if state == 'running' else cluster.data_dir}")
        return 0 if state == "running" else 3
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    for name in _store_names(args, all_stores=True):
        url = _store_url(name)
        applied = migrate(url)
        with Store(url) as store:
            store.prepare()
        print((f"{name}: " if name else "") + ("applied: " + ", ".join(applied) if applied else "schema up to date"))
    return 0


def cmd_send(args: argparse.Namespace) -> int:
    try:
        body: Any = args.body.encode() if args.raw else json.loads(args.body)
    except RecursionError:
        raise UsageError("--body is nested too deeply to be a message") from None
    properties = dict(args.property)
    with _routed(args) as stores:
        message_id = stores.send(
            args.topic,
            body,
            delay_level=args.level,
            delay=args.delay_in,
            deliver_at=args.at,
            key=args.key,
            tags=args.tags,
            properties=properties,
        )
        where = {"store": stores.router.store_for(args.topic)} if stores.settings.stores else {}
    _print({"message_id": message_id, **where}, args.json)  # with several stores an id names a message in its store
    return 0


def _progress(totals: runner.RunTotals) -> None:
    print(
        f"delivered {totals.delivered} (cancelled skipped {totals.skipped_cancelled}) in {totals.passes} passes"
        f" ({totals.busy_passes} busy: another deliverer or a cancel held the lane; {totals.waited_passes} waited for"
        f" it) {totals.per_lane}",
        file=sys.stderr,
        flush=True,
    )


def _ready(lanes: list[Lane]) -> None:
    names = ", ".join(lane_name(lane) for lane in lanes)
    print(f"delaywheel deliver: ready (listening, {len(lanes)} lane(s) held: {names})", file=sys.stderr, flush=True)


def _stop_on_signals(stop: threading.Event) -> dict[int, Any]:
    """SIGTERM and SIGINT stop the delivery loop after its current pass (a pass commits or rolls back whole);
    returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for number in (signal.SIGTERM, signal.SIGINT):
        previous[number] = signal.signal(number, lambda *_: stop.set())
    return previous


def _long_running(args: argparse.Namespace) -> None:
    """Before a loop that runs for hours: freeze the start-up heap (heap.py), when this process is the command's own
    (`delaywheel …`, `python -m delaywheel.cli …`), not a program that called `main(argv)` and keeps its own heap."""
    if args.own_process:
        freeze_after_startup()


def cmd_deliver(args: argparse.Namespace) -> int:
    _long_running(args)
    stop = threading.Event()
    previous = _stop_on_signals(stop)
    try:
        return _deliver(args, stop)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _deliver(args: argparse.Namespace, stop: threading.Event) -> int:
    """One delivery loop per store it runs on (`--all-stores`: each store's on a thread of its own, with its own
    connection; a store's lanes and locks are its own, so nothing is shared but the stop)."""
    names = _store_names(args, all_stores=True)
    max_level = load_settings().max_level
    for level in args.level or ():  # refused before any store's loop starts and says it is ready
        if not 1 <= level <= max_level:
            raise UsageError(f"--level {level}: level {level} is not configured (1..{max_level})")
    results: dict[str | None, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def serve(name: str | None) -> None:
        try:
            with Store(_store_url(name)) as store:
                lanes: list[Lane] = list(args.level) if args.level else all_lanes(store.settings, wheel=False)
                if args.command == "advance" or (args.command == "deliver" and not args.level and not args.no_wheel):
                    lanes = [*lanes, None] if args.command == "deliver" else [None]
                totals = runner.run(
                    store,
                    lanes,
                    args.duration.total_seconds(),
                    stop=stop,
                    progress=_progress,
                    progress_every_s=args.progress_every,
                    until_idle=args.until_idle,
                    ready=lambda: _ready(lanes),
                )
        except BaseException as exc:  # raised below, once the other stores' loops were stopped
            errors.append(exc)
            stop.set()
            return
        results[name] = {
            "delivered": totals.delivered,
            "skipped_cancelled": totals.skipped_cancelled,
            "passes": totals.passes,
            "busy_passes": totals.busy_passes,
            "waited_passes": totals.waited_passes,
            "per_lane": totals.per_lane,
            "reconnects": totals.reconnects,
        }

    if len(names) == 1:
        serve(names[0])
    else:
        threads = [threading.Thread(target=serve, args=(name,), name=f"deliver-{name}") for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # joined in slices: the main thread must stay free for SIGTERM / SIGINT
                thread.join(0.2)
    if errors:
        raise errors[0]
    stopped = {"stopped_by_signal": stop.is_set()}
    if names == [None]:
        _print({**results[None], **stopped}, args.json)
    else:
        _print({**{str(name): results[name] for name in names}, **stopped}, args.json)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    with _routed(args) as stores:
        pulled = stores.pull(args.topic, args.group, args.max, tags=args.tags, start=args.start)
        batch = pulled.batch
        acked = stores.ack(pulled) if args.ack else None
        if acked is None:  # printed, not acked: its queues go back to the group at once
            stores.release(pulled)
    rows = [delivered_json(m) for m in batch.messages]
    if args.json:
        _print(rows, True)
    else:
        for row in rows:
            print(f"{row['message_id']}\t{row['topic']}\t{row['key'] or ''}\t{row['delivered_at']}\t{row['body']}")
        skipped = f", {batch.skipped} skipped by --tags" if batch.skipped else ""
        if acked is None:
            print(f"{len(rows)} message(s){skipped} (not acked: pull again to see them again)")
        else:
            already = f", {acked.already_acked} acked already by another consumer" if acked.already_acked else ""
            print(f"{len(rows)} message(s){skipped}, {acked.acked} acked{already}")
    return 0


def delivered_json(m: Delivered) -> dict[str, Any]:
    """A delivered message as `pull --json`, `consume --json` and `dlq list --json` print it: every field of
    `Delivered` and its `idempotency_id`, times in ISO 8601, a body of bytes as text (undecodable bytes replaced)."""
    row: dict[str, Any] = {"message_id": m.message_id, "idempotency_id": m.idempotency_id}
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, bytes):
            value = value.decode(errors="replace")
        row.setdefault(f.name, value)
    return row


def cmd_consume(args: argparse.Namespace) -> int:
    """Wait for the topic's messages, write each (a JSON object per line with --json) and ack a batch once it is
    written and flushed. SIGTERM / SIGINT stop after the batch in hand; a closed pipe stops without acking it."""
    from delaywheel.consume.consumer import Abandon

    _long_running(args)
    stop = threading.Event()
    previous = _stop_on_signals(stop)
    out = sys.stdout

    def handler(messages: list[Any]) -> None:
        try:
            for m in messages:
                row = delivered_json(m)
                if args.json:
                    out.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
                else:
                    out.write(
                        f"{row['message_id']}\t{row['topic']}\t{row['key'] or ''}\t{row['deliver_at']}\t{row['body']}\n"
                    )
            out.flush()  # written before the ack
        except BrokenPipeError:
            stop.set()
            raise Abandon() from None  # the reader went away: nothing acked, the next consumer gets the batch

    try:
        with _routed(args) as stores:  # a moving topic: one loop per store that holds it (routing.Stores.consume)
            by_store = stores.consume(
                args.topic,
                args.group,
                handler,
                max_messages=args.max,
                stop=stop,
                limit=args.count,
                idle_s=args.idle.total_seconds() if args.idle else None,
                duration_s=args.duration.total_seconds() if args.duration else None,
                tags=args.tags,
                start=args.start,
            )
    finally:
        for number, handler_ in previous.items():
            signal.signal(number, handler_)
    if any(totals.stopped_by == "abandon" for totals in by_store.values()):
        with contextlib.suppress(OSError):  # stdout is gone: say nothing more there
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    for name, totals in by_store.items():
        where = f" from store {name}" if stores.settings.stores else ""
        skipped = f", skipped {totals.skipped} (--tags)" if totals.skipped else ""
        print(
            f"delaywheel: consumed {totals.messages} message(s){where} in {totals.batches} batch(es), retried"
            f" {totals.retried}{skipped}; stopped by {'a signal' if totals.stopped_by == 'stop' else totals.stopped_by}",
            file=sys.stderr,
        )
    return 0


def cmd_seek(args: argparse.Namespace) -> int:
    """Move a group's offset on a topic (`Store.seek`), recorded; prints where it moved from and to."""
    target: dict[str, Any] = {"to_time": args.to_time, "to_offset": args.to_offset}
    if args.to_earliest or args.to_latest:
        target["to"] = "earliest" if args.to_earliest else "latest"
    with _routed(args) as stores:
        by_store = stores.seek(args.topic, args.group, by=args.by, **target)
    several = bool(stores.settings.stores)
    rows = [{**({"store": name} if several else {}), **seeked.as_dict()} for name, seeked in by_store.items()]
    if args.json:
        _print(rows if several else rows[0], True)
        return 0
    for name, seeked in by_store.items():
        where = f" in store {name}" if several else ""
        froms = sorted({(b.xid, b.offset) for b, _ in seeked.moves})
        came = " .. ".join(f"(xid {x}, queue_offset {o})" for x, o in (froms[0], froms[-1])[: min(len(froms), 2)])
        to = seeked.moves[0][1]
        print(
            f"group {seeked.group} on {seeked.topic}{where}: moved to {seeked.target}, its {len(seeked.moves)} queues"
            f" from {came} to (xid {to.xid}, queue_offset {to.offset}); recorded as by {seeked.by} at"
            f" {seeked.at.isoformat()}"
        )
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if args.id is not None or args.key is not None:
        with _routed(args) as stores:  # by id: the topic's store (or --store); by key: --topic's stores, else all
            by_store = stores.cancel(message_id=args.id, key=args.key, topic=args.topic, reason=args.reason)
        several = bool(stores.settings.stores)
        results = [
            {"message_id": r.message_id, "outcome": r.outcome, **({"store": name} if several else {})}
            for name, found in by_store.items()
            for r in found
        ]
        _print(results, args.json)
        return 0 if any(r["outcome"] == "cancelled" for r in results) else 1
    keys = None  # a bulk cancel (--where, --keys-from, --keys-from-table): on one store, --store NAME with several
    if args.keys_from:
        try:
            with open(args.keys_from, encoding="utf-8") as lines:
                keys = [line.strip() for line in lines if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--keys-from {args.keys_from}: {_reason(exc)}") from None
    where = args.where if keys is None else None
    keys_from = _keys_from(args)
    with _store(args) as store:
        count = store.count_matching(keys=keys, where=where, keys_from=keys_from)
        if not args.yes:
            print(f"{count} pending message(s) match; run again with --yes to cancel them")
            return 0 if count else 1
        cancelled = store.cancel_matching(keys=keys, where=where, keys_from=keys_from, reason=args.reason)
    _print({"cancelled": cancelled}, args.json)
    return 0 if cancelled else 1


def cmd_dlq(args: argparse.Namespace) -> int:
    """`dlq list GROUP`: the group's dead letters waiting; `dlq redrive GROUP`: send them back to the group
    (docs/dlq.md). On one store (`--store NAME` when several are configured: each store keeps its own)."""
    with _store(args) as store:
        if args.action == "list":
            page = store.dlq(args.group, limit=args.limit)
        else:
            done = store.redrive(
                args.group,
                ids=args.id,
                where=args.where,
                all=args.all,
                by=args.by if args.by is not None else _who(),
                dry_run=args.dry_run,
            )
    if args.action == "list":
        if args.json:
            for m in page.messages:
                print(json.dumps(delivered_json(m), default=str, ensure_ascii=False))
            return 0
        print("message_id\ttopic\tidempotency_id\tattempts\tdead since\tkey\tbody")
        for m in page.messages:
            row = delivered_json(m)
            print(
                f"{m.message_id}\t{m.topic}\t{m.idempotency_id}\t{m.reconsume_times}\t{row['delivered_at']}"
                f"\t{m.key or ''}\t{row['body']}"
            )
        print(f"{page.waiting} dead letter(s) waiting in {DLQ_PREFIX}{page.group}; {len(page.messages)} shown")
        return 0
    if args.json:
        _print(dataclasses.asdict(done), True)
    else:
        verb = "would redrive" if done.dry_run else "redrove"
        record = f" (redrive {done.redrive_id})" if done.redrive_id is not None else ""
        print(f"{verb} {len(done.redriven)} dead letter(s) of group {done.group} to {RETRY_PREFIX}{done.group}{record}")
        for what, ids in (("already redriven", done.already_redriven), ("not in the group's DLQ", done.not_found)):
            if ids:
                print(f"{len(ids)} {what}: {' '.join(map(str, ids))}")
    return 0 if done.redriven else 1


def _who() -> str:
    """Who runs a redrive from the command line, for its record: the operating system's user."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no name for this uid (a container's)
        return f"cli:uid {os.getuid()}"


def _keys_from(args: argparse.Namespace) -> KeysFrom | None:
    """--keys-from-table and its companions as a KeysFrom (looked up in the catalog, values bound)."""
    if args.keys_from_table is None:
        if args.keys_from_column or args.keys_from_filter:
            raise ValueError("--keys-from-column and --keys-from-filter need --keys-from-table")
        return None
    if not args.keys_from_column:
        raise ValueError("--keys-from-table needs --keys-from-column (the column whose text is the key)")
    filters: dict[str, object] = {}
    for text in args.keys_from_filter:
        column, sep, value = text.partition("=")
        if not sep or not column.strip():
            raise ValueError(f"--keys-from-filter {text!r} is not COLUMN=VALUE")
        previous = filters.get(column.strip())
        filters[column.strip()] = (
            value if previous is None else [*(previous if isinstance(previous, list) else [previous]), value]
        )
    return KeysFrom(
        args.keys_from_table,
        args.keys_from_column,
        prefix=args.keys_from_prefix,
        suffix=args.keys_from_suffix,
        filters=filters,
    )


def cmd_stats(args: argparse.Namespace) -> int:
    from delaywheel.ops.stats import as_json  # the web API's JSON form too: numbers as numbers, times as ISO 8601

    names = _store_names(args, all_stores=True)
    figures: dict[str | None, dict[str, Any]] = {}
    for name in names:
        with Store(_store_url(name)) as store:
            figures[name] = store.stats()
    if args.json:  # one store's figures as they are; with --all-stores, by store name
        print(
            json.dumps(
                {str(n): as_json(d) for n, d in figures.items()} if len(names) > 1 else as_json(figures[names[0]]),
                indent=2,
            )
        )
        return 0
    for name, data in figures.items():
        if name is not None:
            print(f"== store {name}")
        _print_stats(data)
    return 0


def _print_stats(data: dict[str, Any]) -> None:
    print(f"as of {data['now']:%Y-%m-%d %H:%M:%S} UTC")
    if data.get("unserved"):  # a message due and no live deliverer: nothing delivers these lanes until one starts
        print(f"UNSERVED: {', '.join(data['unserved'])}: messages due and no live deliverer")
    for row in data.get("horizon_holders", []):  # every lane and consumer waits for these transactions to end
        age = (
            f"open {_num(row['age_s'])} s" if row["age_s"] is not None else "open since when: not visible to this role"
        )
        print(
            f"HOLDING DELIVERY BACK: session {row['pid']} (role {row['role']}, application"
            f" {row['application_name'] or '-'}, from {row['client_addr'] or 'local'}, {row['state'] or '?'}):"
            f" {age}, {row['xids_since']} transactions since"
        )
    if data.get("public_connect"):
        print("WARNING: any login may connect to this database (PUBLIC has CONNECT): see docs/operations.md, Roles")
    print(
        f"{'level':>5} {'delay':>8} {'backlog':>8} {'checkpoint':>10} {'head due':>27} {'lag s':>9} {'p50 s':>7} {'p99 s':>7}"
    )
    for row in data["levels"]:
        print(
            f"{row['level']:>5} {row['delay'] if row['delay'] is not None else 'removed':>8} {row['backlog']:>8} {row['checkpoint_id']:>10} "
            f"{row['head_due'] or '-'!s:>27} {_num(row['lag_s']):>9} "
            f"{_num(row['lateness_p50_s']):>7} {_num(row['lateness_p99_s']):>7}"
        )
    w = data["wheel"]
    print(
        f"\nwheel: pending {w['pending']} (overdue {w['overdue']}, next minute {w['next_minute']}, hour {w['next_hour']},"
        f" day {w['next_day']}, later {w['later']}), lag {_num(w['lag_s'])} s,"
        f" last pass {_num(w['since_last_pass_s'])} s ago (cursor {w['cursor_at']}, slot {w['cursor_slot']}),"
        f" lateness p50 {_num(w['lateness_p50_s'])} s p99 {_num(w['lateness_p99_s'])} s"
    )
    if w["estimated_after"] is not None:
        print(f"  (near-wheel counts after {w['estimated_after']:%Y-%m-%d %H:%M} UTC are the statistics' estimates)")
    biggest = max((bucket["due"] for bucket in w["histogram_24h"]), default=0)
    for bucket in w["histogram_24h"]:
        print(
            f"  due {bucket['start']:%m-%d %H:%M}-{bucket['end']:%H:%M}  {bucket['due']:>9}  "
            f"{'#' * (60 * bucket['due'] // biggest if biggest else 0)}"
        )
    print("\ntopic / group: depth, lag")
    for row in data["topics"]:
        print(
            f"  {row['topic']} / {row['consumer_group'] or '-'}: depth {row['depth']}, lag {row['lag'] if row['lag'] is not None else '-'}"
        )
    if data["retired_unread"]:  # topic rows retention dropped before these groups read them
        print("\nDROPPED UNREAD by retention (topic / group: rows in all, partitions, the last drop)")
        for row in data["retired_unread"]:
            print(
                f"  {row['topic']} / {row['consumer_group']}: {row['dropped']} rows in {row['partitions']} partition(s);"
                f" last {row['last_dropped']} rows of {row['last_partition']} at {row['last_dropped_at']:%Y-%m-%d %H:%M:%S} UTC"
            )
    for name, what in (("quarantine", "bulk-enqueue rows refused"), ("set_aside", "messages set aside, undeliverable")):
        part = data[name]
        reasons = ", ".join(f"{r['reason']} {r['count']}" for r in part["by_reason"])
        print(f"\n{name}: {part['total']} {what}" + (f" ({reasons})" if reasons else ""))
        for row in part["recent"]:
            where = (
                f"{row['source_file']} row {row['row_number']}"
                if name == "quarantine"
                else f"message {row['message_id']} ({row['lane']}, topic {row['topic']})"
            )
            print(
                f"  {row.get('quarantined_at') or row.get('set_aside_at')}  {where}: {row['reason']}: {row['detail']}"
            )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def cmd_route(args: argparse.Namespace) -> int:
    """Where each topic goes and which stores hold it (the configuration only, no database). With `--adding NAME`:
    the topics the new store would take, each with the route that keeps it where it is (docs/stores.md)."""
    settings = load_settings()
    router = Router.configured(settings)
    if args.adding is not None and (not STORE_NAME.fullmatch(args.adding) or args.adding in router.names):
        raise UsageError(
            f"--adding {args.adding!r}: not a new store's name (a lower-case identifier, not one of"
            f" {', '.join(router.names)})"
        )
    rows = []
    for topic in args.topic:
        sources = router.sources(topic)  # the current store first (a retry / DLQ topic: every store)
        row: dict[str, Any] = {"topic": topic, "store": sources[0], "sources": list(sources)}
        if args.adding and topic not in router.routes and home(topic, [*router.names, args.adding]) == args.adding:
            row["moves_to"], row["pin"] = args.adding, f"{topic}={row['store']}"
        rows.append(row)
    if args.json:
        _print(rows, True)
        return 0
    for row in rows:  # topic, the stores that hold it (the current one first), what --adding would do
        moving = f"\tmoves to {row['moves_to']} (pin: {row['pin']})" if "moves_to" in row else ""
        print(f"{row['topic']}\t{' '.join(row['sources'])}{moving}")
    return 0


def _delays(text: str) -> list[timedelta]:
    try:
        return retry.parse_delays(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_retry_policy(args: argparse.Namespace) -> int:
    """Show a group's retry policy, set it (--max-attempts, --delays: the whole policy) or clear it (--clear), on the
    one store (--store NAME with several) or every store (--all-stores); then print it as it now stands. Exit 1: a
    --clear that found no policy."""
    setting = args.max_attempts is not None or args.delays is not None
    if args.clear and setting:
        raise UsageError("--clear takes neither --max-attempts nor --delays")
    rows, cleared = [], []
    for name in _store_names(args, all_stores=True):
        with Store(_store_url(name)) as store:
            if setting:
                store.set_retry_policy(args.group, max_attempts=args.max_attempts, delays=args.delays)
            elif args.clear:
                cleared.append(store.clear_retry_policy(args.group))
            policy = store.retry_policy(args.group)
            row = _policy_row(args.group, policy, retry.schedule(policy, store.settings))
            rows.append({**({"store": name} if name else {}), **row})
    if args.json:
        _print(rows if len(rows) > 1 else rows[0], True)
    for row in [] if args.json else rows:
        where = f"store {row['store']}: " if "store" in row else ""
        stored = row["policy"]
        if stored is None:
            print(f"{where}group {row['group']}: no retry policy: RocketMQ's ladder (retry n after delay level 2 + n)")
        else:
            attempts = "default (max_reconsume_times)" if stored["max_attempts"] is None else stored["max_attempts"]
            delays = "the ladder" if stored["delays"] is None else ",".join(stored["delays"])
            print(f"{where}group {row['group']}: max attempts {attempts}, delays {delays} (set {stored['updated_at']})")
        retries = "; ".join(row["retries"])
        print(f"  {len(row['schedule'])} retries{': ' + retries if retries else ''}; then {row['dead_letter_topic']}")
    return 1 if args.clear and not any(cleared) else 0


def _policy_row(group: str, policy: retry.RetryPolicy | None, schedule: list[timedelta]) -> dict[str, Any]:
    """A group's policy as stored (None: none) and the delays before each retry a failed message gets."""
    stored = None
    if policy is not None:
        stored = {
            "max_attempts": policy.max_attempts,
            "delays": None if policy.delays is None else [format_duration(d) for d in policy.delays],
            "updated_at": policy.updated_at.isoformat() if policy.updated_at else None,
        }
    return {
        "group": group,
        "policy": stored,
        "schedule": [format_duration(d) for d in schedule],
        "retries": retry.describe(schedule),
        "dead_letter_topic": retry.dlq_topic(group),
    }


def cmd_retire(args: argparse.Namespace) -> int:
    """Drop drained partitions; says which, and the rows of each that a consumer group had not read (a topic partition
    past the retention floor goes read or not: docs/operations.md, "Rows retention drops unread")."""
    for name in _store_names(args, all_stores=True):
        with Store(_store_url(name)) as store:
            dropped = store.retire()
        report = {**({"store": name} if name else {}), "dropped": [f"{d.name} ({d.rows} rows)" for d in dropped]}
        unread = [
            {"partition": d.name, "topic": u.topic, "consumer_group": u.group, "rows": u.rows}
            for d in dropped
            for u in d.unread
        ]
        if args.json:
            _print({**report, "dropped_unread": unread}, True)
            continue
        _print(report, False)
        for row in unread:
            print(
                f"DROPPED UNREAD: {row['rows']} rows of topic {row['topic']!r} that group {row['consumer_group']!r}"
                f" had not read ({row['partition']})"
            )
    return 0


# `delaywheel shop` and `delaywheel demo` name commands of the order-timeout example, which lives beside the library
# (examples/shop): the example's own command to run instead.
MOVED = {"shop": [], "demo": ["demo"]}


def cmd_moved(args: argparse.Namespace) -> int:
    """`delaywheel shop …` and `delaywheel demo …`: the example application's own commands, not the library's
    (which does not import it); says the command to run instead, exit 2."""
    store = ["--store", args.store] if args.store else []
    instead = shlex.join(["python", "-m", "delaywheel_shop", *store, *MOVED[args.command], *args.rest])
    print(
        f"delaywheel: error: `delaywheel {args.command}` moved to the example application: {instead}",
        file=sys.stderr,
    )
    return 2


def _subscribe_arguments(p: argparse.ArgumentParser) -> None:
    """pull's and consume's --tags and --start."""
    p.add_argument(
        "--tags",
        type=_tags,
        metavar="EXPR",
        help="only messages with one of these tags, 'TAG1 || TAG2' ('*': all, the default); the others are skipped"
        " and passed by the group's offset",
    )
    p.add_argument(
        "--start",
        type=_start,
        default="earliest",
        metavar="WHERE",
        help="a group with no offset on the topic yet starts at: earliest (every message kept, the default), latest"
        " (messages delivered from now) or an ISO 8601 time with a zone (the first message delivered at or after it)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="delaywheel", description=__doc__)
    which = parser.add_mutually_exclusive_group()  # several stores (DELAYWHEEL_STORES, docs/stores.md)
    which.add_argument(
        "--store",
        metavar="NAME",
        help="run on this configured store (default: the topic's store;"
        " commands on no topic need it when several stores are configured)",
    )
    which.add_argument(
        "--all-stores", action="store_true", help="migrate, deliver, stats, retire: every configured store"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("db", help="the embedded PostgreSQL cluster (used when no DELAYWHEEL_DATABASE_URL is set)")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.set_defaults(func=cmd_db)

    p = sub.add_parser("migrate", help="apply the store's SQL migrations")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("send", help="send one message")
    p.add_argument("--topic", required=True)
    p.add_argument("--body", required=True, help="JSON text (or any text with --raw)")
    p.add_argument("--raw", action="store_true", help="send --body as bytes, not JSON")
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--level",
        type=_bounded(0, MAX_REQUESTED_LEVEL),
        help="RocketMQ delay level (0 = now; above the maximum is clamped)",
    )
    when.add_argument("--in", dest="delay_in", type=_duration, help="deliver after this long, e.g. 90s, 30m, 2d")
    when.add_argument("--at", type=_moment, help="deliver at this ISO 8601 time with a zone")
    p.add_argument("--key")
    p.add_argument("--tags")
    p.add_argument("--property", action="append", default=[], metavar="K=V", type=_property)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_send)

    for name, text in (
        ("deliver", "deliver due messages on levels and the wheel"),
        ("advance", "advance the timing wheel"),
    ):
        p = sub.add_parser(name, help=text)
        if name == "deliver":
            p.add_argument(
                "--level",
                type=_bounded(1, MAX_REQUESTED_LEVEL),
                action="append",
                help="only this level (repeatable; a configured one); default all + wheel",
            )
            p.add_argument("--no-wheel", action="store_true", help="levels only")
        p.add_argument(
            "--duration", type=_duration, default=timedelta(seconds=60), help="how long to run (default 60s)"
        )
        p.add_argument("--until-idle", action="store_true", help="stop early once nothing is pending")
        p.add_argument("--progress-every", type=_seconds, default=10.0, metavar="SECONDS")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_deliver, level=None, no_wheel=False)

    p = sub.add_parser("pull", help="pull a batch for a consumer group")
    p.add_argument("--topic", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--max", type=_batch_size, default=100, help=f"at most this many messages (1..{MAX_BATCH})")
    p.add_argument("--ack", action="store_true", help="commit the group's offset after printing")
    _subscribe_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("consume", help="wait for a topic's messages, print them (or pipe them: --json) and ack")
    p.add_argument("--topic", required=True)
    p.add_argument("--group", required=True)
    p.add_argument(
        "--max", type=_batch_size, default=100, help=f"messages per batch, acked together (1..{MAX_BATCH}; default 100)"
    )
    p.add_argument("--count", type=_bounded(1, MAX_ID), help="stop after this many messages")
    p.add_argument("--duration", type=_duration, help="stop after this long, e.g. 30s (default: until SIGTERM)")
    p.add_argument("--idle", type=_duration, help="stop once no message came for this long")
    _subscribe_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_consume)

    p = sub.add_parser(
        "seek", help="move a consumer group's offset on a topic (rewind to read again, or skip ahead); recorded"
    )
    p.add_argument("topic")
    p.add_argument("group")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument(
        "--to-time", type=_moment, metavar="ISO", help="the first message delivered at or after this time (with a zone)"
    )
    to.add_argument(
        "--to-offset", type=_bounded(0, MAX_ID), metavar="N", help="the first message at or past queue_offset N"
    )
    to.add_argument("--to-earliest", action="store_true", help="the earliest message kept")
    to.add_argument("--to-latest", action="store_true", help="after the last message delivered (skip them all)")
    p.add_argument("--by", metavar="TEXT", help="who or why, recorded with the seek (default: the database role)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_seek)

    p = sub.add_parser("cancel", help="cancel pending messages by id, key, key list or SQL predicate")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--id", type=_bounded(1, MAX_ID))
    what.add_argument("--key")
    what.add_argument(
        "--where",
        help="one expression over the pending messages' id, deliver_at, key, topic, tags,"
        " properties, lane, level: comparisons, AND/OR/NOT, IN lists, LIKE, BETWEEN, IS NULL, casts and"
        " pure functions such as lower() or now(); checked before it runs, no subqueries (README)",
    )
    what.add_argument(
        "--keys-from-table",
        metavar="SCHEMA.TABLE",
        help="cancel every pending message whose key is a value of --keys-from-column in this table",
    )
    what.add_argument("--keys-from", metavar="FILE", help="cancel every pending message whose key is a line of FILE")
    p.add_argument(
        "--topic",
        help="with --id or --key: the message's topic, whose store is asked (several stores:"
        " --id needs it or --store; --key without it asks every store)",
    )
    p.add_argument("--keys-from-column", metavar="COLUMN", help="with --keys-from-table: the column holding the keys")
    p.add_argument(
        "--keys-from-prefix", default="", metavar="TEXT", help="with --keys-from-table: key = TEXT || column"
    )
    p.add_argument(
        "--keys-from-suffix", default="", metavar="TEXT", help="with --keys-from-table: key = column || TEXT"
    )
    p.add_argument(
        "--keys-from-filter",
        action="append",
        default=[],
        metavar="COLUMN=VALUE",
        help="with --keys-from-table: only rows where COLUMN = VALUE (repeatable; one column twice: IN)",
    )
    p.add_argument("--reason", default="cancelled by CLI")
    p.add_argument("--yes", action="store_true", help="confirm a bulk cancel (without it: only count)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("dlq", help="a consumer group's dead letters: list them, redrive them to the group")
    dlq = p.add_subparsers(dest="action", required=True)
    q = dlq.add_parser("list", help="the group's dead letters waiting (not redriven), oldest first")
    q.add_argument("group", metavar="GROUP")
    q.add_argument("--limit", type=_bounded(1, MAX_ID), default=100, help="show at most this many (default 100)")
    q.add_argument("--json", action="store_true", help="one object per line, as pull and consume print messages")
    q.set_defaults(func=cmd_dlq)
    q = dlq.add_parser("redrive", help="send dead letters back to the group as fresh retries, each once")
    q.add_argument("group", metavar="GROUP")
    which_letters = q.add_mutually_exclusive_group(required=True)
    which_letters.add_argument("--all", action="store_true", help="every dead letter waiting")
    which_letters.add_argument(
        "--id",
        type=_bounded(1, MAX_ID),
        nargs="+",
        action="extend",
        metavar="ID",
        help="these dead letters (their message_id, as `dlq list` shows it)",
    )
    which_letters.add_argument(
        "--where",
        help="the dead letters meeting one expression over message_id, idempotency_id, topic, queue_offset, key,"
        " tags, properties, reconsume_times, deliver_at, delivered_at (checked as cancel --where is)",
    )
    q.add_argument("--dry-run", action="store_true", help="only say what would be redriven")
    q.add_argument("--by", metavar="TEXT", help="who asks, for the record (default: cli:<your user name>)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_dlq, all=False)

    p = sub.add_parser("stats", help="backlog, checkpoints, wheel horizons, topics and lateness")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser(
        "route", help="the store of each topic (several stores); --adding NAME: the topics it would take"
    )
    p.add_argument("--topic", action="append", required=True, help="a topic (repeatable)")
    p.add_argument("--adding", metavar="NAME", help="a store about to be added: which of the topics would move to it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("group", help="a consumer group's settings")
    groups = p.add_subparsers(dest="group_command", required=True)
    p = groups.add_parser(
        "retry-policy",
        help="show a group's retry policy; --max-attempts / --delays set it (the whole policy), --clear removes it",
    )
    p.add_argument("group")
    p.add_argument(
        "--max-attempts",
        type=_bounded(0, retry.MAX_RETRY_ATTEMPTS),
        help="retries a failed message gets before the group's dead-letter topic"
        f" (0..{retry.MAX_RETRY_ATTEMPTS}; default: max_reconsume_times)",
    )
    p.add_argument(
        "--delays",
        type=_delays,
        metavar="4m,10m,1h",
        help="the delay before each retry, the last repeated (default: RocketMQ's ladder)",
    )
    p.add_argument("--clear", action="store_true", help="remove the group's policy (RocketMQ's ladder again)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_retry_policy)

    p = sub.add_parser("retire", help="drop drained partitions (maintenance)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_retire)

    for name in MOVED:  # any arguments (taken as given by `run`), to be named in the pointer
        p = sub.add_parser(name, add_help=False, help="moved: python -m delaywheel_shop (examples/shop)")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=cmd_moved)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None, *, migrate: str = "delaywheel migrate") -> int:
    """Parse `argv` (None: this process's arguments) and run the command it names (`args.func`), reporting what goes
    wrong as one line on stderr, prefixed with the parser's `prog`, exit 2 (no traceback). An application's own
    command line calls it with its own parser, and `migrate`, the command an unmigrated database calls for (the
    shop example's `python -m delaywheel_shop`)."""
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "func", None) is cmd_moved:  # its arguments as given, whatever they are, in their order
        given = sys.argv[1:] if argv is None else argv
        at = next(i for i, word in enumerate(given) if word == args.command and given[i - 1 : i] != ["--store"])
        args.rest = given[at + 1 :]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.own_process = argv is None  # the console script and `python -m delaywheel.cli` pass none
    prog = parser.prog
    try:
        load_settings()
        return int(args.func(args))
    except json.JSONDecodeError as exc:
        print(f"{prog}: error: --body is not JSON ({exc}); use --raw to send text as bytes", file=sys.stderr)
        return 2
    except (InvalidMessage, ConfigError, MigrationError, embedded.EmbeddedError, UsageError, ValueError) as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName, psycopg.errors.UndefinedFunction) as exc:
        # an unmigrated database: a table, the schema or one of its functions is missing
        print(
            f"{prog}: database error: {_one_line(exc)} (is the schema migrated? `{migrate}`)",
            file=sys.stderr,
        )
        return 2
    except psycopg.Error as exc:  # e.g. a --where predicate that is not valid SQL, or an unreachable server
        print(f"{prog}: database error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder the command needs
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: still no traceback for the user unless asked for
        if os.environ.get("DELAYWHEEL_TRACEBACK"):
            raise
        print(
            f"{prog}: internal error: {type(exc).__name__}: {_one_line(exc)} (set DELAYWHEEL_TRACEBACK=1 to see where)",
            file=sys.stderr,
        )
        return 2


def _reason(exc: BaseException) -> str:
    """An OSError's reason without its errno prefix, e.g. 'No such file or directory'."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


def _one_line(exc: BaseException) -> str:
    """The error's first line: PostgreSQL's messages carry LINE / DETAIL / HINT lines after it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
