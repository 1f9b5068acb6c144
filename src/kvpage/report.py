"""The one text renderer of kvpage's two-column reports (``plan``, ``profile``,
``simulate``, ``replay``/``generate`` summaries).

:func:`render_table` draws a table with rich (in the ``cli`` extra) and falls back to
aligned plain text without it, so every command prints the same shape either way.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["render_table"]


def render_table(
    title: str,
    rows: Sequence[tuple[str, str]],
    *,
    columns: tuple[str, str] = ("metric", "value"),
    width: int | None = 110,
) -> str:
    """``rows`` of ``(name, formatted value)`` as a titled two-column table.

    Args:
        title: the table title.
        rows: the rows, values already formatted (units in the name or the value).
        columns: the two column headers; the value column is right-aligned.
        width: console width in characters (None = the terminal's).

    Returns:
        The rendered text (ends with a newline).
    """
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is in the cli extra
        return title + "\n" + "".join(f"  {k:40s} {v}\n" for k, v in rows)
    table = Table(title=title)
    table.add_column(columns[0])
    table.add_column(columns[1], justify="right")
    for k, v in rows:
        table.add_row(k, v)
    console = Console(width=width, record=True)
    with console.capture() as cap:
        console.print(table)
    return cap.get()
