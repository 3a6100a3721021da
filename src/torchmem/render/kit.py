"""What every report's renderers share: sizes, seconds and "... and N more" lines, the
:class:`Section` (a titled table) as text and as HTML, the one style sheet, and the one
HTML page shell (:func:`page`). Each renderer module (``run``, ``ranks``, ``snapshot``,
``estimate``, ...) builds its sections from its record and hands them here."""

from __future__ import annotations

import html as markup
from collections.abc import Sequence
from dataclasses import dataclass

from torchmem.records.frames import located
from torchmem.records.sites import SiteStack
from torchmem.render.text import encodable, table
from torchmem.units import readable_size

MISSING = "-"
"""What a cell shows where the record has no value."""
SAMPLED = "~"
"""Marks a peak that comes from sampling (the true peak may be higher)."""

STYLE = """\
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       margin: 24px auto; padding: 0 24px; max-width: 1400px; line-height: 1.35; }
@media (max-width: 600px) { body { margin: 12px auto; padding: 0 10px; }
                            th, td { padding: 3px 6px; } }
h3 { margin: 0 0 6px; font-size: 1.2em; }
h4 { margin: 20px 0 6px; }
table { border-collapse: collapse; margin: 4px 0; }
th, td { padding: 4px 12px; text-align: right; font-variant-numeric: tabular-nums;
         vertical-align: top; }
th { border-bottom: 1px solid #999; }
tbody tr:nth-child(even) { background: #f3f4f6; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 0.92em; }
details summary { cursor: pointer; }
.torchmem-charts { display: flex; flex-wrap: wrap; gap: 12px; margin: 12px 0; }
.torchmem-charts svg { border: 1px solid #ddd; background: #fff; max-width: 100%; }
"""
"""The pages' only style sheet (inline, no fonts or files fetched). Tables also carry the
little they need inline (no wrapping but in source text, a scroll bar where a window is
too narrow), so that they read the same in a notebook, which leaves this sheet out."""

_LEFT = ' style="text-align: left"'
LONG = 64
"""Cells longer than this (paths, mostly) are cut in the middle in HTML, whole on hover."""


def size(nbytes: int | None, missing: str = MISSING, mark: str = "") -> str:
    """`nbytes` as :func:`~torchmem.units.readable_size` prints it, after `mark` (such as
    :data:`SAMPLED`); `missing` where there is no value."""
    return missing if nbytes is None else mark + readable_size(nbytes)


def signed(nbytes: int) -> str:
    """``+1.50M`` for a rise, ``-1.50M`` for a fall (``0.00B`` for none)."""
    return f"+{readable_size(nbytes)}" if nbytes > 0 else readable_size(nbytes)


def seconds(value: float | None) -> str:
    """``2.41s``; :data:`MISSING` where there is no value."""
    return MISSING if value is None else f"{value:.2f}s"


def more(count: int, what: str, nbytes: int | None = None) -> str:
    """``... and 3 more sites (1.50M)``; `what` is the singular, made plural with an s;
    empty where nothing was left out."""
    if count <= 0:
        return ""
    rest = "" if nbytes is None else f" ({readable_size(nbytes)})"
    return f"... and {count} more {what}{'' if count == 1 else 's'}{rest}"


@dataclass(frozen=True)
class Section:
    """One block of a report: a title, a table, and a line on what was left out."""

    title: str
    rows: Sequence[tuple[str, ...]]
    left: tuple[int, ...] = (0,)
    header: tuple[str, ...] | None = None
    more: str = ""
    stacks: Sequence[tuple[SiteStack, ...]] = ()
    """Per row, the stacks of the site in its second cell: HTML shows them on demand (a
    ``<details>`` in that cell, each stack under its bytes where there are several); text
    leaves them out."""
    code: tuple[int, ...] = ()
    """Columns of source text: in HTML monospace, free to wrap, never cut."""


def section_text(section: Section) -> list[str]:
    """`section` as lines of text: its title, then its table indented under it."""
    indent = "  " if section.title else ""
    lines = [section.title] if section.title else []
    rows = ([section.header] if section.header else []) + list(section.rows)
    lines += [indent + line for line in table(rows, left=section.left)]
    if section.more:
        lines.append(indent + section.more)
    return lines


def middle(value: str, limit: int = LONG) -> str:
    """`value` cut to at most `limit` characters by leaving out its middle, at a ``/``
    where there is one (``/home/me/.../src/model.py:3``)."""
    if len(value) <= limit:
        return value
    head = value[: (limit - 3) // 3]
    if "/" in head[1:]:
        head = head[: head.rindex("/") + 1]
    tail = value[len(value) - (limit - 3 - len(head)) :]
    if "/" in tail[:-1]:
        tail = tail[tail.index("/") :]
    return f"{head}...{tail}"


def _text(value: str) -> str:
    """A cell's text, cut in the middle where long, with the whole on hover."""
    if len(value) <= LONG:
        return markup.escape(value)
    return f'<span title="{markup.escape(value)}">{markup.escape(middle(value))}</span>'


def _cell(tag: str, value: str, left: bool, code: bool = False) -> str:
    if code:
        return (
            f'<{tag} style="text-align: left; white-space: normal; min-width: 14em">'
            f"<code>{markup.escape(value)}</code></{tag}>"
        )
    return f"<{tag}{_LEFT if left else ''}>{_text(value)}</{tag}>"


def _stack_cell(value: str, stacks: tuple[SiteStack, ...]) -> str:
    """A site's cell whose stacks open on a click: no script, a ``<details>``; each stack
    under its bytes where there are several."""
    shown = []
    for nbytes, stack in stacks:
        frames = "".join(
            f"<li><code>{markup.escape(located(file, line))}</code> {markup.escape(function)}</li>"
            for file, line, function in stack
        )
        if len(stacks) > 1:
            shown.append(f'<div style="text-align: left">{readable_size(nbytes)}:</div>')
        shown.append(
            f'<ol style="margin: 2px 0; padding-left: 1.6em; text-align: left">{frames}</ol>'
        )
    return f"<td{_LEFT}><details><summary>{_text(value)}</summary>{''.join(shown)}</details></td>"


def section_html(section: Section) -> str:
    """`section` as HTML: an ``<h4>`` title, a table, and a paragraph on what was left out.
    A row's stacks, where it has any, open under its site on a click."""

    def row(cells: tuple[str, ...], tag: str, stacks: tuple[SiteStack, ...] = ()) -> str:
        inner = "".join(
            _stack_cell(c, stacks)
            if i == 1 and stacks
            else _cell(tag, c, i in section.left, tag == "td" and i in section.code)
            for i, c in enumerate(cells)
        )
        return f"<tr>{inner}</tr>"

    title = f"<h4>{markup.escape(section.title)}</h4>" if section.title else ""
    head = f"<thead>{row(section.header, 'th')}</thead>" if section.header else ""
    stacks = list(section.stacks) or [()] * len(section.rows)
    body = "".join(
        row(cells, "td", found) for cells, found in zip(section.rows, stacks, strict=True)
    )
    more = f"<p>{markup.escape(section.more)}</p>" if section.more else ""
    table = (
        '<div style="overflow-x: auto"><table style="border-collapse: collapse; '
        f'white-space: nowrap">{head}<tbody>{body}</tbody></table></div>'
    )
    return f"{title}{table}{more}"


def page(title: str, body: str) -> str:
    """A complete HTML document around the fragment `body`: one file that opens offline,
    with the inline style sheet and no scripts, fonts, images or links to fetch. Lone
    surrogates (a file name that is not UTF-8) are written as escapes."""
    return encodable(
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8"/>\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>\n'
        f"<title>{markup.escape(title)}</title>\n<style>\n{STYLE}</style>\n</head>\n"
        f"<body>\n{body}\n</body>\n</html>\n"
    )
