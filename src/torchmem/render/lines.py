"""The line profiler's report: text for terminals, HTML for Jupyter, a pandas DataFrame."""

from __future__ import annotations

import html as markup
from collections.abc import Sequence
from typing import Any

from torchmem.errors import require
from torchmem.records.lines import FunctionRecord, LineRecord
from torchmem.render.text import table
from torchmem.units import readable_size

NO_DATA = "No data collected"
_CODE_STYLE = ' style="text-align: left; white-space: pre; font-family: monospace"'
_COLOURS = (
    "#4878d0",
    "#ee854a",
    "#6acc64",
    "#d65f5f",
    "#956cb4",
    "#8c613c",
    "#dc7ec0",
    "#797979",
    "#d5bb67",
    "#82c6e2",
)


def text(functions: Sequence[FunctionRecord], columns: Sequence[str]) -> str:
    """pytorch_memlab's layout: per function a ``## qualname`` header, then one column
    per stat under a header of its dot-separated parts, ``hits``, ``line`` and ``code``."""
    if not functions:
        return f"{NO_DATA}\n"
    return "\n\n".join(f"## {f.qualname}\n\n{_text_table(f, columns)}\n" for f in functions)


def _text_table(function: FunctionRecord, columns: Sequence[str]) -> str:
    if not function.ran:
        return NO_DATA
    parts = [column.split(".") for column in columns]
    depth = max(len(p) for p in parts)
    header = [*parts, ["hits"], ["line"], ["code"]]
    rows = [[h[r] if r < len(h) else "" for h in header] for r in range(depth)]
    rows += [
        [*_cells(line, columns), str(line.hits or ""), str(line.lineno), line.code]
        for line in function.lines
    ]
    return "\n".join(table(rows, left=(len(header) - 1,), gap=" "))


def _cells(line: LineRecord, columns: Sequence[str]) -> list[str]:
    return [_format(column, line.stats.get(column)) for column in columns]


def _format(column: str, value: int | None) -> str:
    if value is None:
        return ""
    return readable_size(value) if _is_bytes(column) else str(value)


def _is_bytes(column: str) -> bool:
    first = column.split(".", 1)[0]
    return "bytes" in first or first == "rss"


def html(functions: Sequence[FunctionRecord], columns: Sequence[str]) -> str:
    """An HTML table per function, with a bar in each stat cell scaled to the column's
    largest value (pytorch_memlab's colours), for Jupyter."""
    if not functions:
        return f"<p>{NO_DATA}</p>"
    blocks = []
    for function in functions:
        name = markup.escape(function.qualname)
        title = f'<h3><span style="font-family: monospace">{name}</span></h3>'
        body = _html_table(function, columns) if function.ran else f"<p>{NO_DATA}</p>"
        blocks.append(f"{title}<div>{body}</div>")
    return "\n".join(blocks)


def _html_table(function: FunctionRecord, columns: Sequence[str]) -> str:
    head = "".join(f"<th>{'<br>'.join(map(markup.escape, c.split('.')))}</th>" for c in columns)
    out = [
        '<table style="border-collapse: collapse">',
        f'<thead><tr style="text-align: left">{head}'
        "<th>hits</th><th>line</th><th>code</th></tr></thead>",
        "<tbody>",
    ]
    tops = [max((line.stats.get(c, 0) for line in function.lines), default=0) for c in columns]
    for line in function.lines:
        cells = []
        for i, column in enumerate(columns):
            value = line.stats.get(column)
            style = ""
            if value is not None and value > 0 and tops[i] > 0:
                width = 99 * value / tops[i]
                colour = _COLOURS[i % len(_COLOURS)]
                style = (
                    f' style="background: linear-gradient(90deg, {colour} {width:.1f}%,'
                    f' transparent {width:.1f}%)"'
                )
            cells.append(f"<td{style}>{_format(column, value)}</td>")
        code = markup.escape(line.code)
        out.append(
            f"<tr>{''.join(cells)}<td>{line.hits or ''}</td><td>{line.lineno}</td>"
            f"<td{_CODE_STYLE}>{code}</td></tr>"
        )
    out.append("</tbody></table>")
    return "".join(out)


def dataframe(functions: Sequence[FunctionRecord]) -> Any:
    """One row per source line: ``function``, ``filename``, ``line``, ``code``, ``hits``,
    then every recorded stat, sorted by name (NaN for lines that never ran)."""
    pd = require("pandas", "to_dataframe()")
    stats = sorted({key for f in functions for line in f.lines for key in line.stats})
    rows = [
        {
            "function": f.qualname,
            "filename": f.filename,
            "line": line.lineno,
            "code": line.code,
            "hits": line.hits,
            **line.stats,
        }
        for f in functions
        for line in f.lines
    ]
    return pd.DataFrame(rows, columns=["function", "filename", "line", "code", "hits", *stats])
