"""Decorating a function of any kind so that a measurement spans its own run: a plain
function, a generator, a coroutine or an async generator function, or a ``staticmethod``
or ``classmethod`` object holding one. The decorated function keeps its kind, so
``inspect`` and frameworks see what they saw before."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

F = TypeVar("F")

Context = Callable[[], AbstractContextManager[Any]]
"""Makes the context manager a measurement runs in (a new one, or the same one again)."""


def wrap_calls(
    func: F,
    *,
    each_call: Context = contextlib.nullcontext,
    each_step: Context = contextlib.nullcontext,
) -> F:
    """`func`, of the same kind, with each call inside ``each_call()`` and each step of
    it inside ``each_step()``.

    A call of a plain function or a coroutine function is one step, until it returns or
    raises (a coroutine's steps include the time it waits). A call of a generator or an
    async generator function lasts from its first step until it is exhausted, raises or
    is closed; each ``next``, ``send``, ``throw`` and ``close`` (``asend``, ...) is a
    step, and the time between steps is in the call but in no step. Values sent in and
    exceptions thrown in reach `func` as they would without the wrapper.

    A ``staticmethod`` or ``classmethod`` gives back the same kind of object, holding the
    wrapped function.
    """
    if isinstance(func, staticmethod | classmethod):
        held = wrap_calls(func.__func__, each_call=each_call, each_step=each_step)
        return cast(F, type(func)(held))
    if not callable(func):
        raise TypeError(f"cannot wrap {func!r}: it is not callable")
    function: Callable[..., Any] = func
    if inspect.isasyncgenfunction(function):
        return cast(F, _async_generator(function, each_call, each_step))
    if inspect.isgeneratorfunction(function):
        return cast(F, _generator(function, each_call, each_step))
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def coroutine(*args: Any, **kwargs: Any) -> Any:
            with each_call(), each_step():
                return await function(*args, **kwargs)

        return cast(F, coroutine)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with each_call(), each_step():
            return function(*args, **kwargs)

    return cast(F, wrapper)


def _generator(
    function: Callable[..., Any], each_call: Context, each_step: Context
) -> Callable[..., Any]:
    @functools.wraps(function)
    def generator(*args: Any, **kwargs: Any) -> Any:
        with each_call():
            gen = function(*args, **kwargs)
            step: Callable[[Any], Any] = gen.send
            value: Any = None
            while True:
                with each_step():
                    try:
                        item = step(value)
                    except StopIteration as stop:
                        return stop.value
                try:
                    value, step = (yield item), gen.send
                except GeneratorExit:
                    with each_step():
                        gen.close()
                    raise
                except BaseException as exc:
                    value, step = exc, gen.throw

    return generator


def _async_generator(
    function: Callable[..., Any], each_call: Context, each_step: Context
) -> Callable[..., Any]:
    @functools.wraps(function)
    async def generator(*args: Any, **kwargs: Any) -> Any:
        with each_call():
            gen = function(*args, **kwargs)
            step: Callable[[Any], Any] = gen.asend
            value: Any = None
            while True:
                with each_step():
                    try:
                        item = await step(value)
                    except StopAsyncIteration:
                        return
                try:
                    value, step = (yield item), gen.asend
                except GeneratorExit:
                    with each_step():
                        await gen.aclose()
                    raise
                except BaseException as exc:
                    value, step = exc, gen.athrow

    return generator
