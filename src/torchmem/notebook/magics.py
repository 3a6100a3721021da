"""``%mlrun`` / ``%%mlrun``: pytorch_memlab's line-profiler magic.

Runs a statement (line mode) or a cell (cell mode) in the user namespace with the
functions named by ``-f`` profiled line by line, and shows the report: an HTML table in
Jupyter, text in a terminal. Unlike pytorch_memlab's, ``-q`` shows nothing and ``-T``
writes the columns chosen with ``-c`` / ``-D``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from torchmem.lines import LineProfiler, LineReport


class MagicHandle:
    """What registering magics returns: removes the magics registered.

    Works as a context manager; removing twice is harmless.
    """

    def __init__(self, ipython: Any, names: dict[str, tuple[str, ...]]) -> None:
        self.ipython = ipython
        self.names = names
        """Magic kind (``"line"``, ``"cell"``) -> the names registered."""

    def remove(self) -> None:
        """Unregister the magics, if they are still there."""
        magics = self.ipython.magics_manager.magics
        for kind, names in self.names.items():
            for name in names:
                magics[kind].pop(name, None)
        self.names = {}

    def __enter__(self) -> MagicHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (
        ("-f", "--function"),
        dict(
            metavar="FUNC",
            action="append",
            default=[],
            help="""Function to profile. Can be specified multiple times to profile
        multiple functions; each is evaluated in the user namespace""",
        ),
    ),
    (
        ("-c", "--column"),
        dict(
            metavar="COLS",
            action="append",
            default=[],
            help="""Columns to display. Can be specified multiple times to show
        multiple columns. See the Torch CUDA spec at
        https://pytorch.org/docs/stable/cuda.html#torch.cuda.memory_stats for details.
        The columns follow the default ones (see -D)""",
        ),
    ),
    (
        ("-D", "--no_default_columns"),
        dict(
            action="store_true",
            help="""Hide the default columns of active_bytes.all.peak,
        reserved_bytes.all.peak (on CPU tensors: active_bytes.all.peak,
        active_bytes.all.delta)""",
        ),
    ),
    (
        ("-r", "--return-profiler"),
        dict(
            action="store_true",
            help="Return LineProfiler object for introspection",
        ),
    ),
    (
        ("-g", "--gpu"),
        dict(
            metavar="GPU_ID",
            default=0,
            type=int,
            help="Profile memory usage of this GPU",
        ),
    ),
    (
        ("-d", "--device"),
        dict(
            metavar="DEVICE",
            default=None,
            help="""Measure this device instead: "cuda:1", "cpu" (CPU tensors), "ram" (the
        process's resident memory). Default: the GPU of -g where CUDA is available,
        else CPU tensors""",
        ),
    ),
    (
        ("-q", "--quiet"),
        dict(
            action="store_true",
            help="Don't print out profile results",
        ),
    ),
    (
        ("-T", "--dump-profile"),
        dict(
            metavar="OUTPUT",
            help="Dump text profile output to file",
        ),
    ),
    (
        ("statement",),
        dict(
            nargs=argparse.REMAINDER,
            default=None,
            help="Code to run under profiler. You can omit this in cell magic mode.",
        ),
    ),
)
"""``%mlrun``'s options, as pytorch_memlab's: the flags and the keyword arguments of
each IPython ``@argument``, in the order they are listed."""


def register(ipython: Any) -> MagicHandle:
    """Register the line and cell magic ``mlrun`` in `ipython`; return a handle that
    removes it."""
    from IPython.core.magic_arguments import magic_arguments

    @magic_arguments()
    @_with_options
    def mlrun(line: str = "", cell: str | None = None) -> Any:
        """Execute a statement/cell with the line profiler on the functions given by -f.

        Returns the report (an HTML table in Jupyter, text elsewhere), the LineProfiler
        with -r, or nothing with -q.
        """
        return _mlrun(ipython, mlrun.parser, line, cell)

    ipython.register_magic_function(mlrun, "line_cell", "mlrun")
    return MagicHandle(ipython, {"line": ("mlrun",), "cell": ("mlrun",)})


def _with_options(function: Any) -> Any:
    """`function` decorated with IPython's ``@argument`` for each of :data:`_OPTIONS`, as
    if stacked above it in that order."""
    from IPython.core.magic_arguments import argument

    for flags, options in reversed(_OPTIONS):
        function = argument(*flags, **options)(function)
    return function


def _mlrun(ipython: Any, parser: Any, line: str, cell: str | None) -> Any:
    from IPython.core.error import UsageError

    args, statement = _parse(parser, line)
    if cell is not None:
        if statement:
            raise UsageError(
                f"%%mlrun runs the cell; put {statement!r} in the cell, not on the %%mlrun line"
            )
        code = cell
    else:
        code = statement
    if not code.strip():
        raise UsageError("Nothing to run: give a statement, or use %%mlrun on a cell.")
    if not args.function:
        raise UsageError("Name the function(s) to profile with -f FUNC.")
    if args.no_default_columns and not args.column:
        raise UsageError("-D hides the default columns: name the columns to show with -c COL.")

    functions = [_lookup(ipython, _unquote(name), UsageError) for name in args.function]
    device = _unquote(args.device) if args.device is not None else None
    try:
        profiler = LineProfiler(*functions, target_gpu=args.gpu, device=device)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    columns = _columns(profiler, [_unquote(c) for c in args.column], args.no_default_columns)
    try:
        profiler.display(columns=columns)  # check the columns before running anything
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    path = _unquote(args.dump_profile) if args.dump_profile else None
    if path is not None:
        problem = _unwritable(path)
        if problem:
            raise UsageError(f"-T {path}: cannot write the profile there: {problem}")

    compiled = compile(code, "<mlrun>", "exec")
    with profiler:
        exec(compiled, ipython.user_global_ns, ipython.user_ns)

    report: LineReport = profiler.display(columns=columns)
    if path is not None:
        try:
            with open(path, "w", encoding="utf-8") as file:
                file.write(str(report))
        except OSError as exc:
            raise UsageError(
                f"-T {path}: the statement ran, but writing the profile failed: {exc}"
            ) from None
    if args.return_profiler:
        return profiler
    if args.quiet:
        return None
    return report


def _parse(parser: Any, line: str) -> tuple[Any, str]:
    """The options, and the statement as typed (quotes and spacing kept)."""
    from IPython.utils.process import arg_split

    argv = arg_split(line, posix=False, strict=False)
    args = parser.parse_args(argv)
    words = args.statement or []
    if not words:
        return args, ""
    # The statement is what follows the options in the raw line, found by skipping the
    # option words in order (arg_split without posix keeps each word verbatim).
    pos = 0
    for word in argv[: len(argv) - len(words)]:
        found = line.find(word, pos)
        if found < 0:
            return args, " ".join(words)
        pos = found + len(word)
    rest = line[pos:].strip()
    return args, rest if rest.startswith(words[0]) else " ".join(words)


def _unwritable(path: str) -> str | None:
    """Why a file cannot be written at `path`, or None where it can (checked without
    creating or changing anything)."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        return "it is a directory"
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        return f"no directory {folder}"
    if os.path.exists(target):
        return None if os.access(target, os.W_OK) else "the file is not writable"
    return None if os.access(folder, os.W_OK | os.X_OK) else f"{folder} is not writable"


def _lookup(ipython: Any, name: str, error: type[Exception]) -> Any:
    try:
        return eval(name, ipython.user_global_ns, ipython.user_ns)
    except Exception as exc:
        raise error(f"Could not find function {name!r}.\n{type(exc).__name__}: {exc}") from None


def _columns(profiler: LineProfiler, extra: list[str], no_defaults: bool) -> tuple[str, ...] | None:
    """The columns to show: the device's defaults, then `extra`; `extra` alone with -D."""
    if not extra:
        return None
    if no_defaults:
        return tuple(extra)
    return profiler.default_columns + tuple(extra)


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
