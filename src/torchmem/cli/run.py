"""``torchmem run``: run a script (or ``-m module``) and say where its memory went."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import pkgutil
import sys
import threading
import traceback
from dataclasses import dataclass, replace
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, NamedTuple

from torchmem.cli.command import Command
from torchmem.errors import CommandError, TorchmemError
from torchmem.records import TOP

if TYPE_CHECKING:
    from torchmem.cli.live import Progress
    from torchmem.ranks import Launch, RanksReport
    from torchmem.recording import Recording, RunReport

INTERRUPTED = 130
"""The exit code of a script that Ctrl-C ended (128 + SIGINT), where it is not a signal:
the report's ``exit_code``, and :func:`torchmem.cli.main`'s return value."""


class RunCommand(Command):
    name = "run"
    help = "run a script and say where its memory went"
    description = (
        "Run a Python script (a directory or zip file with a __main__.py, or -m module) as"
        " __main__ with its own arguments, recording"
        " every allocation, then print where the memory went: per device the peak, when"
        " it happened and the end; parameters, gradients, optimizer state, buffers, activations"
        " and other bytes at the peak; the lines whose allocations were alive at the peak;"
        " the largest tensors; each module's forward and backward peak. Exits with the"
        " script's exit code. Under torchrun (torchrun [options] -m torchmem run SCRIPT)"
        " every rank records, and rank 0 prints one table of every rank and how unevenly"
        " they used memory; rank 0 writes --json and --html. The script's non-daemon"
        " threads are recorded to their end, as Python waits for them; its atexit"
        " handlers run after the report."
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.usage = "%(prog)s [options] (SCRIPT | -m MODULE) [ARGS ...]"
        parser.add_argument(
            "--device",
            help="record only this device: cpu, cuda:N, ram, ... (default: every device used)",
        )
        parser.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
        parser.add_argument(
            "--html", metavar="PATH", help="write the report as a self-contained HTML page"
        )
        parser.add_argument(
            "--snapshot",
            metavar="PATH",
            help="save the recording as a PyTorch memory snapshot (pytorch.org/memory_viz"
            " opens it; under torchrun each rank writes PATH with .rankN before its suffix)",
        )
        parser.add_argument(
            "--top",
            type=int,
            default=TOP,
            metavar="N",
            help="list N sites, tensors, modules (default: %(default)s)",
        )
        parser.add_argument(
            "-q", "--quiet", action="store_true", help="print no summary (with --json/--html)"
        )
        parser.add_argument(
            "--live",
            action="store_true",
            help="while the script runs, show on stderr (a terminal) each device's memory now"
            " and its peak so far, the lines whose CPU allocations are alive, the elapsed time"
            ' and the optimizer steps; needs rich (pip install "torchmem[live]")',
        )
        parser.add_argument(
            "--no-progress",
            dest="progress",
            action="store_false",
            help="do not show the progress line (one line on stderr, rewritten in place, shown"
            " after 3 seconds where stderr is a terminal, while the script's output is quiet;"
            " -q and runs under torchrun show none)",
        )
        parser.add_argument(
            "--no-sites",
            dest="sites",
            action="store_false",
            help="do not record which line made each allocation (costs less)",
        )
        parser.add_argument(
            "-m",
            dest="module",
            nargs=argparse.REMAINDER,
            metavar="MODULE",
            help="run a module as a script, as python -m does",
        )
        parser.add_argument("script", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS")

    def run(self, args: argparse.Namespace) -> int:
        if args.top < 1:
            raise CommandError(f"--top must be at least 1, not {args.top}", 2)
        words = args.script[1:] if args.script[:1] == ["--"] else args.script
        if args.module is not None:
            if not args.module:
                raise CommandError("-m needs a module name", 2)
            target, argv, is_module = args.module[0], args.module, True
        elif words:
            target, argv, is_module = words[0], words, False
            if not os.path.exists(target):
                raise CommandError(f"can't open file {target!r}: no such file", 2)
        else:
            raise CommandError("nothing to run: give a SCRIPT or -m MODULE", 2)
        # The report's files go where torchmem started, wherever the script moves to; a
        # path that cannot be written is said now, not after a long run.
        for option in ("json", "html", "snapshot"):
            if getattr(args, option):
                setattr(args, option, _writable(getattr(args, option), option))

        from torchmem.ranks import Launch  # PyTorch: not before the usage is known good
        from torchmem.recording import record

        try:
            recording = record(args.device, sites=args.sites)
            launch = Launch.from_environ()
        except ValueError as exc:
            raise CommandError(str(exc), 2) from None
        shown = _progress(args, recording, launch)  # rich is missing: said first
        if launch is not None:
            try:
                launch.connect()
            except (RuntimeError, OSError) as exc:
                where = f"{launch.address}:{launch.port}"
                raise CommandError(f"cannot reach the launcher's store at {where}: {exc}") from None
        run = _Run(args, tuple(argv), recording, launch, ModuleType("__main__"), os.getpid(), shown)
        threads = set(threading.enumerate())
        recording.start()
        try:
            if shown is not None:
                shown.start()
            code, error, interrupted = _execute(target, argv, is_module, run.main)
        except _NotRunnable as exc:  # as python says it: one line, no report of nothing
            run.abort()
            raise CommandError(str(exc)) from None
        except BaseException:
            run.abort(vars(run.main))
            raise
        if any(not t.daemon for t in set(threading.enumerate()) - threads):
            # Python waits for the script's non-daemon threads when this returns, then runs
            # the atexit handlers, the last registered first: the report comes after the
            # threads, before the script's own handlers.
            atexit.register(_finish_at_exit, run, code, error)
        else:
            code = run.finish(code, error)
        if interrupted:
            # As python: the process dies by SIGINT once the atexit handlers have run, so
            # that a shell loop over it stops too (see torchmem.cli.run).
            raise KeyboardInterrupt
        return code


@dataclass(frozen=True)
class _Run:
    """A script's run under a recording, and what its end needs."""

    args: argparse.Namespace
    command: tuple[str, ...]
    recording: Recording
    launch: Launch | None
    main: ModuleType
    """The script's ``__main__``: its globals name the tensors they hold in the report."""
    pid: int
    """The process that started the recording: the only one that reports."""
    progress: Progress | None = None
    """What shows the run while it runs (``--live``, the progress line): gone before the
    report."""

    def abort(self, variables: dict[str, object] | None = None) -> None:
        """Stop showing the run, and stop the recording (`variables` name its tensors)."""
        _stop(self.progress)
        self.recording.stop(variables)

    def finish(self, code: int, error: str | None) -> int:
        """Stop the recording, print and write the report; return the exit code `code`.

        In a child the script forked, nothing: the report is its parent's (the child's
        meters stopped counting at the fork), and it must neither print a second one nor
        overwrite the parent's files.
        """
        if os.getpid() != self.pid:
            return code
        _stop(self.progress)
        args, launch = self.args, self.launch
        self.recording.stop(vars(self.main))
        report = replace(self.recording.report(args.top), exit_code=code, command=self.command)
        written = True
        if launch is None:
            written = _publish(report, args)
        else:
            try:
                ranks = launch.exchange(report, error, top=args.top)
                if ranks is not None:
                    written = _publish(ranks, args)
            finally:
                launch.finish()
        if args.snapshot:
            path = Path(args.snapshot)
            if launch is not None:
                path = path.with_name(f"{path.stem}.rank{launch.rank}{path.suffix}")
            try:
                self.recording.save_snapshot(path)
            except (TorchmemError, OSError) as exc:
                written = _failed_to_write("--snapshot", exc)
        return code if written or code else 1


def _finish_at_exit(run: _Run, code: int, error: str | None) -> None:
    """:meth:`_Run.finish` as Python exits (the exit code is the script's by then: an
    atexit handler cannot change it)."""
    try:
        run.finish(code, error)
    except CommandError as exc:
        _say(f"torchmem run: error: {exc}")


def _progress(
    args: argparse.Namespace, recording: Recording, launch: Launch | None
) -> Progress | None:
    """What shows the run while it runs: the ``--live`` view (under torchrun, rank 0's),
    the progress line (never under torchrun, whose ranks share a terminal), or nothing."""
    from torchmem.cli.live import progress

    live = args.live and (launch is None or launch.rank == 0)
    wanted = args.progress and not args.quiet and launch is None
    try:
        shown = progress(recording, live, wanted, sys.stderr)
    except ImportError as exc:
        raise CommandError(str(exc), 2) from None
    if live and shown is None:
        _say("torchmem run: --live shows nothing here: stderr is not a terminal")
    return shown


def _stop(progress: Progress | None) -> None:
    if progress is not None:
        progress.stop()


def _writable(path: str, option: str) -> str:
    """`path` made absolute, once it is known that a file can be written there."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    why = None
    if os.path.isdir(path):
        why = "it is a directory"
    elif not os.path.isdir(folder):
        why = f"no directory {folder}"
    elif not os.access(folder if not os.path.exists(path) else path, os.W_OK):
        why = "permission denied"
    if why is not None:
        raise CommandError(f"cannot write --{option} {path}: {why}", 2)
    return path


def _publish(report: RunReport | RanksReport, args: argparse.Namespace) -> bool:
    """Print `report` on stderr unless ``--quiet``, then write it where the options say;
    return whether every file was written (each one that was not is said in one line)."""
    if not args.quiet:
        _say(f"\n{report}")
    written = True
    for option, save in (("--json", report.save_json), ("--html", report.save_html)):
        path = getattr(args, option[2:])
        if path:
            try:
                save(path)
            except OSError as exc:
                written = _failed_to_write(option, exc)
    return written


def _failed_to_write(option: str, error: Exception) -> bool:
    """Say in one line on stderr that `option`'s file was not written; return False."""
    _say(f"torchmem run: error: {option} not written: {error}")
    return False


def _say(text: str) -> None:
    """Print `text` on stderr, where the script left one: a script may close it (Python
    then exits as the script asked, and so does this)."""
    with contextlib.suppress(ValueError, AttributeError):  # closed, or None
        sys.stdout.flush()
    with contextlib.suppress(ValueError, AttributeError):
        print(text, file=sys.stderr, flush=True)


class _Ended(NamedTuple):
    """How the script ended."""

    code: int
    """Its exit code."""
    error: str | None
    """The last line of its traceback (``"ValueError: boom"``), where it raised."""
    interrupted: bool
    """Whether by Ctrl-C (a KeyboardInterrupt it did not catch)."""


class _NotRunnable(Exception):
    """Nothing to run: no such module, no ``__main__`` in the directory. Said in one line,
    as ``python`` says it, with no report (the script never started)."""


def _execute(target: str, argv: list[str], is_module: bool, main: ModuleType) -> _Ended:
    """Run `target` in `main` as ``__main__`` with ``sys.argv`` = `argv`, as ``python``
    runs a script, a directory or zip file with a ``__main__.py``, or (``python -m``) a
    module; say how it ended.

    ``sys.argv``, ``sys.path`` and ``__main__`` stay the script's afterwards, as under
    ``python``: its threads and atexit handlers run after it returns, and may pickle a
    class it defined or import a module next to it.

    An uncaught exception prints its traceback through ``sys.excepthook``, as Python
    would, without torchmem's frames (a hook that raises gets Python's own words, then
    the original traceback); under ``torchrun`` it also goes to the launcher's error
    file, which torchrun's failure summary shows.
    """
    sys.argv = list(argv)
    sys.modules["__main__"] = main
    try:
        if is_module:
            sys.path.insert(0, os.getcwd())
            _run_module(target, main)
        else:
            _run_path(target, main)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return _Ended(exc.code or 0, None, False)
        with contextlib.suppress(ValueError, AttributeError):  # a stderr the script closed
            print(exc.code, file=sys.stderr)
        return _Ended(1, None, False)
    except _NotRunnable:
        raise
    except BaseException as exc:  # the script's own error: shown as Python shows it
        show_uncaught(exc)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # Only a courtesy to torchrun's summary: it must not replace the script's error.
            with contextlib.suppress(ImportError, OSError):
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler

                get_error_handler().record_exception(exc)
        error = traceback.format_exception_only(exc)[-1].strip()
        interrupted = isinstance(exc, KeyboardInterrupt)
        return _Ended(INTERRUPTED if interrupted else 1, error, interrupted)
    return _Ended(0, None, False)


def show_uncaught(error: BaseException) -> None:
    """Show the script's `error` through ``sys.excepthook``, as Python does an uncaught
    one, without torchmem's frames before the script's; where the hook itself raises, as
    Python does then: the hook's error, then the original."""
    error = error.with_traceback(_user_frames(error.__traceback__))
    try:
        sys.excepthook(type(error), error, error.__traceback__)
    except BaseException as hook_error:  # the script's hook: whatever it raises
        with contextlib.suppress(ValueError, AttributeError):  # a stderr the script closed
            print("Error in sys.excepthook:", file=sys.stderr)
            sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
            print("\nOriginal exception was:", file=sys.stderr)
            sys.__excepthook__(type(error), error, error.__traceback__)


def _run_path(path: str, main: ModuleType) -> None:
    """Execute the script at `path`, or the ``__main__.py`` of the directory or zip file
    at `path`, with ``sys.path[0]`` where ``python`` puts it."""
    where = os.path.abspath(path)
    importer = pkgutil.get_importer(where)  # None for a plain file
    if importer is None:
        sys.path.insert(0, os.path.dirname(where))
        run_script(path, main)
        return
    spec = importer.find_spec("__main__")
    if spec is None:
        raise _NotRunnable(f"can't find '__main__' module in {path!r}")
    sys.path.insert(0, where)
    _exec_spec(spec, main, package="")


def run_script(path: str, main: ModuleType) -> None:
    """Execute the file at `path` in `main`. Its ``__file__`` is absolute, as ``python``
    gives it, so that it stays valid after ``os.chdir``; its code keeps `path` as given,
    the name tracebacks and the report show."""
    source = Path(path).read_bytes()
    code = compile(source, path, "exec", dont_inherit=True)
    # Joined, not normalized: python's own absolute path ("/home/me/./train.py").
    vars(main).update(
        __file__=os.path.join(os.getcwd(), path), __builtins__=__builtins__, __cached__=None
    )
    exec(code, vars(main))


def _run_module(name: str, main: ModuleType) -> None:
    """Execute module `name` (a package: its ``__main__``) in `main`, as ``python -m``
    does: ``sys.argv[0]`` becomes its file."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations is not None:
        package, spec = name, importlib.util.find_spec(f"{name}.__main__")
        if spec is None:
            raise _NotRunnable(
                f"No module named {package}.__main__;"
                f" {package!r} is a package and cannot be directly executed"
            )
    if spec is None:
        raise _NotRunnable(f"No module named {name}")
    sys.argv[0] = spec.origin or name
    _exec_spec(spec, main, package=spec.parent or "")


def _exec_spec(spec: ModuleSpec, main: ModuleType, package: str) -> None:
    """Execute the module that `spec` finds in `main`, as its ``__main__``."""
    get_code = getattr(spec.loader, "get_code", None)
    code = get_code(spec.name) if get_code is not None else None
    if code is None:
        raise _NotRunnable(f"No code object available for {spec.name}")
    vars(main).update(
        __file__=spec.origin,
        __cached__=spec.cached,
        __loader__=spec.loader,
        __package__=package,
        __spec__=spec,
        __builtins__=__builtins__,
    )
    exec(code, vars(main))


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without its leading frames of torchmem and of Python's import machinery."""
    while tb is not None and (
        tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen ")
    ):
        tb = tb.tb_next
    return tb


_PACKAGE = os.path.dirname(os.path.dirname(__file__)) + os.sep
"""torchmem's folder: its files' names start with it."""
