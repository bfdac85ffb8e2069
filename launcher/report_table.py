"""A report's table, printed with rich and written as Markdown (sweep and tuning reports)."""
from __future__ import annotations

from dataclasses import dataclass

from rich.markup import escape
from rich.table import Table as RichTable


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]
    numeric_from: int  # columns from here on are figures (right-aligned)


def to_markdown(table: Table) -> str:
    align = ["---" if i < table.numeric_from else "---:" for i in range(len(table.header))]
    lines = [table.header, align, *table.rows]
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines) + "\n"


def to_rich(table: Table, title: str) -> RichTable:
    out = RichTable(title=escape(title))
    for i, name in enumerate(table.header):
        out.add_column(escape(name), justify="left" if i < table.numeric_from else "right")
    for row in table.rows:
        out.add_row(*map(escape, row))
    return out
