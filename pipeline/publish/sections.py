"""The report's section declarations: the structured header of each `sql/report_*.sql`.

A section of report.md is one query and a few lines at the top of its file,
below the prose that says what the query computes and from what: the
declaration says what the section shows of the query's rows, so a reader of
the .sql file sees both, and the renderer (`report.py`) is the same code for
every section. For example (`sql/report_hitrate.sql`):

    -- reads: hitrate
    -- heading: 6. Expert-cache hit rates
    -- intro: Means over prompts and repetitions. LRU and Belady (optimal eviction) replay the
    --   plain (bonus 0) routing of the same model with an ordinary cache, as references.
    -- plot: hitrate
    -- order: moce_bonus, variant, cache_experts
    -- columns:
    --   variant  | {variant}
    --   hit rate | {hit_rate:.2%}

The declaration starts at the first `-- <key>:` line with a key below and runs
to the SQL; a line indented two more spaces (`--   ...`) continues the key
above it (prose is joined with spaces; each `columns` line is one column).

Section keys:
- `reads`: the lake tables the query reads; without all of them the section
  says "not computed" and names those missing.
- `optional`: a table without which the section is left out altogether.
- `missing`: `table | sentence`: said instead of "not computed" when that table
  is the only one missing (an absence that is itself the answer).
- `heading` (`##`), `subheading` (`###`), `intro` (a paragraph above the tables).
- `group`: a template; one `###` block per distinct value of the columns it
  names, headed by the filled template.
- `after`: `@name`, paragraphs after each group's tables; `note`: a sentence,
  or `@name`, after all tables, above the line naming the query.
- `plot`, `alt`, `caption`: a plot the renderer registers under that name,
  its alt text and its italic caption (templates).

Table keys (`table:` starts another table of each group; its value, a
template or `@name`, is the paragraph above the table, empty for none):
- `per`: one table per distinct value of these columns within a group.
- `where`: `column` or `column = value`: the rows a table shows.
- `order`: the columns rows are sorted by (stable: otherwise query order).
- `rows`: a pivot table's row identity: one table row per distinct value.
- `columns`: `header | cell`, or `header | cell | per column` for one column
  per distinct value of that column (its header filled from that value's row,
  a cell without a row an em dash), or a lone `@name` for a table whose
  columns depend on the data (a registered function gives header and rows).

A template is Python format syntax over the query's columns (`{kld:.4f}`,
`{moce_bonus:g}`); `{column:label}` is the column's value in words (the
renderer's labels, e.g. a split's name); a NULL value prints as an em dash,
and `cell ?? text` prints `text` instead when any value the cell names is
NULL. A cell or paragraph `@name` is a function the renderer registers under
that name, for what a template cannot say. Every column a declaration names
must be one the query returns: the renderer checks it against the query's
result and refuses otherwise (`DeclarationError`).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

DASH = "\u2014"
FALLBACK = " ?? "
COLUMN_SEPARATOR = " | "
SECTION_KEYS = ("reads", "optional", "missing", "heading", "subheading", "intro", "group", "after", "note",
                "plot", "alt", "caption")
TABLE_KEYS = ("table", "per", "where", "order", "rows", "columns")
KEY_LINE = re.compile(r"^-- ([a-z]+):(?: (.*))?$")
CONTINUATION = re.compile(r"^--   +(\S.*)$")


class DeclarationError(ValueError):
    """A report declaration that cannot be rendered: a bad header line, or a column the query lacks."""


@dataclass(frozen=True)
class Column:
    """One `columns` line: `header | cell [| per column]`."""

    header: str  # template
    cell: str  # template or @name
    per: str | None = None  # pivot: one column per distinct value of this query column


@dataclass(frozen=True)
class Table:
    """A table of each group of a section, and the paragraph above it."""

    title: str = ""  # template or @name: the paragraph above the table
    per: tuple[str, ...] = ()
    where: tuple[str, str | None] | None = None  # (column, value); value None: the column is true
    order: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()
    builder: str | None = None  # @name of a function giving the header and rows


@dataclass(frozen=True)
class Section:
    """What `sql/<query>.sql`'s header declares (a query only a plot reads declares `reads` alone)."""

    query: str
    reads: tuple[str, ...] = ()
    optional: str | None = None
    missing: tuple[str, str] | None = None
    heading: str | None = None
    subheading: str | None = None
    intro: str | None = None
    group: str | None = None
    after: str | None = None
    note: str | None = None
    plot: str | None = None
    alt: str = ""
    caption: str = ""
    tables: tuple[Table, ...] = ()

    @property
    def shown(self) -> bool:
        """True for a section of the report; False for a query only a plot or the renderer reads."""
        return self.heading is not None or self.subheading is not None

    def templates(self) -> list[str]:
        """Every template of the declaration (not `@name`s): what may name the query's columns."""
        texts = [self.intro, self.group, self.note, self.alt, self.caption]
        for table in self.tables:
            texts.append(table.title)
            texts += [t for c in table.columns for t in (c.header, c.cell)]
        return [t for t in texts if t and not is_named(t)]

    def columns_named(self) -> set[str]:
        """The query columns the declaration names, in templates and in table keys."""
        names = {name for t in self.templates() for name, _ in template_fields(t)}
        for table in self.tables:
            names |= set(table.per) | set(table.order) | set(table.rows)
            names |= {c.per for c in table.columns if c.per}
            if table.where:
                names.add(table.where[0])
        return names

    def names(self) -> set[str]:
        """Every `@name` the declaration refers to."""
        refs = [self.after, self.note, *(t.title for t in self.tables),
                *(c.cell for t in self.tables for c in t.columns)]
        return {r[1:] for r in refs if r and is_named(r)} | {t.builder for t in self.tables if t.builder}


def is_named(text: str) -> bool:
    return text.startswith("@")


# ---- templates ------------------------------------------------------------------------------
def template_fields(template: str) -> list[tuple[str, str]]:
    """(column, format spec) of every `{column:spec}` in the template, fallback included."""
    try:
        fields = [(name, spec or "") for _, name, spec, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise DeclarationError(f"{template!r}: {exc}") from None
    bad = [name for name, _ in fields if not name.isidentifier()]
    if bad:
        raise DeclarationError(f"{template!r}: {bad[0]!r} is not a column name")
    return fields


def fill(template: str, values: Mapping[str, Any], labels: Mapping[str, Callable[[Any], str]]) -> str:
    """The template with `values` (a query row and the renderer's context) put in; see the module's
    docstring for `:label`, NULL and `??`."""
    text, _, fallback = template.partition(FALLBACK)
    fields = template_fields(text)
    if fallback and any(values[name] is None for name, spec in fields if spec != "label"):
        return fallback
    out = []
    for literal, name, spec, _ in string.Formatter().parse(text):
        out.append(literal)
        if name is None:
            continue
        value = values[name]
        if spec == "label":
            out.append(labels[name](value))
        else:
            out.append(DASH if value is None else format(value, spec or ""))
    return "".join(out)


# ---- parsing a header ------------------------------------------------------------------------
def declaration_lines(stem: str, text: str) -> list[tuple[str, str]]:
    """(key, value) of each declaration line of the header, continuations folded in (as '\\n'-joined
    items: prose is joined with spaces later, `columns` splits them)."""
    keys = SECTION_KEYS + TABLE_KEYS
    pairs: list[tuple[str, str]] = []
    for number, line in enumerate(text.strip().splitlines(), 1):
        if not line.startswith("--"):
            break
        key_line = KEY_LINE.match(line)
        if key_line and key_line.group(1) in keys:
            pairs.append((key_line.group(1), (key_line.group(2) or "").strip()))
        elif not pairs:
            continue  # the prose above the declaration
        elif (more := CONTINUATION.match(line)):
            key, value = pairs[-1]
            pairs[-1] = (key, f"{value}\n{more.group(1).rstrip()}" if value else more.group(1).rstrip())
        else:
            raise DeclarationError(f"sql/{stem}.sql:{number}: {line!r}: not `-- <key>: value` with a key of "
                                   f"{', '.join(keys)}, nor a continuation (`--   ...`)")
    return pairs


def parse_column(stem: str, item: str) -> Column:
    """`header | cell` or `header | cell | per column`."""
    parts = [p.strip() for p in item.split(COLUMN_SEPARATOR)]
    if len(parts) == 3 and parts[2].startswith("per "):
        return Column(parts[0], parts[1], parts[2].removeprefix("per ").strip())
    if len(parts) != 2 or not all(parts):
        raise DeclarationError(f"sql/{stem}.sql: columns: {item!r}: not `header | cell [| per column]`")
    return Column(parts[0], parts[1])


def prose(value: str) -> str:
    """A value continued over several lines, as one line."""
    return " ".join(value.split("\n"))


def names_list(value: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in value.replace("\n", " ").split(",") if n.strip())


def parse_table_key(stem: str, table: Table, key: str, value: str) -> Table:
    if key == "per":
        return replace(table, per=names_list(value))
    if key == "order":
        return replace(table, order=names_list(value))
    if key == "rows":
        return replace(table, rows=names_list(value))
    if key == "where":
        column, _, wanted = (p.strip() for p in value.partition("="))
        return replace(table, where=(column, wanted or None))
    items = [i.strip() for i in value.split("\n") if i.strip()]  # columns
    if len(items) == 1 and is_named(items[0]):
        return replace(table, builder=items[0][1:])
    return replace(table, columns=tuple(parse_column(stem, i) for i in items))


def parse_declaration(stem: str, text: str) -> Section:
    """The section `sql/<stem>.sql`'s header declares (`text`: the file, or its header alone)."""
    section: dict[str, Any] = {}
    tables: list[Table] = []
    in_table: set[str] = set()
    for key, value in declaration_lines(stem, text):
        if key in SECTION_KEYS:
            if key in section:
                raise DeclarationError(f"sql/{stem}.sql: `{key}` is declared twice")
            section[key] = prose(value)
            continue
        if key == "table" or not tables:
            tables.append(Table(title=prose(value) if key == "table" else ""))
            in_table = set()
        if key == "table":
            continue
        if key in in_table:
            raise DeclarationError(f"sql/{stem}.sql: `{key}` twice in one table (`table:` starts another)")
        in_table.add(key)
        tables[-1] = parse_table_key(stem, tables[-1], key, value)
    if "missing" in section:
        table, sep, sentence = (p.strip() for p in section["missing"].partition("|"))
        if not sep or not sentence:
            raise DeclarationError(f"sql/{stem}.sql: missing: not `table | sentence`")
        section["missing"] = (table, sentence)
    section["reads"] = names_list(section.get("reads", ""))
    named = {"optional": section.get("optional"), "missing": section["missing"][0] if "missing" in section else None}
    for key, table in named.items():
        if table is not None and table not in section["reads"]:
            raise DeclarationError(f"sql/{stem}.sql: {key}: `{table}` is not a table it reads")
    declared = Section(query=stem, tables=tuple(tables), **section)
    if declared.shown and not declared.tables:
        raise DeclarationError(f"sql/{stem}.sql: a section with a heading and no `columns`")
    if any(not (t.columns or t.builder) for t in declared.tables):
        raise DeclarationError(f"sql/{stem}.sql: a table without `columns` (`table:` starts a table: its keys "
                               "follow it)")
    for template in declared.templates():
        template_fields(template)  # a malformed template fails here, not mid-report
    return declared
