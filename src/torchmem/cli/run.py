"""``torchmem run``: run a script (or ``-m module``) and say where its memory went."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import sys
import threading
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING

from torchmem.cli.command import Command
from torchmem.errors import CommandError, TorchmemError

if TYPE_CHECKING:
    from torchmem.ranks import Launch, RanksReport
    from torchmem.recorder import Recording, RunReport


class RunCommand(Command):
    name = "run"
    help = "run a script and say where its memory went"
    description = (
        "Run a Python script (or -m module) as __main__ with its own arguments, recording"
        " every allocation, then print where the memory went: per device the peak, when"
        " it happened and the end; parameters, gradients, optimizer state, activations"
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
            "--top", type=int, default=10, metavar="N", help="list N sites, tensors, modules"
        )
        parser.add_argument(
            "-q", "--quiet", action="store_true", help="print no summary (with --json/--html)"
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
        from torchmem.ranks import Launch
        from torchmem.recorder import record

        if args.top < 1:
            raise CommandError(f"--top must be at least 1, not {args.top}", 2)
        words = args.script[1:] if args.script[:1] == ["--"] else args.script
        if args.module is not None:
            if not args.module:
                raise CommandError("-m needs a module name", 2)
            target, argv, is_module = args.module[0], args.module, True
        elif words:
            target, argv, is_module = words[0], words, False
            if not Path(target).is_file():
                raise CommandError(f"can't open file {target!r}: no such file", 2)
        else:
            raise CommandError("nothing to run: give a SCRIPT or -m MODULE", 2)
        # The report's files go where torchmem started, wherever the script moves to.
        for option in ("json", "html", "snapshot"):
            if getattr(args, option):
                setattr(args, option, os.path.abspath(getattr(args, option)))
        try:
            recording = record(args.device, sites=args.sites)
            launch = Launch.from_environ()
        except ValueError as exc:
            raise CommandError(str(exc), 2) from None
        if launch is not None:
            try:
                launch.connect()
            except (RuntimeError, OSError) as exc:
                where = f"{launch.address}:{launch.port}"
                raise CommandError(f"cannot reach the launcher's store at {where}: {exc}") from None
        run = _Run(args, tuple(argv), recording, launch, ModuleType("__main__"), os.getpid())
        threads = set(threading.enumerate())
        recording.start()
        try:
            code, error = _execute(target, argv, is_module, run.main)
        except BaseException:
            recording.stop(vars(run.main))
            raise
        if any(not t.daemon for t in set(threading.enumerate()) - threads):
            # Python waits for the script's non-daemon threads when this returns, then runs
            # the atexit handlers, the last registered first: the report comes after the
            # threads, before the script's own handlers.
            atexit.register(_finish_at_exit, run, code, error)
            return code
        return run.finish(code, error)


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

    def finish(self, code: int, error: str | None) -> int:
        """Stop the recording, print and write the report; return the exit code `code`.

        In a child the script forked, nothing: the report is its parent's (the child's
        meters stopped counting at the fork), and it must neither print a second one nor
        overwrite the parent's files.
        """
        if os.getpid() != self.pid:
            return code
        args, launch = self.args, self.launch
        self.recording.stop(vars(self.main))
        report = replace(self.recording.report(args.top), exit_code=code, command=self.command)
        if launch is None:
            _publish(report, args)
        else:
            try:
                ranks = launch.exchange(report, error, top=args.top)
                if ranks is not None:
                    _publish(ranks, args)
            finally:
                launch.finish()
        if args.snapshot:
            path = Path(args.snapshot)
            if launch is not None:
                path = path.with_name(f"{path.stem}.rank{launch.rank}{path.suffix}")
            try:
                self.recording.save_snapshot(path)
            except TorchmemError as exc:
                raise CommandError(str(exc)) from None
        return code


def _finish_at_exit(run: _Run, code: int, error: str | None) -> None:
    """:meth:`_Run.finish` as Python exits; a report it cannot write is said in one line
    on stderr (the exit code is the script's by then: an atexit handler cannot change it)."""
    try:
        run.finish(code, error)
    except (CommandError, OSError) as exc:
        with contextlib.suppress(OSError, ValueError):
            print(f"torchmem run: error: {exc}", file=sys.stderr)


def _publish(report: RunReport | RanksReport, args: argparse.Namespace) -> None:
    """Write `report` where the options say, and print it on stderr unless ``--quiet``."""
    if args.json:
        report.save_json(args.json)
    if args.html:
        report.save_html(args.html)
    if not args.quiet:
        sys.stdout.flush()
        print(f"\n{report}", file=sys.stderr)


def _execute(
    target: str, argv: list[str], is_module: bool, main: ModuleType
) -> tuple[int, str | None]:
    """Run `target` in `main` as ``__main__`` with ``sys.argv`` = `argv`, as ``python``
    runs a script (``python -m`` a module); return its exit code and, where it raised,
    the last line of its traceback (``"ValueError: boom"``).

    ``sys.argv``, ``sys.path`` and ``__main__`` stay the script's afterwards, as under
    ``python``: its threads and atexit handlers run after it returns, and may pickle a
    class it defined or import a module next to it.

    An uncaught exception prints its traceback through ``sys.excepthook``, as Python
    would, without torchmem's frames; under ``torchrun`` it also goes to the launcher's
    error file, which torchrun's failure summary shows.
    """
    sys.argv = list(argv)
    sys.modules["__main__"] = main
    try:
        if is_module:
            sys.path.insert(0, os.getcwd())
            _run_module(target, main)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            run_script(target, main)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0, None
        print(exc.code, file=sys.stderr)
        return 1, None
    except BaseException as exc:  # the script's own error: shown as Python shows it
        tb = _user_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # Only a courtesy to torchrun's summary: it must not replace the script's error.
            with contextlib.suppress(ImportError, OSError):
                from torch.distributed.elastic.multiprocessing.errors import get_error_handler

                get_error_handler().record_exception(exc)
        error = traceback.format_exception_only(exc)[-1].strip()
        return 130 if isinstance(exc, KeyboardInterrupt) else 1, error
    return 0, None


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
            raise ImportError(
                f"No module named {package}.__main__;"
                f" {package!r} is a package and cannot be directly executed"
            )
    if spec is None:
        raise ImportError(f"No module named {name}")
    get_code = getattr(spec.loader, "get_code", None)
    code = get_code(spec.name) if get_code is not None else None
    if code is None:
        raise ImportError(f"No code object available for {name}")
    vars(main).update(
        __file__=spec.origin,
        __cached__=spec.cached,
        __loader__=spec.loader,
        __package__=spec.parent,
        __spec__=spec,
        __builtins__=__builtins__,
    )
    sys.argv[0] = spec.origin or name
    exec(code, vars(main))


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without its leading frames of torchmem and of Python's import machinery."""
    ours = {__file__}
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in ours
        or tb.tb_frame.f_code.co_filename.startswith("<frozen ")
    ):
        tb = tb.tb_next
    return tb
