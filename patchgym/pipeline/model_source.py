"""`model.path`: a local Hugging Face folder or a Hub id, the same for every backend.

A Hub id (`Qwen/Qwen3-0.6B`, optionally `@revision`) is downloaded once into the Hugging Face
cache (`HF_HOME`) when the run starts, by `huggingface_hub.snapshot_download` (only the files a
backend loads: config, tokenizer, safetensors weights), and every part (embedded engine and
trainer, SGLang, Megatron) then gets that local folder, as if `path` had named it. A folder that
exists wins over a Hub id of the same spelling. The dry run never downloads: it reads the shape
from `model.hf_config`, or the cached config.json when the model is in the cache already.
"""

from __future__ import annotations

import re
from pathlib import Path

from patchgym.core.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
"""Files of a Hub repository a backend loads (no .bin or .pth duplicates of the weights)."""


def is_hub_id(path: str) -> bool:
    """True for `org/name` (or `org/name@revision`) that is not a folder here."""
    return not Path(path).exists() and _HUB_ID.match(path) is not None and not path.startswith(".")


def split_revision(hub_id: str) -> tuple[str, str | None]:
    repo, _, revision = hub_id.partition("@")
    return repo, revision or None


def fetch_model(path: str) -> Path:
    """The local folder of `path`: itself, or a Hub id's snapshot in the Hugging Face cache."""
    if not is_hub_id(path):
        return Path(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, revision = split_revision(path)
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=WEIGHT_PATTERNS))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ConfigError(
            f"model.path {path!r} is a Hub id, but it could not be fetched ({type(exc).__name__}: {exc}); check the "
            "name and the network (HF_TOKEN for a gated model), or give a local folder"
        ) from exc


def cached_model(path: str) -> Path | None:
    """A Hub id's folder when its config.json is in the cache already (no download), else None."""
    if not is_hub_id(path):
        return Path(path)
    from huggingface_hub import try_to_load_from_cache

    repo, revision = split_revision(path)
    found = try_to_load_from_cache(repo, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None
