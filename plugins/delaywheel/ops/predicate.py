"""Text from callers and forms, checked before it reaches SQL (invariant 7).

No text a caller supplies is pasted into a statement. A predicate (`cancel --where`, `Store.cancel_matching(where=…)`,
reconcile's `predicate`) is parsed by PostgreSQL's own parser (`pglast`, libpg_query: the server's grammar, so
there is no second opinion about where a string or a comment ends) and accepted only when it is exactly one
expression built from a whitelist of node types: column references to the documented columns, constants, AND / OR
/ NOT, comparison and JSON operators, IN lists, LIKE / ILIKE / SIMILAR TO, BETWEEN, IS [NOT] NULL / TRUE / FALSE,
CASE, COALESCE, GREATEST / LEAST, casts to a whitelist of types and a whitelist of pure functions. Anything else
(a subquery, another function such as `pg_read_file`, a second statement, a system column, a parameter) is
refused with `UnsafeSQL`, naming the construct. What runs is then rendered back from the parse tree (`RawStream`),
never the original text, with every column qualified by the library's own alias.

A bulk-enqueue `query` is checked the same way as a whole statement (`check_query`): one SELECT, no data-modifying
CTE, no INTO, no FOR UPDATE / SHARE, no system catalog, nothing of the store's own schema (its topics would be copied
into the topic the caller consumes), functions from a whitelist (aggregates included).
Identifiers (tables, columns) are never parsed from text at all: `split_table` checks their spelling and the callers
look them up in the catalog and quote them with `psycopg.sql.Identifier`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import psycopg
from pglast import ast, parse_sql
from pglast.enums import A_Expr_Kind, BoolExprType, SetOperation, SQLValueFunctionOp
from pglast.parser import ParseError
from pglast.stream import RawStream
from psycopg import sql


class UnsafeSQL(ValueError):
    """Caller-supplied SQL text that delaywheel will not run; the message names the offending construct."""


# The columns a cancel predicate may name: the pending rows as `pending.PENDING` gives them.
CANCEL_COLUMNS = ("id", "deliver_at", "key", "topic", "tags", "properties", "lane", "level")
MAX_LENGTH = 20_000
MAX_DEPTH = 200

_OPERATORS = frozenset(
    {
        "=",
        "<>",
        "!=",
        "<",
        ">",
        "<=",
        ">=",  # comparison
        "+",
        "-",
        "*",
        "/",
        "%",
        "||",  # arithmetic, concatenation
        "->",
        "->>",
        "#>",
        "#>>",
        "?",
        "?|",
        "?&",
        "@>",
        "<@",
        "&&",  # jsonb and arrays
        "~~",
        "!~~",
        "~~*",
        "!~~*",
        "~",
        "!~",
        "~*",
        "!~*",  # LIKE / ILIKE / regular expressions
    }
)
# Pure (immutable or stable, no side effect, no file, network, catalog or setting access) built-in functions.
_FUNCTIONS = frozenset(
    {
        "lower",
        "upper",
        "length",
        "char_length",
        "character_length",
        "octet_length",
        "btrim",
        "ltrim",
        "rtrim",
        "trim",
        "substr",
        "substring",
        "left",
        "right",
        "strpos",
        "position",
        "replace",
        "split_part",
        "starts_with",
        "concat",
        "concat_ws",
        "md5",
        "reverse",
        "lpad",
        "rpad",
        "initcap",
        "similar_to_escape",
        "abs",
        "ceil",
        "ceiling",
        "floor",
        "round",
        "trunc",
        "mod",
        "greatest",
        "least",
        "now",
        "clock_timestamp",
        "statement_timestamp",
        "transaction_timestamp",
        "date_trunc",
        "date_part",
        "extract",
        "to_timestamp",
        "make_interval",
        "age",
        "timezone",
        "jsonb_typeof",
        "json_typeof",
        "jsonb_array_length",
        "jsonb_exists",
        "jsonb_extract_path_text",
        "array_length",
        "cardinality",
        "array_to_string",
        "string_to_array",
    }
)
# A bulk-enqueue query may also build rows: aggregates, JSON builders and set-returning generators.
_QUERY_FUNCTIONS = _FUNCTIONS | frozenset(
    {
        "count",
        "sum",
        "min",
        "max",
        "avg",
        "bool_and",
        "bool_or",
        "array_agg",
        "string_agg",
        "json_agg",
        "jsonb_agg",
        "json_build_object",
        "jsonb_build_object",
        "json_build_array",
        "jsonb_build_array",
        "to_json",
        "to_jsonb",
        "row_to_json",
        "json_object_agg",
        "jsonb_object_agg",
        "generate_series",
        "unnest",
        "row_number",
        "rank",
        "dense_rank",
        "random",
        "gen_random_uuid",
        "to_char",
        "format",
        "coalesce",
        "nullif",
    }
)
_TYPES = frozenset(
    {
        "text",
        "varchar",
        "bpchar",
        "char",
        "character",
        "name",
        "bool",
        "boolean",
        "int2",
        "int4",
        "int8",
        "smallint",
        "integer",
        "int",
        "bigint",
        "numeric",
        "decimal",
        "float4",
        "float8",
        "real",
        "double precision",
        "timestamptz",
        "timestamp",
        "date",
        "time",
        "timetz",
        "interval",
        "json",
        "jsonb",
        "uuid",
        "bytea",
    }
)
_TIME_VALUES = frozenset(
    {
        SQLValueFunctionOp.SVFOP_CURRENT_DATE,
        SQLValueFunctionOp.SVFOP_CURRENT_TIME,
        SQLValueFunctionOp.SVFOP_CURRENT_TIME_N,
        SQLValueFunctionOp.SVFOP_CURRENT_TIMESTAMP,
        SQLValueFunctionOp.SVFOP_CURRENT_TIMESTAMP_N,
        SQLValueFunctionOp.SVFOP_LOCALTIME,
        SQLValueFunctionOp.SVFOP_LOCALTIME_N,
        SQLValueFunctionOp.SVFOP_LOCALTIMESTAMP,
        SQLValueFunctionOp.SVFOP_LOCALTIMESTAMP_N,
    }
)
_A_EXPR_KINDS = frozenset(
    {
        A_Expr_Kind.AEXPR_OP,
        A_Expr_Kind.AEXPR_OP_ANY,
        A_Expr_Kind.AEXPR_OP_ALL,
        A_Expr_Kind.AEXPR_DISTINCT,
        A_Expr_Kind.AEXPR_NOT_DISTINCT,
        A_Expr_Kind.AEXPR_NULLIF,
        A_Expr_Kind.AEXPR_IN,
        A_Expr_Kind.AEXPR_LIKE,
        A_Expr_Kind.AEXPR_ILIKE,
        A_Expr_Kind.AEXPR_SIMILAR,
        A_Expr_Kind.AEXPR_BETWEEN,
        A_Expr_Kind.AEXPR_NOT_BETWEEN,
        A_Expr_Kind.AEXPR_BETWEEN_SYM,
        A_Expr_Kind.AEXPR_NOT_BETWEEN_SYM,
    }
)
# Node types an expression may hold (values, names and the expression forms above); everything else is refused.
_EXPRESSION_NODES = frozenset(
    {
        "A_Const",
        "Integer",
        "Float",
        "Boolean",
        "String",
        "BitString",
        "ColumnRef",
        "BoolExpr",
        "A_Expr",
        "NullTest",
        "BooleanTest",
        "TypeCast",
        "TypeName",
        "FuncCall",
        "CoalesceExpr",
        "MinMaxExpr",
        "CaseExpr",
        "CaseWhen",
        "A_ArrayExpr",
        "SQLValueFunction",
    }
)
_QUERY_NODES = _EXPRESSION_NODES | frozenset(
    {
        "SelectStmt",
        "ResTarget",
        "RangeVar",
        "JoinExpr",
        "RangeSubselect",
        "RangeFunction",
        "SubLink",
        "SortBy",
        "WithClause",
        "CommonTableExpr",
        "Alias",
        "A_Star",
        "WindowDef",
        "A_Indirection",
        "A_Indices",
        "List",
    }
)
_SYSTEM_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast"})
STORE_SCHEMA = "delaywheel"  # the store's own tables: never read by caller-supplied SQL
_DESCRIBE = {  # what a refused node is, in words a caller recognises
    "SubLink": "a subquery",
    "ParamRef": "a parameter ($n)",
    "A_Indirection": "a subscript or field selection",
    "CollateClause": "COLLATE",
    "RowExpr": "a row constructor",
    "GroupingFunc": "GROUPING()",
    "InsertStmt": "INSERT",
    "UpdateStmt": "UPDATE",
    "DeleteStmt": "DELETE",
    "MergeStmt": "MERGE",
    "XmlExpr": "an XML expression",
    "XmlSerialize": "XMLSERIALIZE",
    "JsonFuncExpr": "a JSON query function",
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]*$")


def _parse(text: str, what: str, prefix: str = "") -> list[ast.RawStmt]:
    if not isinstance(text, str) or not text.strip():
        raise UnsafeSQL(f"{what} is empty")
    if len(text) > MAX_LENGTH:
        raise UnsafeSQL(f"{what} is longer than {MAX_LENGTH:,} characters")
    if "\x00" in text:
        raise UnsafeSQL(f"{what} holds a NUL character")
    try:
        return list(parse_sql(prefix + text))
    except ParseError as exc:
        message, *where = exc.args
        at = f" (character {where[0] - len(prefix) + 1})" if where and isinstance(where[0], int) else ""
        raise UnsafeSQL(f"{what} is not valid SQL: {message}{at}") from None
    except RecursionError:
        raise UnsafeSQL(f"{what} is nested too deeply") from None


def _func_name(node: ast.FuncCall) -> str:
    names = [n.sval for n in node.funcname or ()]
    if len(names) == 2 and names[0] == "pg_catalog":
        return names[1].lower()
    if len(names) != 1:
        raise UnsafeSQL(f"function {'.'.join(names)}() is not allowed (only built-in functions, unqualified)")
    return names[0].lower()


def _type_name(node: ast.TypeName) -> str:
    names = [n.sval for n in node.names or ()]
    if len(names) == 2 and names[0] == "pg_catalog":
        names = names[1:]
    return ".".join(names).lower()


class _Checker:
    """Walks a parse tree and raises `UnsafeSQL` at the first node outside the whitelist. In expression mode
    (`columns` given) every column reference must name an allowed column (optionally behind one of `qualifiers`)."""

    def __init__(
        self,
        *,
        columns: Iterable[str] | None,
        qualifiers: Iterable[str] = (),
        query: bool = False,
        what: str = "predicate",
    ) -> None:
        self.columns = None if columns is None else frozenset(columns)
        self.qualifiers = frozenset(qualifiers)
        self.query = query
        self.nodes = _QUERY_NODES if query else _EXPRESSION_NODES
        self.functions = _QUERY_FUNCTIONS if query else _FUNCTIONS
        self.what = what
        self.column_refs: list[ast.ColumnRef] = []

    def refuse(self, construct: str) -> UnsafeSQL:
        return UnsafeSQL(f"{self.what}: {construct} is not allowed")

    def check(self, node: object, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise UnsafeSQL(f"{self.what} is nested too deeply")
        if isinstance(node, tuple | list):
            for item in node:
                self.check(item, depth + 1)
            return
        if not isinstance(node, ast.Node):
            return  # a scalar slot: a name, a number, an enum, a flag
        kind = type(node).__name__
        if kind not in self.nodes:
            raise self.refuse(_DESCRIBE.get(kind, f"{kind} ({RawStream()(node)[:60] if _deparsable(node) else kind})"))
        getattr(self, f"_{kind}", lambda _n: None)(node)
        for slot in getattr(type(node), "__slots__", ()):
            self.check(getattr(node, slot, None), depth + 1)

    # --- per-node rules -------------------------------------------------------------------------------
    def _ColumnRef(self, node: ast.ColumnRef) -> None:
        fields = node.fields or ()
        if any(isinstance(f, ast.A_Star) for f in fields):
            if self.columns is not None:
                raise self.refuse("*")
            return
        names = [f.sval for f in fields]
        if self.columns is None:
            return
        if len(names) == 2 and names[0] in self.qualifiers:
            names = names[1:]
        if len(names) != 1 or names[0] not in self.columns:
            raise UnsafeSQL(f"{self.what}: column {'.'.join(names)!r} is not one of {', '.join(sorted(self.columns))}")
        self.column_refs.append(node)

    def _A_Expr(self, node: ast.A_Expr) -> None:
        if node.kind not in _A_EXPR_KINDS:
            raise self.refuse(f"the operator form {getattr(node.kind, 'name', node.kind)}")
        names = [n.sval for n in node.name or ()]
        if len(names) == 2 and names[0] == "pg_catalog":
            names = names[1:]
        operator = node.kind in (A_Expr_Kind.AEXPR_OP, A_Expr_Kind.AEXPR_OP_ANY, A_Expr_Kind.AEXPR_OP_ALL)
        if operator and (len(names) != 1 or names[0] not in _OPERATORS):
            raise self.refuse(f"the operator {'.'.join(names)}")

    def _BoolExpr(self, node: ast.BoolExpr) -> None:
        if node.boolop not in (BoolExprType.AND_EXPR, BoolExprType.OR_EXPR, BoolExprType.NOT_EXPR):
            raise self.refuse(f"the boolean form {node.boolop}")

    def _FuncCall(self, node: ast.FuncCall) -> None:
        name = _func_name(node)
        if name not in self.functions:
            raise self.refuse(f"the function {name}()")
        if not self.query and (
            node.agg_star
            or node.agg_distinct
            or node.agg_order
            or node.agg_filter
            or node.over
            or node.agg_within_group
            or node.func_variadic
        ):
            raise self.refuse(f"an aggregate, window or VARIADIC call of {name}()")

    def _TypeName(self, node: ast.TypeName) -> None:
        name = _type_name(node)
        if name not in _TYPES or node.setof or node.pct_type:
            raise self.refuse(f"a cast to {name}")

    def _SQLValueFunction(self, node: ast.SQLValueFunction) -> None:
        if node.op not in _TIME_VALUES:
            raise self.refuse(str(getattr(node.op, "name", node.op)).removeprefix("SVFOP_"))

    def _SelectStmt(self, node: ast.SelectStmt) -> None:
        if node.intoClause:
            raise self.refuse("SELECT … INTO")
        if node.lockingClause:
            raise self.refuse("FOR UPDATE / FOR SHARE")

    def _RangeVar(self, node: ast.RangeVar) -> None:
        schema = (node.schemaname or "").lower()
        if (
            node.catalogname
            or schema in _SYSTEM_SCHEMAS
            or (not schema and (node.relname or "").lower().startswith("pg_"))
        ):
            raise self.refuse(f"reading the system table {node.relname}")
        if schema == STORE_SCHEMA:
            raise self.refuse(f"reading the store's own table {STORE_SCHEMA}.{node.relname}")

    def _CommonTableExpr(self, node: ast.CommonTableExpr) -> None:
        if not isinstance(node.ctequery, ast.SelectStmt):
            raise self.refuse(f"a data-modifying WITH ({type(node.ctequery).__name__})")

    def _RangeFunction(self, node: ast.RangeFunction) -> None:
        if node.is_rowsfrom:
            raise self.refuse("ROWS FROM")


def _deparsable(node: ast.Node) -> bool:
    try:
        RawStream()(node)
    except Exception:  # only used to word an error
        return False
    return True


def _single_expression(stmts: list[ast.RawStmt], what: str) -> ast.Node:
    if len(stmts) != 1:
        raise UnsafeSQL(f"{what} must be one expression, not {len(stmts)} statements")
    stmt = stmts[0].stmt
    if not isinstance(stmt, ast.SelectStmt) or len(stmt.targetList or ()) != 1:
        raise UnsafeSQL(f"{what} must be one expression")
    extra = [
        slot
        for slot in (
            "distinctClause",
            "intoClause",
            "fromClause",
            "whereClause",
            "groupClause",
            "havingClause",
            "windowClause",
            "valuesLists",
            "sortClause",
            "limitOffset",
            "limitCount",
            "lockingClause",
            "withClause",
            "larg",
            "rarg",
        )
        if getattr(stmt, slot, None)
    ]
    if extra or stmt.op not in (None, SetOperation.SETOP_NONE):
        raise UnsafeSQL(f"{what} must be one expression; found {', '.join(extra) or 'a set operation'} after it")
    target = (stmt.targetList or ())[0]
    if target.name or target.indirection:
        raise UnsafeSQL(f"{what} must be one expression (no AS)")
    return target.val


def check_expression(
    text: str,
    columns: Iterable[str] | None,
    *,
    qualifier: str | None = None,
    accept_qualifiers: Iterable[str] = (),
    what: str = "predicate",
) -> str:
    """`text` as one checked expression over `columns`, rendered from its parse tree with every column behind
    `qualifier` (or unqualified). `columns=None` checks everything but the column names (for a reconcile predicate
    before its table's columns are known). Raises `UnsafeSQL`."""
    expr = _single_expression(_parse(text, what, "SELECT "), what)
    accepted = {*accept_qualifiers, *([qualifier] if qualifier else [])}
    checker = _Checker(columns=columns, qualifiers=accepted, what=what)
    checker.check(expr)
    for ref in checker.column_refs:
        name = (ref.fields or ())[-1].sval
        ref.fields = (ast.String(sval=qualifier), ast.String(sval=name)) if qualifier else (ast.String(sval=name),)
    rendered = RawStream()(expr)
    # The rendering is parsed and checked once more: what runs is exactly what was checked.
    again = _Checker(columns=columns, qualifiers=accepted, what=what)
    again.check(_single_expression(_parse(rendered, what, "SELECT "), what))
    return str(rendered)


def check_query(text: str, *, what: str = "query") -> str:
    """`text` as one read-only SELECT (see the module docstring), rendered from its parse tree."""
    stmts = _parse(text, what)
    if len(stmts) != 1:
        raise UnsafeSQL(f"{what} must be one SELECT statement, not {len(stmts)} statements")
    stmt = stmts[0].stmt
    if not isinstance(stmt, ast.SelectStmt):
        raise UnsafeSQL(f"{what} must be a SELECT statement, not {type(stmt).__name__.removesuffix('Stmt').upper()}")
    _Checker(columns=None, query=True, what=what).check(stmt)
    rendered = str(RawStream()(stmt))
    _Checker(columns=None, query=True, what=what).check(_parse(rendered, what)[0].stmt)
    return rendered


def split_table(name: str, *, what: str = "table") -> tuple[str | None, str]:
    """`schema.table` or `table` as its two names (plain identifiers only: letters, digits, _ and $)."""
    parts = name.strip().split(".") if isinstance(name, str) else []
    if not 1 <= len(parts) <= 2 or not all(_NAME.match(p) for p in parts):
        raise UnsafeSQL(f"{what} {name!r} is not a plain identifier (schema.table or table)")
    if len(parts) == 2 and parts[0].lower() in _SYSTEM_SCHEMAS:
        raise UnsafeSQL(f"{what} {name!r} is a system table")
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def check_column_name(name: str, *, what: str = "column") -> str:
    if not isinstance(name, str) or not _NAME.match(name.strip()):
        raise UnsafeSQL(f"{what} {name!r} is not a plain identifier")
    return name.strip()


# --- identifiers, checked against the catalog ------------------------------------------------------------

_FIND_TABLE = """
SELECT n.nspname, c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = %(table)s AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
  AND CASE WHEN %(schema)s::text IS NULL THEN n.nspname = ANY(pg_catalog.current_schemas(false))
           ELSE n.nspname = %(schema)s END
ORDER BY pg_catalog.array_position(pg_catalog.current_schemas(false), n.nspname::text) NULLS LAST LIMIT 1
"""
_COLUMNS = """
SELECT a.attname FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum
"""


def catalog_table(conn: psycopg.Connection, name: str, *, what: str = "table") -> tuple[str, str, tuple[str, ...]]:
    """(schema, table, its columns) of an existing table or view named `schema.table` (or `table`, found on the
    search path), from the catalog; `UnsafeSQL` if it does not exist or is a system table. System columns
    (xmin, ctid, …) are not among the columns."""
    schema, table = split_table(name, what=what)
    row = conn.execute(_FIND_TABLE, {"schema": schema, "table": table}).fetchone()
    if row is None:
        raise UnsafeSQL(f"{what} {name!r} does not exist (or is not a table or view)")
    if row[0] in _SYSTEM_SCHEMAS:
        raise UnsafeSQL(f"{what} {name!r} is a system table")
    columns = tuple(r[0] for r in conn.execute(_COLUMNS, (row[0], row[1])).fetchall())
    return row[0], row[1], columns


def check_column(name: str, columns: Iterable[str], table: str, *, what: str = "column") -> str:
    """`name` if `table` has that column (exactly as the catalog spells it), else `UnsafeSQL`."""
    name = check_column_name(name, what=what)
    known = tuple(columns)
    if name not in known:
        raise UnsafeSQL(f"{what} {name!r} is not a column of {table} (it has {', '.join(known)})")
    return name


def read_only_session(timeout_ms: int) -> str:
    """The statements that make a JDBC session read-only with a statement timeout (Spark's `sessionInitStatement`):
    the defence behind the checks, for reads whose shape a caller chose. Spark turns autocommit off first, so the
    driver's transaction may have begun already: it is made read-only too (outside one, that is only a warning).
    The timeout is the session's (SET, not set_config(..., true)): a transaction-local one would end with the
    transaction the init statement may run in, before Spark's reads. Text, not parameters: JDBC runs it as is."""
    return (
        sql.SQL(
            "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY; SET TRANSACTION READ ONLY; SET statement_timeout = {}"
        )
        .format(sql.Literal(int(timeout_ms)))
        .as_string()
    )
