"""Pre-fills a Hugging Face Hub cache the way `huggingface_hub` lays one out, so that tests resolve
Hub ids with HF_HUB_OFFLINE=1 through the same `snapshot_download` call a download makes:

    <HF_HOME>/hub/<models|datasets>--<owner>--<name>/refs/<revision>    the commit hash
    <HF_HOME>/hub/<models|datasets>--<owner>--<name>/snapshots/<commit>/ the repo's files

(huggingface_hub's "cache-system" guide; the files are plain copies rather than links to blobs/,
which the cache also accepts where symlinks are unavailable).
"""

import hashlib
import shutil
from pathlib import Path


def fill_hub_cache(
    hf_home: Path, repo_id: str, files: dict[str, Path], repo_type: str = "model", revision: str = "main"
) -> Path:
    """Caches `files` (path in the repo -> local file) as `repo_id` at `revision`; returns the snapshot."""
    repo = Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, snapshot / name)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
