"""Issue 18, finding 1: no text from a caller or a form becomes more than one read-only boolean expression (or a
value, or a quoted identifier). Each attack below ran SQL of the caller's choosing on the old main."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaywheel import Settings, Store
from delaywheel.batch.inputs import NotAllowed, check_input, check_source
from delaywheel.batch.reconcile import Reconcile
from delaywheel.cli import main
from delaywheel.ops.cancel import read_only
from delaywheel.ops.predicate import CANCEL_COLUMNS, UnsafeSQL, check_expression, check_query
from delaywheel.produce.validation import Message


@pytest.fixture
def cli(store: Store, db_url: str, t0: datetime, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A store with pending messages and a table to lose, reachable by the CLI."""
    monkeypatch.setenv("DELAYWHEEL_DATABASE_URL", db_url)
    store.send_many([Message("orders", {"i": i}, key=f"k{i}", delay=timedelta(hours=1)) for i in range(3)], now=t0)
    store.conn.execute("CREATE TABLE public.victim (x int)")
    return store


def _victim(store: Store) -> object:
    return store.conn.execute("SELECT to_regclass('public.victim')").fetchone()[0]  # type: ignore[index]


@pytest.mark.parametrize("yes", [[], ["--yes"]])
def test_cli_where_cannot_drop_a_table(cli: Store, yes: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cancel", "--where", "true); DROP TABLE public.victim; --", *yes]) == 2
    assert "not valid SQL" in capsys.readouterr().err
    assert _victim(cli) == "victim"
    assert cli.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone() == (0,)


def test_cli_where_cannot_run_a_program(cli: Store, tmp_path: Path) -> None:
    marker = tmp_path / "x"
    assert main(["cancel", "--yes", "--where", f"true); COPY (SELECT 1) TO PROGRAM 'id > {marker}'; --"]) == 2
    assert (
        main(
            [
                "cancel",
                "--yes",
                "--where",
                f"key IN (SELECT 1 FROM (SELECT 1) s) OR true; COPY (SELECT 1) TO PROGRAM 'id > {marker}'",
            ]
        )
        == 2
    )
    assert not marker.exists()


def test_cli_where_commit_trick_drops_nothing(cli: Store) -> None:
    cli.conn.execute("CREATE TABLE public.t (x int)")
    assert main(["cancel", "--yes", "--where", "true); DROP TABLE public.t; COMMIT; SELECT 1/0; --"]) == 2
    assert cli.conn.execute("SELECT to_regclass('public.t')").fetchone() == ("t",)


def test_cli_where_cannot_read_a_file(cli: Store, capsys: pytest.CaptureFixture[str]) -> None:
    hostname = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").exists() else None
    assert main(["cancel", "--where", "pg_read_file('/etc/hostname')::int = 1"]) == 2
    err = capsys.readouterr().err
    assert "pg_read_file() is not allowed" in err
    if hostname:
        assert hostname not in err


HOSTILE = [
    ("key IN (SELECT id::text FROM shop.orders)", "subquery"),
    ("EXISTS (SELECT 1)", "subquery"),
    ("key = 'a'; DROP TABLE public.victim", "2 statements"),
    ("true FROM pg_authid", "fromClause"),
    ("set_config('statement_timeout', '0', false) = ''", "set_config()"),
    ("pg_sleep(10) IS NULL", "pg_sleep()"),
    ("lo_import('/etc/passwd') > 0", "lo_import()"),
    ("query_to_xml('DROP TABLE public.victim', true, true, '') IS NULL", "query_to_xml()"),
    ("current_setting('data_directory') = key", "current_setting()"),
    ("pg_catalog.pg_read_file('/etc/hostname') = key", "pg_read_file()"),
    ("public.anything(key)", "public.anything()"),
    ("key = 'a' OR xmin::text = '1'", "xmin"),
    ("ctid IS NOT NULL", "ctid"),
    ("'public.victim'::regclass IS NOT NULL", "regclass"),
    ("key OPERATOR(public.=) 'a'", "operator"),
    ("current_user = 'postgres'", "CURRENT_USER"),
    ("$1 = key", "parameter"),
    ("count(*) > 0", "count()"),
    ("key = $$a'$$; DROP TABLE public.victim", "2 statements"),
    ("", "empty"),
]


@pytest.mark.parametrize(("where", "named"), HOSTILE)
def test_hostile_predicates_are_refused_with_their_construct(cli: Store, where: str, named: str) -> None:
    for call in (cli.count_matching, cli.cancel_matching):
        with pytest.raises(UnsafeSQL) as refused:
            call(where=where)
        assert named in str(refused.value)
    assert _victim(cli) == "victim"
    assert cli.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone() == (0,)


def test_what_runs_is_rendered_from_the_parse_tree() -> None:
    rendered = check_expression(
        "key = 'a''b' /* note */ AND properties->>'x' LIKE '5%' -- end", CANCEL_COLUMNS, qualifier="p"
    )
    assert rendered == "p.key = 'a''b' AND p.properties ->> 'x' LIKE '5%'"
    assert check_expression("p.topic = 'x'", CANCEL_COLUMNS, qualifier="p") == "p.topic = 'x'"
    with pytest.raises(UnsafeSQL, match=r"column 'q\.topic'"):
        check_expression("q.topic = 'x'", CANCEL_COLUMNS, qualifier="p")


def test_matching_reads_read_only_with_a_timeout(store: Store) -> None:
    conn = store.conn
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction), read_only(conn, timedelta(seconds=5)):
        conn.execute("CREATE TABLE public.nope (x int)")
    with pytest.raises(psycopg.errors.QueryCanceled), read_only(conn, timedelta(milliseconds=50)):
        conn.execute("SELECT pg_sleep(2)")
    assert conn.execute(
        "SELECT current_setting('statement_timeout'), current_setting('transaction_read_only')"
    ).fetchone() == ("0", "off")
    with conn.transaction():  # inside a caller's transaction: the timeout only, restored afterwards
        conn.execute("SET LOCAL statement_timeout = '7s'")
        with read_only(conn, timedelta(seconds=3)):
            assert conn.execute("SELECT current_setting('statement_timeout')").fetchone() == ("3s",)
        assert conn.execute("SELECT current_setting('statement_timeout')").fetchone() == ("7s",)
        conn.execute("CREATE TABLE public.allowed (x int)")


# Tokens an attacker would combine: quotes, comments, statement breaks, functions that read or write.
_TOKENS = st.sampled_from(
    [
        "key",
        "p.key",
        "topic",
        "id",
        "xmin",
        "properties",
        "->>",
        "'a'",
        "'",
        "''",
        '"',
        "$$",
        "$1",
        "1",
        "=",
        "<>",
        "(",
        ")",
        ";",
        "--",
        "/*",
        "*/",
        "AND",
        "OR",
        "NOT",
        "IN",
        "LIKE",
        "IS",
        "NULL",
        "SELECT",
        "FROM",
        "WHERE",
        "pg_read_file('/etc/hostname')",
        "DROP TABLE public.victim",
        "COMMIT",
        "COPY (SELECT 1) TO PROGRAM 'id'",
        "set_config('a.b', 'c', false)",
        "lower(key)",
        "now()",
        "::int",
        "::regclass",
        ",",
        "E'\\''",
        "\n",
        "true",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_TOKENS, min_size=1, max_size=12).map(" ".join))
def test_random_text_runs_only_as_a_checked_expression(cli: Store, text: str) -> None:
    try:
        rendered = check_expression(text, CANCEL_COLUMNS, qualifier="p")
    except UnsafeSQL:
        rendered = None
    if rendered is not None:  # accepted: it must be exactly one checked expression again
        assert check_expression(rendered, CANCEL_COLUMNS, qualifier="p") == rendered
    try:
        cli.count_matching(where=text)
    except UnsafeSQL:
        assert rendered is None
    except (psycopg.DataError, psycopg.ProgrammingError):
        assert rendered is not None  # e.g. a type mismatch: the server refused a checked expression
    assert _victim(cli) == "victim"
    assert cli.conn.execute("SELECT count(*) FROM delaywheel.cancellations").fetchone() == (0,)
    assert cli.conn.execute("SELECT current_setting('transaction_read_only')").fetchone() == ("off",)


_QUERY_TOKENS = st.sampled_from(
    [
        "SELECT",
        "1",
        "'k'",
        "AS",
        "key",
        "FROM",
        "public.victim",
        "pg_authid",
        "v",
        "WHERE",
        "x",
        "=",
        "(",
        ")",
        ";",
        ",",
        "--",
        "/*",
        "*/",
        "WITH",
        "d",
        "DELETE",
        "INSERT INTO public.victim VALUES (1)",
        "DROP TABLE public.victim",
        "RETURNING",
        "*",
        "INTO",
        "FOR UPDATE",
        "UNION",
        "ALL",
        "generate_series(1, 3)",
        "g",
        "nextval('s')",
        "pg_read_file('/etc/hostname')",
        "COMMIT",
        "count(*)",
        "ORDER BY",
        "LIMIT",
        "'",
        "$$",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_QUERY_TOKENS, min_size=1, max_size=14).map(" ".join))
def test_random_queries_run_only_as_a_checked_select(cli: Store, text: str) -> None:
    try:
        rendered = check_query(text)
    except UnsafeSQL:
        return
    assert check_query(rendered) == rendered
    try:
        with read_only(cli.conn, timedelta(seconds=5)):
            cli.conn.execute(rendered).fetchall()  # type: ignore[arg-type]
    except (psycopg.DataError, psycopg.ProgrammingError):
        pass  # a checked SELECT the server refused (an unknown column, a type mismatch)
    assert _victim(cli) == "victim"
    assert cli.conn.execute("SELECT count(*) FROM public.victim").fetchone() == (0,)


# --- reconcile ------------------------------------------------------------------------------------------


@pytest.fixture
def business(store: Store) -> Store:
    store.conn.execute("CREATE SCHEMA biz")
    store.conn.execute("CREATE TABLE biz.orders (id bigint PRIMARY KEY, status text, deadline timestamptz)")
    store.conn.execute("CREATE TABLE public.victim (x int)")
    return store


@pytest.mark.parametrize(
    "fields",
    [
        {"predicate": "true) OR (SELECT count(*) FROM pg_authid) > 0 OR (true"},
        {"predicate": "status = 'pending')); DROP TABLE public.victim; --"},
        {"predicate": "pg_read_file('/etc/hostname') = status"},
        {"table": "biz.orders b; DROP TABLE public.victim; --"},
        {"table": "pg_catalog.pg_authid"},
        {"key_column": "id::text FROM pg_authid --"},
        {"due_column": "deadline FROM pg_authid --"},
    ],
)
def test_hostile_reconcile_fields_are_refused(business: Store, fields: dict[str, str]) -> None:
    job = {
        "table": "biz.orders",
        "key_column": "id",
        "predicate": "status = 'pending'",
        "topic": "order.timeout",
        "due_column": "deadline",
        **fields,
    }
    with pytest.raises(UnsafeSQL):
        Reconcile(**job).resolve(business.conn)  # type: ignore[arg-type]
    assert _victim(business) == "victim"


def test_reconcile_checks_names_and_predicate_against_the_catalog(business: Store) -> None:
    conn = business.conn
    with pytest.raises(UnsafeSQL, match="does not exist"):
        Reconcile("biz.nothing", "id", None, "order.timeout", "deadline").resolve(conn)
    with pytest.raises(UnsafeSQL, match=r"not a column of biz\.orders"):
        Reconcile("biz.orders", "order_id", None, "order.timeout", "deadline").resolve(conn)
    with pytest.raises(UnsafeSQL, match="column 'paid' is not one of"):
        Reconcile("biz.orders", "id", "paid", "order.timeout", "deadline").resolve(conn)
    job = Reconcile(
        "biz.orders",
        "id",
        "status = 'it''s' AND status LIKE '5%'",
        "order.timeout",
        "deadline",
        filters={"status": "x'); DROP TABLE public.victim; --"},
    )
    needed = job.needed_sql(conn)
    assert "b.status = 'it''s' AND b.status LIKE '5%'" in needed
    assert "'x''); DROP TABLE public.victim; --'" in needed  # a quoted value
    conn.execute("INSERT INTO biz.orders VALUES (1, 'it''s', now())")
    assert conn.execute(needed).fetchall() == []  # one SELECT: runs, finds nothing
    assert business.count_matching(match=job.stale_match(conn)) == 0
    assert _victim(business) == "victim"


# --- bulk enqueue: the query, the input, the source -----------------------------------------------------


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("WITH d AS (DELETE FROM delaywheel.wheel RETURNING id) SELECT id AS key FROM d", "data-modifying WITH"),
        ("DELETE FROM delaywheel.wheel RETURNING id", "not DELETE"),
        ("SELECT 1 AS key; DROP TABLE public.victim", "2 statements"),
        ("SELECT 1 AS key INTO public.copy", "INTO"),
        ("SELECT id AS key FROM delaywheel.wheel FOR UPDATE", "FOR UPDATE"),
        ("SELECT rolpassword AS body FROM pg_authid", "system table"),
        ("SELECT pg_read_file('/etc/passwd') AS body", "pg_read_file()"),
        ("SELECT nextval('delaywheel.messages_id_seq') AS key", "nextval()"),
        ("SELECT dblink_exec('host=x', 'DROP TABLE t') AS key", "dblink_exec()"),
        ("SELECT * FROM delaywheel.topic_messages", "store's own table delaywheel.topic_messages"),
        ("SELECT body FROM DelayWheel.wheel", "store's own table delaywheel.wheel"),
        ('SELECT key FROM "delaywheel".quarantine', "store's own table delaywheel.quarantine"),
        (
            "WITH t AS (SELECT body FROM delaywheel.topic_messages) SELECT body FROM shop.orders, t",
            "store's own table delaywheel.topic_messages",
        ),
        (
            "SELECT o.order_id AS key FROM shop.orders o WHERE o.order_id IN"
            " (SELECT message_id FROM delaywheel.level_queue)",
            "store's own table delaywheel.level_queue",
        ),
        (
            "SELECT o.order_id AS key FROM shop.orders o JOIN LATERAL"
            " (SELECT body FROM delaywheel.consumer_offsets) c ON true",
            "store's own table delaywheel.consumer_offsets",
        ),
    ],
)
def test_bulk_query_must_be_one_read_only_select(query: str, named: str) -> None:
    with pytest.raises(UnsafeSQL) as refused:
        check_query(query)
    assert named in str(refused.value)


def test_bulk_query_accepts_a_plain_select() -> None:
    query = (
        "WITH o AS (SELECT * FROM shop.orders WHERE status = 'pending') SELECT 'order-' || o.order_id AS key,"
        " json_build_object('n', o.order_id)::text AS body, count(*) OVER () AS n FROM o"
        " JOIN generate_series(1, 3) g ON g = 1 ORDER BY 1 LIMIT 10"
    )
    assert check_query(query).startswith("WITH o AS (SELECT")


def test_inputs_only_under_the_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "in", tmp_path / "out"
    root.mkdir()
    outside.mkdir()
    (root / "a.csv").write_text("key\n1\n")
    (outside / "secret.csv").write_text("key\n1\n")
    (root / "link.csv").symlink_to(outside / "secret.csv")
    (root / "dir").mkdir()
    (root / "dir" / "b.csv").write_text("key\n1\n")
    s = Settings(input_roots=(str(root),))
    assert check_input(str(root / "a.csv"), s) == str(root / "a.csv")
    assert check_input(str(root / "dir"), s) == str(root / "dir")
    assert check_input(str(root / "dir" / "*.csv"), s)
    for bad in (
        str(outside / "secret.csv"),
        str(root / ".." / "out" / "secret.csv"),
        str(root / "link.csv"),
        str(root / "*.csv"),
        "/etc/passwd",
        f"file://{outside}/secret.csv",
        str(root / "{a,b}.csv"),
        "hdfs://namenode/data/x.csv",
        str(root / "missing.csv"),
    ):
        with pytest.raises(NotAllowed):
            check_input(bad, s)
    with pytest.raises(NotAllowed, match="no input roots"):
        check_input(str(root / "a.csv"), Settings(input_roots=()))
    assert check_input("s3a://bucket/in/x.parquet", Settings(input_roots=("s3a://bucket/in",)))
    with pytest.raises(NotAllowed):
        check_input("s3a://bucket/in/../other/x.parquet", Settings(input_roots=("s3a://bucket/in",)))


def test_sources_only_the_store_or_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    store_only = Settings()
    assert check_source(None, store_only) is None and check_source("", store_only) is None
    with pytest.raises(NotAllowed, match="not an allowed source"):
        check_source("postgresql://evil@attacker:5432/x", store_only)
    with pytest.raises(NotAllowed, match=r"\*\*\*"):  # the password is not echoed
        check_source("postgresql://u:hunter2@db/shop", store_only)
    monkeypatch.setenv("AIRFLOW_CONN_SHOP_DB", "postgresql://reader:pw@db:5432/shop")
    allowed = Settings(allowed_sources=("shop_db", "postgresql://bi@warehouse/bi"))
    assert check_source("shop_db", allowed) == "postgresql://reader:pw@db:5432/shop"
    assert check_source("postgresql://reader:other@db/shop", allowed) == "postgresql://reader:pw@db:5432/shop"
    assert check_source("postgresql://bi@warehouse:5432/bi", allowed) == "postgresql://bi@warehouse/bi"
    for bad in ("postgresql://postgres@db/shop", "other_conn", "postgresql://bi@warehouse/postgres"):
        with pytest.raises(NotAllowed):
            check_source(bad, allowed)
    assert os.environ["AIRFLOW_CONN_SHOP_DB"]
    # an allowed connection reaches the job only through its environment (the Airflow task puts it there)
    monkeypatch.delenv("AIRFLOW_CONN_SHOP_DB")
    with pytest.raises(NotAllowed, match="AIRFLOW_CONN_SHOP_DB is not set"):
        check_source("shop_db", allowed)
