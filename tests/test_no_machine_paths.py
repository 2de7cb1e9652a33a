"""No source, test, script or recipe names an absolute path of the machine it was written on:
the checkout's parent directory (where the shared data sits) must be found relative to the
repository root, never spelled out."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("hybridflow", "engines", "tests", "scripts", "recipes", "benchmarks")
SUFFIXES = {".py", ".sh", ".sbatch", ".yaml", ".yml", ".md", ".toml"}


def test_no_file_spells_out_the_checkouts_parent_directory():
    parent = f"{ROOT.parent}/"
    offenders = [
        str(path.relative_to(ROOT))
        for folder in CHECKED
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in SUFFIXES and path.is_file() and parent in path.read_text(errors="replace")
    ]
    assert offenders == [], f"files naming {parent}: {offenders}"
