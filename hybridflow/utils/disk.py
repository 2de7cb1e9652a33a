"""Free space where a run writes, and whether an error came from a full disk."""

import errno
import os
import shutil
from pathlib import Path

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device"


def existing_ancestor(path: str | Path) -> Path:
    """`path` itself, or its nearest ancestor that exists (a run's directories may not yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes free (for this user) on the filesystem that holds, or will hold, `path`."""
    return shutil.disk_usage(existing_ancestor(path)).free


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while count >= 1024 and power < len(units) - 1:
        count /= 1024
        power += 1
    return f"{count:.0f} B" if power == 0 else f"{count:.1f} {units[power]}"


def free_space_text(path: str | Path) -> str:
    """'1.2 MiB free of 12.0 MiB' on the filesystem of `path`."""
    usage = shutil.disk_usage(existing_ancestor(path))
    return f"{human_bytes(usage.free)} free of {human_bytes(usage.total)}"


def is_disk_full(err: BaseException) -> bool:
    """Whether `err`, an error it was raised from or during, or a worker error's cause is ENOSPC.
    A worker's error arrives as text too (Megatron's checkpoint writer reports its processes'
    failures in the message), so the message is read as well as the errno."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if (isinstance(current, OSError) and current.errno == errno.ENOSPC) or NO_SPACE in str(current):
            return True
        pending += [current.__cause__, current.__context__, getattr(current, "cause", None)]
    return False
