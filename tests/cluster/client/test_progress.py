from __future__ import annotations

import io

from cluster.client.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def replay(progress: Progress, outcomes: list[bool]) -> None:
    for ok in outcomes:
        progress.sent()
        progress.done(ok)
    progress.close()


def test_off_a_terminal_a_line_every_tenth_of_the_requests():
    out = io.StringIO()
    replay(Progress(20, out), [True] * 19 + [False])
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in out.getvalue()
    assert lines[0].startswith("bench [") and "2/20 done (0 failed), 0 in flight" in lines[0]
    assert "20/20 done (1 failed)" in lines[-1] and "#" * 24 in lines[-1]


def test_on_a_terminal_one_line_redrawn_in_place():
    out = Terminal()
    replay(Progress(3, out, interval_s=0.0), [True, True, True])
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") >= 3
    assert "3/3 done (0 failed), 0 in flight" in text.rsplit("\r", 1)[-1]


def test_disabled_it_prints_nothing():
    out = Terminal()
    replay(Progress(5, out, enabled=False), [True] * 5)
    assert out.getvalue() == ""
