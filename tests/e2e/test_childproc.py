"""sidecar.childproc: readiness lines, log trimming, termination of what is left running."""

from __future__ import annotations

import re
import sys

import pytest
import trio

from sidecar.childproc import ChildLineTimeout, spawn_child

PY = sys.executable


async def test_waits_for_a_line_that_comes_later_and_reaps_the_child() -> None:
    script = "import sys, time\nfor i in range(5): print('line', i, file=sys.stderr)\ntime.sleep(60)"
    with trio.fail_after(20):
        async with spawn_child([PY, "-c", script], name="printer", term_timeout=5) as child:
            m = await child.wait_for_line(re.compile(r"line (3)"))
            assert m.group(1) == "3"
            assert child.lines[:4] == ["line 0", "line 1", "line 2", "line 3"]
        # SIGTERM ended the sleeping child on leaving the context
        assert child.process.returncode == -15


async def test_a_child_that_exits_without_the_line_fails_with_its_log() -> None:
    script = "import sys; print('boom: no config', file=sys.stderr); sys.exit(3)"
    with trio.fail_after(20):
        async with spawn_child([PY, "-c", script], name="broken") as child:
            with pytest.raises(ChildLineTimeout, match=r"broken(.|\n)*boom: no config"):
                await child.wait_for_line(re.compile("serving"), timeout=15)
            assert await child.wait() == 3


async def test_keep_lines_trims_the_front_but_still_finds_new_lines() -> None:
    script = "import sys, time\nfor i in range(1000): print('n', i, file=sys.stderr)\nprint('done', file=sys.stderr)\ntime.sleep(60)"
    with trio.fail_after(20):
        async with spawn_child([PY, "-c", script], keep_lines=10, term_timeout=5) as child:
            await child.wait_for_line(re.compile("^done$"))
            assert len(child.lines) <= 20
            assert child.lines[-1] == "done"


async def test_on_error_sees_the_child_when_the_body_fails() -> None:
    seen: list[str] = []
    script = "import sys, time; print('hello', file=sys.stderr); time.sleep(60)"
    # the body runs inside the child's nursery, so its error arrives in an ExceptionGroup
    with trio.fail_after(20), pytest.RaisesGroup(RuntimeError):
        async with spawn_child(
            [PY, "-c", script], term_timeout=5, on_error=lambda c: seen.append(c.tail())
        ) as child:
            await child.wait_for_line(re.compile("hello"))
            raise RuntimeError("the test body failed")
    assert seen == ["hello"]
