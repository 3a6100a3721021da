"""A multi-process run's memory per rank: a terminal table, HTML for Jupyter, a
self-contained HTML page, and pandas.

Every renderer reads a :class:`~torchmem.records.ranks.RanksRecord` and shows the same
things: one row per rank and device (its peak, the caching allocator's reserved peak on
GPUs, the end, the category that held most at the peak, the process's RAM peak and the
script's exit code), each rank's categories at its peak and which rank held the most of
each, how unevenly the ranks peaked, which ranks raised or never reported, and the rank
with the highest peak in detail.
"""

from __future__ import annotations

import html as markup
from typing import Any

from torchmem.errors import require
from torchmem.records.ranks import Imbalance, RankRun, RanksRecord
from torchmem.records.run import CATEGORIES, DeviceRun
from torchmem.render import chart, run as single
from torchmem.render.kit import (
    MISSING,
    SAMPLED,
    Section,
    page as page_of,
    section_html,
    section_text,
    size,
)
from torchmem.units import readable_size

TITLE = "torchmem: memory per rank"


def _headline(record: RanksRecord) -> str:
    hosts = len({run.host for run in record.ranks})
    ranks = f"{record.world_size} rank{'s' if record.world_size != 1 else ''}"
    on = f" on {hosts} host{'s' if hosts != 1 else ''}" if record.ranks else ""
    scripts = any(run.report.exit_code is not None for run in record.ranks)
    code = f", exit code {record.exit_code}" if scripts or record.missing else ""
    return f"{TITLE} ({ranks}{on}{code})"


def _shown(run: RankRun) -> list[DeviceRun]:
    """The devices a rank's rows show: all but process RAM, which is a column (RAM alone
    where nothing else was recorded)."""
    devices = [device for name, device in run.report.devices.items() if name != "ram"]
    ram = run.report.devices.get("ram")
    return devices or ([ram] if ram is not None else [])


def _most(device: DeviceRun) -> str:
    """The category with the most bytes at the peak, with those bytes."""
    at_peak = device.categories_at_peak
    if not at_peak:
        return MISSING
    name = max(at_peak, key=lambda n: (at_peak[n], -_order(n)))
    return f"{name} {readable_size(at_peak[name])}"


def _order(category: str) -> int:
    return CATEGORIES.index(category) if category in CATEGORIES else len(CATEGORIES)


def _rows(run: RankRun) -> list[tuple[str, DeviceRun | None]]:
    """The devices of a rank's rows: :func:`_shown`, then each GPU that only NVML saw its
    process hold memory on (no recording of it: None)."""
    shown: list[tuple[str, DeviceRun | None]] = [(d.device, d) for d in _shown(run)]
    names = {name for name, _ in shown}
    return shown + [(name, None) for name in run.gpu_process_bytes if name not in names]


def _table(record: RanksRecord) -> Section:
    rows_of = [(run, name, device) for run in record.ranks for name, device in _rows(run)]
    recorded = [device for _, _, device in rows_of if device is not None]
    reserved = any(device.reserved_peak_bytes is not None for device in recorded)
    nvml = any(run.gpu_process_bytes for run in record.ranks)
    header: tuple[str, ...] = ("rank", "host", "device", "peak")
    header += ("reserved peak",) if reserved else ()
    header += ("end", "most at the peak")
    header += ("process on the GPU",) if nvml else ()
    header += ("ram peak", "exit")
    rows = []
    for run, name, device in rows_of:
        ram = run.report.devices.get("ram")
        row: tuple[str, ...] = (str(run.rank), run.host, name)
        if device is None:  # peak, reserved peak, end, most at the peak: not recorded
            row += (MISSING,) * (4 if reserved else 3)
        else:
            row += (size(device.peak_bytes, mark="" if device.exact else SAMPLED),)
            row += (size(device.reserved_peak_bytes),) if reserved else ()
            row += (readable_size(device.end_bytes), _most(device))
        if nvml:
            row += (size(run.gpu_process_bytes.get(name)),)
        row += (
            MISSING if ram is None or ram is device else readable_size(ram.peak_bytes),
            MISSING if run.report.exit_code is None else str(run.report.exit_code),
        )
        rows.append(row)
    sampled = not all(device.exact for device in recorded)
    more = f"{SAMPLED} sampled, not exact: the true peak may be higher." if sampled else ""
    left = (1, 2, header.index("most at the peak"))
    return Section("", rows, left=left, header=header, more=more)


def _categories(record: RanksRecord) -> Section | None:
    """With more than one rank: each rank's memory at its peak by category (those any rank
    had), and which rank held the most of each category that differs between them."""
    held = [(run.rank, d) for run in record.ranks for d in _shown(run) if d.categories_at_peak]
    if len(record.ranks) < 2 or not held:
        return None
    names = [n for n in CATEGORIES if any((d.categories_at_peak or {}).get(n) for _, d in held)]
    sizes = [[(d.categories_at_peak or {}).get(n, 0) for n in names] for _, d in held]
    rows = [
        (str(rank), d.device, *map(readable_size, row))
        for (rank, d), row in zip(held, sizes, strict=True)
    ]
    most = []
    for i, name in enumerate(names):
        if len({row[i] for row in sizes}) > 1:
            top = max(range(len(held)), key=lambda k: (sizes[k][i], -held[k][0]))
            most.append(f"{name} on rank {held[top][0]} ({readable_size(sizes[top][i])})")
    more = f"Most of each: {'; '.join(most)}." if most else "Every rank held the same of each."
    header = ("rank", "device", *names)
    return Section("Each rank at its peak, by category:", rows, (1,), header, more)


def _ranks(ranks: list[int]) -> str:
    """``Rank 3``, ``Ranks 1 and 2``, ``Ranks 0-5, 7 and 9``: consecutive ranks as a range."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][-1] + 1:
            spans[-1].append(rank)
        else:
            spans.append([rank])
    parts = [f"{s[0]}-{s[-1]}" if len(s) > 2 else ", ".join(map(str, s)) for s in spans]
    words = ", ".join(parts).rsplit(", ", 1)
    if len(ranks) == 1:
        return f"Rank {ranks[0]}"
    return "Ranks " + (" and ".join(words) if len(words) == 2 else words[0])


def _elsewhere_text(record: RanksRecord) -> list[str]:
    """One line per GPU that ranks held memory on without it being their own."""
    by_device: dict[str, list[tuple[int, int]]] = {}
    for item in record.elsewhere:
        by_device.setdefault(item.device, []).append((item.rank, item.bytes))
    lines = []
    for device, held in by_device.items():
        one = len(held) == 1
        sizes = ", ".join(readable_size(size) for _, size in held)
        lines.append(
            f"{_ranks([rank for rank, _ in held])} {'holds' if one else 'hold'} memory on"
            f" {device}, which is not {'its' if one else 'their'} GPU ({sizes}, NVML): a CUDA"
            " context or tensors made there, as a missing torch.cuda.set_device(local_rank),"
            " or torch.load without map_location, does."
        )
    return lines


def imbalance_text(imbalance: Imbalance) -> str:
    """``Imbalance on cpu: rank 3 peaked at 32.00M, 4.00x rank 0's 8.00M; ...``."""
    high, low = imbalance.highest_bytes, imbalance.lowest_bytes
    ratio = imbalance.ratio
    times = f"{ratio:.2f}x" if ratio != float("inf") else "above"
    line = (
        f"Imbalance on {imbalance.kind}: rank {imbalance.highest_rank} peaked at"
        f" {readable_size(high)}, {times} rank {imbalance.lowest_rank}'s {readable_size(low)}"
    )
    if imbalance.category is not None:
        line += (
            f"; the category that differs most is {imbalance.category}:"
            f" {readable_size(imbalance.category_high_bytes)} on rank"
            f" {imbalance.category_high_rank} against"
            f" {readable_size(imbalance.category_low_bytes)} on rank {imbalance.category_low_rank}"
        )
    return line + "."


def _remarks(record: RanksRecord) -> list[str]:
    lines = []
    if record.imbalance is not None:
        lines.append(imbalance_text(record.imbalance))
    lines += _elsewhere_text(record)
    errors: dict[str, list[int]] = {}
    for run in record.ranks:
        if run.error is not None:
            errors.setdefault(run.error, []).append(run.rank)
    for error, ranks in errors.items():
        where = (
            f"the traceback is in rank {ranks[0]}'s output"
            if len(ranks) == 1
            else "the tracebacks are in their outputs"
        )
        lines.append(f"{_ranks(ranks)} raised {error} ({where}).")
    if record.missing:
        one = len(record.missing) == 1
        lines.append(
            f"{_ranks(list(record.missing))} sent no report: {'it' if one else 'they'} died,"
            " or had not finished by then."
        )
    return lines


def highest(record: RanksRecord) -> RankRun | None:
    """The rank whose main device peaked highest (the lowest such rank on a tie)."""
    if record.imbalance is not None:
        return next(r for r in record.ranks if r.rank == record.imbalance.highest_rank)
    return record.ranks[0] if record.ranks else None


def text(record: RanksRecord, top: int = 10) -> str:
    """The terminal summary::

        torchmem: memory per rank (2 ranks on 1 host, exit code 0)

        rank  host   device    peak    end  most at the peak  ram peak  exit
           0  node1  cpu      8.00M  0.00B  other 8.00M        250.00M     0
           1  node1  cpu     16.00M  0.00B  other 16.00M       258.00M     0

        Imbalance on cpu: rank 1 peaked at 16.00M, 2.00x rank 0's 8.00M; the category ...

    and then the report of the rank with the highest peak, as a single process prints it
    (:func:`torchmem.render.run.text`, `top` lines per list).
    """
    blocks = [[_headline(record)], section_text(_table(record))]
    categories = _categories(record)
    if categories is not None:
        blocks.append(section_text(categories))
    remarks = _remarks(record)
    if remarks:
        blocks.append(remarks)
    detail = highest(record)
    if detail is not None and len(record.ranks) > 1:
        blocks.append([f"Rank {detail.rank}, the highest peak, in detail:"])
    if detail is not None:
        blocks.append([single.text(detail.report, top)])
    return "\n\n".join("\n".join(block) for block in blocks)


def html(record: RanksRecord, top: int = 10) -> str:
    """:func:`text` as an HTML fragment: the table, the remarks, then every rank's report
    in a ``<details>`` element that opens without scripts (the highest rank's open), and
    once the script of the charts' hover."""
    parts = [f"<h3>{markup.escape(_headline(record))}</h3>", section_html(_table(record))]
    categories = _categories(record)
    if categories is not None:
        parts.append(section_html(categories))
    parts += [f"<p>{markup.escape(line)}</p>" for line in _remarks(record)]
    detail = highest(record)
    for run in record.ranks:
        opened = " open" if run is detail else ""
        parts.append(
            f"<details{opened}><summary>rank {run.rank} on {markup.escape(run.host)}</summary>"
            f"{single.html(run.report, top, hover=False)}</details>"
        )
    if record.ranks:
        parts.append(f"<script>\n{chart.SCRIPT}</script>")
    return '<div class="torchmem-ranks">' + "\n".join(parts) + "</div>"


def page(record: RanksRecord, top: int = 10) -> str:
    """A complete HTML document of :func:`html` that opens offline (no scripts, fonts,
    images or links to fetch)."""
    return page_of(TITLE, html(record, top))


def dataframe(record: RanksRecord) -> Any:
    """One row per rank and device: ``rank``, ``host``, ``device``, ``start_bytes``,
    ``peak_bytes``, ``peak_time`` (seconds), ``end_bytes``, ``reserved_peak_bytes``
    (GPUs), ``exit_code``. Needs pandas."""
    pd = require("pandas", "a per-rank DataFrame")
    rows = [(run, device) for run in record.ranks for device in run.report.devices.values()]

    def column(values: list[Any], dtype: str) -> Any:
        return pd.array(values, dtype=dtype)

    return pd.DataFrame(
        {
            "rank": column([run.rank for run, _ in rows], "int64"),
            "host": [run.host for run, _ in rows],
            "device": [device.device for _, device in rows],
            "start_bytes": column([d.start_bytes for _, d in rows], "int64"),
            "peak_bytes": column([d.peak_bytes for _, d in rows], "int64"),
            "peak_time": column([d.peak_time for _, d in rows], "float64"),
            "end_bytes": column([d.end_bytes for _, d in rows], "int64"),
            "reserved_peak_bytes": column([d.reserved_peak_bytes for _, d in rows], "Int64"),
            "exit_code": column([run.report.exit_code for run, _ in rows], "Int64"),
        }
    )
