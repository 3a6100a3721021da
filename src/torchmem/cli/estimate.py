"""``torchmem estimate``: a training step's memory on a device, without that device."""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from torchmem.cli.command import Command
from torchmem.cli.run import run_script, show_uncaught
from torchmem.errors import CommandError


class EstimateCommand(Command):
    name = "estimate"
    help = "estimate a step's memory on a GPU (or the CPU) without it"
    description = (
        "Run a function (MODULE:FUNCTION, called with the batch size) or a script once on"
        " fake tensors, allocating nothing, and print the memory it would need on the"
        " device: the peak allocated and reserved (modelling PyTorch's CUDA caching"
        " allocator), the categories at the peak, the lines and the largest tensors alive"
        " then, each module's peaks. With --capacity, print the largest batch that fits;"
        " with --advice, the changes that lower the memory, each with its saving."
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.usage = "%(prog)s [options] (MODULE:FUNCTION | SCRIPT [ARGS ...])"
        parser.add_argument(
            "--device", default="cuda", help="cuda (the default) or cpu: the device to estimate"
        )
        parser.add_argument(
            "--batch", type=int, metavar="N", help="call FUNCTION with batch size N"
        )
        parser.add_argument(
            "--capacity",
            metavar="SIZE",
            help="print the largest batch size FUNCTION fits in SIZE (e.g. '80 GiB') or on a"
            " GPU named so (H100-80GB, H200, A100-80GB, A100-40GB)",
        )
        parser.add_argument(
            "--advice",
            action="store_true",
            help="print the changes (activation checkpointing, bf16 autocast, set_to_none,"
            " foreach=False) that lower the step's memory, each with its estimated saving;"
            " with --capacity and --batch, the largest batch too",
        )
        parser.add_argument(
            "--world-size",
            type=int,
            default=1,
            metavar="N",
            help="estimate each of N ranks of a distributed job (FSDP2, tensor parallel) on"
            " PyTorch's fake process group: no processes, no GPUs",
        )
        parser.add_argument(
            "--html", metavar="PATH", help="write the estimate as a self-contained HTML page"
        )
        parser.add_argument(
            "words", nargs=argparse.REMAINDER, metavar="MODULE:FUNCTION | SCRIPT [ARGS]"
        )
        self._parser = parser

    def run(self, args: argparse.Namespace) -> int:
        from torchmem.estimator import EstimateError, estimate, max_batch_size
        from torchmem.estimator.advice import advise

        fn, call_args = self._checked(args)
        started = False

        @functools.wraps(fn)
        def called(*call: Any) -> Any:
            nonlocal started
            started = True
            return fn(*call)

        try:
            if args.advice:
                result: Any = advise(called, *call_args, device=args.device, capacity=args.capacity)
            elif args.capacity is not None:
                found = max_batch_size(
                    called, args.capacity, device=args.device, world_size=args.world_size
                )
                print(f"largest batch size that fits {args.capacity} on {args.device}: {found}")
                return 0
            else:
                result = estimate(
                    called, *call_args, device=args.device, world_size=args.world_size
                )
        except EstimateError as exc:
            raise CommandError(str(exc)) from None
        except CommandError:
            raise
        except ValueError as exc:
            if started:
                show_uncaught(exc)
                return 1
            raise CommandError(str(exc), 2) from None  # --device, --capacity, the settings
        except Exception as exc:  # the function's own error, as python shows it
            show_uncaught(exc)
            return 1
        print(result)
        if args.html:
            result.save_html(args.html)
        return 0

    def _checked(self, args: argparse.Namespace) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The function to estimate and its arguments, from options checked together."""
        if not args.words:
            raise CommandError("expected MODULE:FUNCTION or a .py script", exit_code=2)
        args.target, args.args = args.words[0], args.words[1:]
        script = args.target.endswith(".py")
        if not script and args.args:
            # A function takes no arguments of its own: what follows it are options.
            self._parser.parse_args([*args.args, args.target], namespace=args)
            args.target, args.args = args.words[0], []
        if args.batch is not None and script:
            raise CommandError("--batch takes a MODULE:FUNCTION: a script reads its own arguments")
        if args.capacity is not None and args.advice and (args.batch is None or script):
            raise CommandError("--advice with --capacity takes a MODULE:FUNCTION and its --batch")
        if args.capacity is not None and not args.advice and (args.batch is not None or script):
            raise CommandError("--capacity takes a MODULE:FUNCTION and no --batch")
        if args.advice and args.world_size != 1:
            raise CommandError("--advice is for one process: it takes no --world-size yet", 2)
        fn, call_args = _target(args.target, args.args, args.batch)
        if (args.capacity is None or args.advice) and not script:
            try:
                inspect.signature(fn).bind(*call_args)
            except TypeError:
                raise CommandError(
                    f"{args.target}{inspect.signature(fn)} cannot be called with"
                    f" {'no arguments' if not call_args else f'batch {args.batch}'}:"
                    " give it its batch size with --batch N"
                ) from None
            except ValueError:  # no signature to read (a builtin): the call will say
                pass
        return fn, call_args


def _target(
    target: str, words: list[str], batch: int | None
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function to estimate and its arguments: a script run as ``__main__`` with
    `words` as its arguments, or a module's function called with `batch`."""
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise CommandError(f"no such script: {target!r}")

        def script() -> None:
            # As `torchmem run` (and python) runs it: its folder first on sys.path, its own
            # __main__ and argv; sys.exit(0) or sys.exit(None) at its end is a success.
            saved = sys.argv, sys.path[:], sys.modules["__main__"]
            main = ModuleType("__main__")
            sys.argv, sys.modules["__main__"] = [target, *words], main
            sys.path.insert(0, str(Path(target).resolve().parent))
            try:
                run_script(target, main)
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise CommandError(f"{target} exited with {exc.code!r}") from None
            finally:
                sys.argv, sys.modules["__main__"] = saved[0], saved[2]
                sys.path[:] = saved[1]

        script.__qualname__ = os.path.basename(target)
        return script, ()
    module_name, _, name = target.partition(":")
    if not name:
        raise CommandError(f"expected MODULE:FUNCTION or a .py script, not {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandError(f"cannot import {module_name!r}: {exc}") from None
    finally:
        sys.path.remove(os.getcwd())
    fn = getattr(module, name, None)
    if not callable(fn):
        raise CommandError(f"{module_name!r} has no function {name!r}")
    return fn, () if batch is None else (batch,)
