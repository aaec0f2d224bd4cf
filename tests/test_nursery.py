"""sidecar/nursery.py: the one place a nursery's exception group is unwrapped."""

from __future__ import annotations

import pytest
import trio

from sidecar.nursery import lone_exception, open_background_nursery


def test_lone_exception_goes_through_every_one_member_level() -> None:
    leaf = ValueError("x")
    assert lone_exception(leaf) is leaf
    assert lone_exception(ExceptionGroup("a", [leaf])) is leaf
    assert lone_exception(ExceptionGroup("a", [ExceptionGroup("b", [leaf])])) is leaf


def test_lone_exception_keeps_a_group_of_several() -> None:
    several = ExceptionGroup("b", [ValueError("x"), KeyError("y")])
    assert lone_exception(several) is several
    assert lone_exception(ExceptionGroup("a", [several])) is several


async def test_background_nursery_lets_the_body_exception_out_as_itself() -> None:
    with pytest.raises(ValueError, match="body"):
        async with open_background_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            raise ValueError("body")


async def test_background_nursery_unwraps_a_group_the_body_raised() -> None:
    with pytest.raises(KeyError):
        async with open_background_nursery():
            async with trio.open_nursery() as inner:  # the body's own nursery wraps its error
                inner.start_soon(_raise, KeyError("inner"))


async def test_background_nursery_keeps_several_exceptions_a_group() -> None:
    with pytest.raises(ExceptionGroup) as info:
        async with open_background_nursery() as nursery:
            nursery.start_soon(_raise, KeyError("task"))  # fails at its first step, uncancellable
            raise ValueError("body")
    assert {type(e) for e in info.value.exceptions} == {KeyError, ValueError}


async def _raise(exc: BaseException) -> None:
    raise exc
