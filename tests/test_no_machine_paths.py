"""No source, test, script or recipe names an absolute path of the machine it was written on:
the checkout's parent directory (where the shared data sits) must be found relative to the
repository root, never spelled out.

The paths looked for are those of the checkout the test runs in (`machine_paths`). Its parent is
one only where it belongs to the machine (/work on the machine this was written on): a directory
every Unix machine has, such as /tmp or / itself, says nothing of the machine, and the files name
it for their own reasons (Ray's temporary directory under /tmp, every URL's //), so a clone below
one is checked for its own directory and the shared data beside it instead."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("hybridflow", "engines", "tests", "scripts", "recipes", "benchmarks")
SUFFIXES = {".py", ".sh", ".sbatch", ".yaml", ".yml", ".md", ".toml"}
# Directories of the Filesystem Hierarchy Standard a user may clone into, present on every machine
EVERY_MACHINES = frozenset({"/", "/tmp", "/var/tmp", "/home", "/root", "/opt", "/srv", "/mnt", "/media"})


def machine_paths(root: Path) -> list[str]:
    """The absolute paths whose spelling in a file would tie it to the checkout at `root`."""
    if str(root.parent) in EVERY_MACHINES:
        return [f"{root}/", f"{root.parent / 'shared'}/"]
    return [f"{root.parent}/"]


def files_naming(root: Path, paths: list[str]) -> list[str]:
    """The checked files under `root` that name one of `paths`, relative to `root`."""
    # an absolute path starts a path: not the tail of one (../shared/, $ROOT/hybridflow/, {tmp}/x/)
    naming = re.compile("|".join(rf"(?<![\w.$}}-]){re.escape(p)}" for p in paths))
    return [
        str(path.relative_to(root))
        for folder in CHECKED
        for path in sorted((root / folder).rglob("*"))
        if path.suffix in SUFFIXES and path.is_file() and naming.search(path.read_text(errors="replace"))
    ]


def test_no_file_spells_out_the_checkouts_parent_directory():
    paths = machine_paths(ROOT)
    offenders = files_naming(ROOT, paths)
    assert offenders == [], f"files naming {paths}: {offenders}"


CLONES = ["/tmp/xyz-clone", "/var/tmp/hybridflow", "/hybridflow", "/home/hybridflow"]


@pytest.mark.parametrize("clone", CLONES)
def test_a_clone_below_a_directory_every_machine_has_is_not_failed_by_the_files_naming_it(clone):
    """A newcomer's clone into /tmp/x, or into / itself: the files name /tmp/ (Ray's temporary
    directory) and // (every URL) for their own reasons, which say nothing of where this checkout
    sits. Its own paths are still looked for."""
    paths = machine_paths(Path(clone))
    assert files_naming(ROOT, paths) == []
    assert f"{clone}/" in paths


def test_the_parent_of_the_machine_it_was_written_on_is_flagged(tmp_path):
    """The check's purpose: a checkout at <somewhere>/main with the data in <somewhere>/shared
    flags a file that spells <somewhere>/ out."""
    root = tmp_path / "main"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_data.py").write_text(f'DATA = "{tmp_path}/shared/data/gsm8k"\n')
    (root / "tests" / "test_url.py").write_text(f'DATA = "file://{tmp_path}/shared/data/gsm8k"\n')
    (root / "tests" / "test_ok.py").write_text('DATA = "../shared/data/gsm8k"\n')
    assert machine_paths(root) == [f"{tmp_path}/"]
    assert files_naming(root, machine_paths(root)) == ["tests/test_data.py", "tests/test_url.py"]
