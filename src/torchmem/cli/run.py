"""``torchmem run``: run a script (or ``-m module``) and say where its memory went."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

from torchmem.cli.command import Command
from torchmem.errors import CommandError, TorchmemError

if TYPE_CHECKING:
    from torchmem.ranks import RanksReport
    from torchmem.recorder import RunReport


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
        " they used memory; rank 0 writes --json and --html."
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
        import dataclasses

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
        namespace: dict[str, Any] = {}
        pid = os.getpid()
        recording.start()
        try:
            code, error = _execute(target, argv, is_module, namespace)
        except BaseException:
            recording.stop(namespace)
            raise
        if os.getpid() != pid:
            # A child the script forked: the report is its parent's (the child's meters
            # stopped counting at the fork); it neither prints a second one nor overwrites
            # the parent's files.
            return code
        recording.stop(namespace)
        report = dataclasses.replace(
            recording.report(args.top), exit_code=code, command=tuple(argv)
        )
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
                recording.save_snapshot(path)
            except TorchmemError as exc:
                raise CommandError(str(exc)) from None
        return code


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
    target: str, argv: list[str], is_module: bool, namespace: dict[str, Any]
) -> tuple[int, str | None]:
    """Run `target` as ``__main__`` with ``sys.argv`` = `argv`; return its exit code and,
    where it raised, the last line of its traceback (``"ValueError: boom"``).

    Its globals end up in `namespace`. An uncaught exception prints its traceback through
    ``sys.excepthook``, as Python would, without torchmem's frames; under ``torchrun`` it
    also goes to the launcher's error file, which torchrun's failure summary shows.
    """
    import runpy

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = list(argv)
    try:
        if is_module:
            sys.path.insert(0, str(Path.cwd()))
            namespace.update(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            _run_script(target, namespace)
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
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0, None


def _run_script(path: str, namespace: dict[str, Any]) -> None:
    """Execute the file at `path` as the ``__main__`` module, in `namespace`. Its
    ``__file__`` is absolute, as ``python`` gives it, so that it stays valid after
    ``os.chdir``; its code keeps `path` as given, the name tracebacks and the report show."""
    source = Path(path).read_bytes()
    code = compile(source, path, "exec", dont_inherit=True)
    main = ModuleType("__main__")
    # Joined, not normalized: python's own absolute path ("/home/me/./train.py").
    where = os.path.join(os.getcwd(), path)
    main.__dict__.update(__file__=where, __builtins__=__builtins__, __cached__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        namespace.update(main.__dict__)
        if saved is not None:
            sys.modules["__main__"] = saved


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without its leading frames of torchmem and runpy."""
    import runpy

    ours = {__file__, runpy.__file__}
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in ours
        or tb.tb_frame.f_code.co_filename.startswith("<frozen ")
    ):
        tb = tb.tb_next
    return tb
