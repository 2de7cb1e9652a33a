"""Hugging Face Hub ids where the recipe takes a model directory.

`model.path` (and `model.tokenizer_path`, `critic.model_path`, `reward_model.path`) may be a local
directory or a Hub id such as `Qwen/Qwen2.5-0.5B-Instruct`. The driver resolves each id once,
before anything starts, through `huggingface_hub.snapshot_download` into its cache: it honours
HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE=1 (the cached snapshot, no network) and `model.revision`,
and the workers get the snapshot's local directory. On several nodes, put HF_HOME on the shared
filesystem (docs/multinode.md) so that every node reads the same snapshot.
"""

import re
from pathlib import Path

# what loading a model and its tokenizer reads; not *.bin / *.pth / GGUF copies of the weights
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
    """`owner/name` that is not an existing local path."""
    return bool(HUB_ID.match(path)) and not Path(path).exists()


HOW_TO_FETCH = (
    "set it to a Hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) to download that model into the Hugging Face "
    "cache, or fetch one first with `hf download <id> --local-dir <dir>` and point it at <dir>"
)


def download_snapshot(
    repo_id: str, repo_type: str = "model", revision: str | None = None, allow_patterns=None
) -> Path:
    """The local directory of the repo's snapshot at `revision`: downloaded into the Hugging Face
    cache, or, with HF_HUB_OFFLINE=1, the one already cached. ValueError naming the repo when
    neither works."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id=repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError) as err:
        reason = str(err).splitlines()[0]
        raise ValueError(
            f"could not resolve the Hub {repo_type} {repo_id} at revision {revision or 'main'} "
            f"({type(err).__name__}: {reason})"
        ) from None


def resolve_model(key: str, path: str, revision: str | None = None) -> str:
    """The local directory for `path`: itself unless it is a Hub id, else its snapshot.
    ValueError naming `key` and how to fetch the model when that fails."""
    if not is_hub_id(path):
        return path
    try:
        return str(download_snapshot(path, revision=revision, allow_patterns=MODEL_FILES))
    except ValueError as err:
        raise ValueError(
            f"{key}={path} is neither a local directory nor a usable Hub id: {err}; {HOW_TO_FETCH}"
        ) from None
