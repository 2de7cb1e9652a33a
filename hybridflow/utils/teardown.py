"""Teardown that never hides the error a run stops with.

    with closing_after("closing the tracker (plots, metrics files)", tracker.close):
        train()

runs `tracker.close()` after the block however it ends. When the block raised, an error from
`close` (say the plots hitting the same full disk that stopped a checkpoint save) is printed as one
`warning:` line and the block's own error goes on unchanged: Python would otherwise raise the
teardown's error with the first one only as its `__context__`, and the run would end naming the
wrong failure.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hybridflow.utils.imports import first_line


@contextmanager
def closing_after(what: str, close: Callable[[], object]) -> Iterator[None]:
    """Calls `close()` after the block; see the module docstring for errors during an error."""
    try:
        yield
    except BaseException:
        try:
            close()
        except Exception as err:  # the block's error is the one the run reports
            warning = f"warning: {what} failed after the error below: {first_line(err)}"
            print(warning, file=sys.stderr, flush=True)
        raise
    close()
