"""The shop's own command line, `python -m delaywheel_shop` (`make demo` runs `demo`): the order-timeout story end to
end, its continuous parts one process each (`sweep`, `customers`), and its schema (`migrate`).

Built on the library's command line (`delaywheel.cli`): a command picks its store (`--store NAME` when several are
configured), stops on SIGTERM / SIGINT and reports a failure as one line on stderr, exit 2, as `delaywheel`'s do. The
library knows nothing of this package.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from delaywheel import cli
from delaywheel.consume.topics import MAX_BATCH
from delaywheel.store import Store

PROG = "python -m delaywheel_shop"
MIGRATE = f"{PROG} migrate"
# The most orders the demo places (its stock per product is an int4 column).
MAX_DEMO_ORDERS = 10_000_000


def cmd_migrate(args: argparse.Namespace) -> int:
    """The store's migrations, then the shop's own line (`delaywheel_shop/migrations/`)."""
    from delaywheel_shop import schema

    (name,) = cli._store_names(args)
    url = cli._store_url(name)
    applied = schema.migrate(url)
    with Store(url) as store:
        store.prepare()
    print("applied: " + ", ".join(applied) if applied else "schema up to date")
    return 0


def cmd_part(args: argparse.Namespace) -> int:
    """The story's continuous parts, one process each (as `make demo` runs them): `sweep` (the waiting consumer that
    cancels unpaid orders at their deadline) and `customers` (the simulated customers). Each says on stderr when it
    is ready; SIGTERM / SIGINT stop it after the batch or tick in hand (exit 0)."""
    from delaywheel_shop import orders

    cli._long_running(args)
    stop = threading.Event()
    previous = cli._stop_on_signals(stop)

    def ready() -> None:
        print(f"delaywheel_shop {args.command}: ready", file=sys.stderr, flush=True)

    try:
        with cli._store(args) as store:
            if args.command == "sweep":
                totals, consumed = orders.run_sweep(store, stop=stop, max_messages=args.batch, ready=ready)
                result: dict[str, Any] = {
                    "batches": totals.batches,
                    "messages": totals.messages,
                    "cancelled": totals.cancelled,
                    "already_processed": totals.duplicates,
                    # how the consumer waited: woken by a delivery, pulls again of rows not yet readable (the
                    # commit horizon), pulls after the safety wake
                    "notified_wakes": consumed.notified_wakes,
                    "repulls": consumed.repulls,
                    "safety_wakes": consumed.safety_wakes,
                    "stopped_by": consumed.stopped_by,
                }
            else:
                result = orders.run_customers(store, stop=stop, every_s=args.every, ready=ready)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    cli._print(result, args.json)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from delaywheel_shop.demo import run_demo

    return run_demo(args.orders, timeout=args.timeout, period=args.period, json_output=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--store",
        metavar="NAME",
        help="sweep, customers, migrate: run on this configured store (when several are configured)",
    )
    parser.set_defaults(all_stores=False)  # the library's store choice (cli._store_names) reads it
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the order-timeout story end to end (`make demo`, the README's first command)")
    p.add_argument(
        "--orders",
        type=cli._bounded(1, MAX_DEMO_ORDERS),
        default=100_000,
        help=f"how many orders to place (1..{MAX_DEMO_ORDERS}; default 100000)",
    )
    p.add_argument("--timeout", default="20s", help="payment timeout (production: 30m; default 20s for the demo)")
    p.add_argument("--period", default="30s", help="place the orders over this long (default 30s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("sweep", help="cancel unpaid orders as their timeouts are delivered (a waiting consumer)")
    p.add_argument(
        "--batch", type=cli._batch_size, default=1000, help=f"timeouts per transaction (1..{MAX_BATCH}; default 1000)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_part)

    p = sub.add_parser("customers", help="simulated customers: pay or cancel as their plans fall due")
    p.add_argument("--every", type=cli._seconds, default=0.1, metavar="SECONDS", help="tick (default 0.1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_part)

    p = sub.add_parser("migrate", help="apply the store's migrations, then the shop's own (its schema `shop`)")
    p.set_defaults(func=cmd_migrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser(), argv, migrate=MIGRATE)


if __name__ == "__main__":
    sys.exit(main())
