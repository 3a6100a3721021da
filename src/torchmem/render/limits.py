"""The pytest plugin's text: why a test failed its limit, what explains it, and the summary
of the tests with the highest peaks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchmem.records.frames import located
from torchmem.records.limits import Elsewhere, Origin, Usage, Verdict
from torchmem.render.kit import SAMPLED, size
from torchmem.render.run import details_text, growth_lines
from torchmem.render.tensors import diff_text
from torchmem.render.text import table
from torchmem.units import readable_size


def _size(nbytes: int, exact: bool = True) -> str:
    return size(nbytes, mark="" if exact else SAMPLED)


def failure(verdict: Verdict) -> str:
    """Why the test failed, in one line::

    Test was limited to 1.00M but peaked at 4.00M on cpu (4,194,304 bytes above the
    0.00B in use when it started)

    and where other threads held some of the peak, what they held, and a second line on
    ``current_thread_only``.
    """
    limit, usage = verdict.limit, verdict.usage
    began = "its setup started" if limit.setup else "it started"
    if limit.kind == "limit_memory":
        line = (
            f"Test was limited to {readable_size(limit.limit_bytes)} but peaked at"
            f" {_size(usage.rise, usage.exact)} on {limit.device} ({usage.rise:,} bytes above"
            f" the {readable_size(usage.start_bytes)} in use when {began})"
        )
        if not verdict.elsewhere:
            return line
        held = " and ".join(_elsewhere(other) for other in verdict.elsewhere)
        return (
            f"{line}, of which {held} (not the test's)\n"
            "Every thread's allocations count: current_thread_only=True counts the test's"
            " thread alone."
        )
    ended = "its teardown" if limit.setup else "it returned"
    return (
        f"Test was limited to leaking {readable_size(limit.limit_bytes)} but kept"
        f" {readable_size(usage.kept)} on {limit.device} ({usage.kept:,} bytes more in use"
        f" after {ended} and gc.collect() than when {began})"
    )


def explanation(verdict: Verdict) -> tuple[str, str] | None:
    """The report section of a failed verdict, ``(title, text)``: for a peak, the lines,
    largest allocations, categories and modules at the peak; for a leak, the tensors that
    stayed, after the growth per training step where the test's memory rose each step.
    None where there is nothing to show (process RAM)."""
    device = verdict.limit.device
    if verdict.peak is not None:
        blocks = details_text(verdict.peak, verdict.modules)
        if not blocks:
            return None
        return f"torchmem: what held memory at the peak on {device}", "\n\n".join(blocks) + "\n"
    if verdict.limit.kind == "limit_leaks" and device != "ram":
        grows = "" if verdict.growth is None else "\n".join(growth_lines(verdict.growth)) + "\n\n"
        if verdict.stayed:
            stayed = diff_text(verdict.stayed, ())
            if verdict.origins:
                stayed += _origins(verdict.origins)
            return f"torchmem: tensors that stayed on {device}", grows + stayed
        return (
            f"torchmem: tensors that stayed on {device}",
            grows + "No tensor Python can reach stayed: the memory is held where gc cannot see"
            " it (a C++ cache, a graph autograd keeps for a backward pass that never ran).\n",
        )
    return None


def _elsewhere(other: Elsewhere) -> str:
    """``16.00M from thread 'worker'``."""
    names = ", ".join(repr(name) for name in other.threads)
    if not other.threads:
        whose = "a thread that has ended"
    else:
        whose = f"thread{'s' if len(other.threads) > 1 else ''} {names}"
    return f"{readable_size(other.bytes)} from {whose}"


def _origins(origins: Sequence[Origin]) -> str:
    """The lines that allocated the tensors that stayed, a row each::

    Allocated at:
      4.00M  /home/me/project/test_model.py:21  test_no_leak  CACHE.append(...)
    """
    rows = [(readable_size(o.bytes), located(o.file, o.line), o.function, o.code) for o in origins]
    lines = ["  " + line for line in table(rows, left=(1, 2, 3))]
    return "\n".join(["Allocated at:", *lines]) + "\n"


def summary(tests: Sequence[tuple[str, Mapping[str, Usage]]], top: int) -> str:
    """Per device, the `top` tests whose peak rose highest above what was in use when they
    started, highest first (ties by test id, so that runs under xdist list alike)::

        cpu: the 2 highest peaks of 3 tests
             peak   start  test
            4.00M   0.00B  test_big.py::test_four
            1.00M  12.00K  test_big.py::test_one
    """
    by_device: dict[str, list[tuple[str, Usage]]] = {}
    for name, usages in tests:
        for device, usage in usages.items():
            by_device.setdefault(device, []).append((name, usage))
    blocks = []
    for device in sorted(by_device, key=_device_order):
        measured = by_device[device]
        shown = sorted(measured, key=lambda found: (-found[1].rise, found[0]))[:top]
        rows = [("peak", "start", "test")] + [
            (_size(u.rise, u.exact), readable_size(u.start_bytes), name) for name, u in shown
        ]
        blocks.append(
            "\n".join(
                [_heading(device, len(shown), len(measured))]
                + ["  " + line for line in table(rows, left=(2,))]
            )
        )
    if not blocks:
        return "No test was measured.\n"
    note = "Peaks are bytes above what was in use when each test started"
    if any(not u.exact for _, usages in tests for u in usages.values()):
        note += f"; {SAMPLED} marks a sampled peak (the true one may be higher)"
    return "\n\n".join(blocks) + f"\n\n{note}.\n"


def _heading(device: str, shown: int, measured: int) -> str:
    peaks = "the highest peak" if shown == 1 else f"the {shown} highest peaks"
    return f"{device}: {peaks} of {measured} test{'' if measured == 1 else 's'}"


def _device_order(device: str) -> tuple[int, str]:
    """GPUs first, then CPU tensors and other devices, process RAM last."""
    if device == "ram":
        return 2, device
    return (0 if ":" in device else 1), device
