"""closing_after: a teardown error never replaces the error a run stops with."""

import pytest

from hybridflow.utils.teardown import closing_after

WARNING = (
    "warning: closing the tracker failed after the error below: OSError: [Errno 28] No space left on device"
)


def failing_close():
    raise OSError(28, "No space left on device")


def test_an_error_in_teardown_after_an_error_is_a_warning_and_the_first_error_goes_on(capsys):
    with (
        pytest.raises(ValueError, match="the save failed") as raised,
        closing_after("closing the tracker", failing_close),
    ):
        raise ValueError("the save failed")
    assert raised.value.__context__ is None  # not chained to the teardown's error either
    assert capsys.readouterr().err == WARNING + "\n"


def test_an_error_in_teardown_after_a_normal_end_is_the_error(capsys):
    with (
        pytest.raises(OSError, match="No space left on device"),
        closing_after("closing the tracker", failing_close),
    ):
        pass
    assert capsys.readouterr().err == ""


def test_teardown_runs_once_whatever_the_block_does():
    calls = []
    with closing_after("x", lambda: calls.append("closed")):
        calls.append("body")
    with pytest.raises(KeyboardInterrupt), closing_after("x", lambda: calls.append("closed")):
        raise KeyboardInterrupt
    assert calls == ["body", "closed", "closed"]
