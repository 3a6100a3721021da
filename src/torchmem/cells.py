"""The per-cell memory logger: after every notebook cell, what it used and peaked.

``CellLogger`` (also ``IPyGPULogger``, ipygpulogger's name) opens a peak window on each of
two meters when a cell starts and reads it when the cell ends:

- general RAM: this process's resident memory, ``meter("ram")``; exact peaks on Linux
  (the kernel's ``VmHWM``);
- GPU: PyTorch's caching allocator on the current GPU, ``meter("cuda")``, exact peaks,
  with the whole device's used memory (all processes, ``device_meter()``) as the total.
  Where there is no GPU, CPU tensors, ``meter("cpu")``, exact to the byte, and the row
  says so.

IPython is imported only when a logger starts without being given a shell.
"""

from __future__ import annotations

import contextlib
import gc
import reprlib
import time
from types import TracebackType
from typing import Any

from torchmem.errors import TorchmemError, require
from torchmem.meters import DeviceMeter, Meter, Window, device_meter, meter
from torchmem.recording import Recording
from torchmem.records.cells import CellRecord, Data
from torchmem.records.run import Growth
from torchmem.resolve import resolve_device


class CellLogger:
    """Report the memory every IPython/Jupyter cell used and peaked, and how long it ran.

    After each cell it prints ipygpulogger's report, in whole MB::

        RAM: Consumed Peaked  Used Total  in 0.000s (In [4])
        Gen:       45      0    170 MB
        GPU:     2467      0   1465 MB

    *Consumed* is memory in use after the cell minus before it; *Peaked* how far use
    rose during the cell above both (the temporary memory the cell needed beyond what it
    kept, never negative); *Used Total* the use after the cell. ``Gen`` is this process's
    RAM; ``GPU`` PyTorch's tensors on the current GPU, with the whole device's use as the
    total; without a GPU the row is ``CPU tensors``. Peaks are exact, including a
    temporary allocated and freed inside one call.

    Args:
        compact: print one line per cell instead of three.
        gc_collect: run ``gc.collect()`` when the logger starts and at the end of each
            cell before reading it (one collection per cell), so memory only waiting for
            the garbage collector does not count. Turn it off when looking for reference
            cycles that hold memory.
        shell: the IPython shell to log; default the running one (``get_ipython()``).
            Anything without IPython's ``events.register`` is a TypeError.
        steps: also record each cell (``torchmem.record()`` of the second row's device,
            with the line of each allocation), and where the cell runs a training loop
            whose memory rises at the end of each step, say after the report by how
            much, from which lines and why (:attr:`CellRecord.growth`). It costs what a
            recording costs: a frame walk per allocation, PyTorch's global hooks.

    Use :meth:`start` and :meth:`stop` (each returns the logger, and both are harmless
    to repeat), or ``with CellLogger(): ...``. A cell that starts the logger is reported
    from that point on; a cell that stops it is not reported. ``%%capture`` cells and
    other cells that run cells inside them get one report.
    """

    def __init__(
        self,
        compact: bool = False,
        gc_collect: bool = True,
        shell: Any = None,
        steps: bool = False,
    ) -> None:
        if shell is not None and not callable(
            getattr(getattr(shell, "events", None), "register", None)
        ):
            raise TypeError(
                "shell must be an IPython shell (get_ipython()) or None, not"
                f" {reprlib.repr(shell)} ({type(shell).__name__})"
            )
        self.compact = compact
        """Print one line per cell instead of three."""
        self.gc_collect = gc_collect
        """Run ``gc.collect()`` at the start and before each cell's reading."""
        self.shell = shell
        """The shell logged (None until :meth:`start` when not given)."""
        self.steps = steps
        """Record each cell, and report the growth per training step of one that grows."""
        self.history: list[CellRecord] = []
        """Every reported cell's record, oldest first."""
        self._registered = False
        self._depth = 0
        self._windows: tuple[Window, Window] | None = None
        self._recording: Recording | None = None
        self._meters: tuple[Meter, Meter, DeviceMeter | None] | None = None
        self._started_at = 0.0

    # Starting and stopping ------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._registered

    def start(self) -> CellLogger:
        """Start logging (from now on, when called inside a cell); return the logger."""
        if self._registered:
            return self
        if self.shell is None:
            ipython = require("IPython", "CellLogger.start() without a shell", "notebook")
            self.shell = ipython.get_ipython()
            if self.shell is None:
                raise TorchmemError(
                    "no IPython shell is running: start the cell logger in IPython or "
                    "Jupyter, or pass shell=..."
                )
        self._meters = _choose_meters()
        self.shell.events.register("pre_run_cell", self._pre_run_cell)
        self.shell.events.register("post_run_cell", self._post_run_cell)
        self._registered = True
        self._depth = 0
        self._open(collect=self.gc_collect)
        return self

    def stop(self) -> CellLogger:
        """Stop logging, without a report for the cell that stops it; return the logger."""
        if not self._registered:
            return self
        for event, callback in (
            ("pre_run_cell", self._pre_run_cell),
            ("post_run_cell", self._post_run_cell),
        ):
            with contextlib.suppress(ValueError):  # someone removed it already
                self.shell.events.unregister(event, callback)
        self._registered = False
        self._depth = 0
        self._close()
        return self

    def __enter__(self) -> CellLogger:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # Results --------------------------------------------------------------------------

    @property
    def data(self) -> Data:
        """The last reported cell's figures, ipygpulogger's ``Data`` namedtuple (whole MB
        and seconds); all zeros before the first report. Read inside a cell, it is the
        previous cell's."""
        if not self.history:
            return Data(0, 0, 0, 0, 0, 0, 0.0)
        return self.history[-1].data()

    def report(self, record: CellRecord | None = None) -> str:
        """The text printed for `record` (default the last cell), full or compact."""
        from torchmem.render import cells

        record = record if record is not None else self._last()
        return cells.compact(record) if self.compact else cells.text(record)

    def to_dataframe(self) -> Any:
        """:attr:`history` as a ``pandas.DataFrame``, one row per cell, bytes and seconds
        (pandas must be installed)."""
        from torchmem.render import cells

        return cells.dataframe(self.history)

    def plot(self) -> Any:
        """A matplotlib ``Figure`` of memory per cell: used after each cell and the peak
        during it, general RAM above, GPU (or CPU tensors) below, in MiB. For the GPU row
        the peak is drawn above the whole device's use. Needs matplotlib."""
        from torchmem.render import cells

        return cells.figure(self.history)

    def _last(self) -> CellRecord:
        if not self.history:
            raise TorchmemError("no cell has been logged yet")
        return self.history[-1]

    # IPython events -------------------------------------------------------------------

    def _pre_run_cell(self, info: Any = None) -> None:
        """IPython's ``pre_run_cell``; `info` (IPython >= 7) is not needed."""
        self._depth += 1
        if self._depth == 1:
            # The last report (or start()) collected already; between cells IPython
            # makes no garbage worth a second full collection (~75 ms with torch loaded).
            self._open(collect=False)

    def _post_run_cell(self, result: Any = None) -> None:
        """IPython's ``post_run_cell``: report the cell, once for the outermost one."""
        if self._depth > 0:
            self._depth -= 1
            if self._depth > 0:  # a cell run inside a cell (%%capture): wait for the outer
                return
        if self._windows is None:  # an empty cell: IPython ran nothing
            return
        record = self._read(result)
        self._close()
        self.history.append(record)
        print(self.report(record))

    # Measuring ------------------------------------------------------------------------

    def _open(self, collect: bool) -> None:
        self._close()
        if collect:
            gc.collect()
        assert self._meters is not None
        gen, gpu, _ = self._meters
        self._windows = (gen.window(), gpu.window())
        if self.steps:
            self._recording = Recording(gpu.device).start()
        self._started_at = time.perf_counter()

    def _close(self) -> None:
        if self._windows is not None:
            for window in self._windows:
                window.close()
            self._windows = None
        if self._recording is not None:
            self._recording.stop()
            self._recording = None

    def _growth(self) -> Growth | None:
        """The growth per step of the cell recorded (its recording then stopped)."""
        if self._recording is None:
            return None
        recording, self._recording = self._recording, None
        recording.stop(getattr(self.shell, "user_ns", None))
        return recording.growth(recording.device or "cpu")

    def _read(self, result: Any) -> CellRecord:
        elapsed = time.perf_counter() - self._started_at
        if self.gc_collect:
            gc.collect()
        assert self._windows is not None and self._meters is not None
        gen_meter, gpu_meter, whole_gpu = self._meters
        gen = _figures(gen_meter, self._windows[0])
        gpu = _figures(gpu_meter, self._windows[1])
        gpu_used = gpu[2] if whole_gpu is None else whole_gpu.used()
        growth = self._growth()
        failed = bool(
            result is not None
            and (
                getattr(result, "error_before_exec", None) is not None
                or getattr(result, "error_in_exec", None) is not None
            )
        )
        return CellRecord(
            execution_count=getattr(result, "execution_count", None),
            gen_used_delta=gen[0],
            gen_peaked=gen[1],
            gen_used=gen[2],
            gpu_used_delta=gpu[0],
            gpu_peaked=gpu[1],
            gpu_used=gpu_used,
            time_delta=elapsed,
            gpu_device=gpu_meter.device,
            failed=failed,
            growth=growth,
        )

    def __repr__(self) -> str:
        state = "running" if self._registered else "stopped"
        return f"<{type(self).__name__} {state}, {len(self.history)} cells logged>"


IPyGPULogger = CellLogger


def _choose_meters() -> tuple[Meter, Meter, DeviceMeter | None]:
    """Process RAM; the current GPU's allocator and the whole device, or CPU tensors."""
    device = resolve_device()
    whole = device_meter(device.index) if device.type == "cuda" else None
    return meter("ram"), meter(device), whole


def _figures(pool: Meter, window: Window) -> tuple[int, int, int]:
    """(used delta, peaked above start and end, used now), bytes."""
    end = pool.used()
    peak = max(window.peak(), end)
    return end - window.start, max(0, peak - max(window.start, end)), end
