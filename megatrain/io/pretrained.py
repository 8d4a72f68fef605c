"""Where a run's models and tokenizer come from: the local directory a key names where one
exists, else the Hub repository of that name (hub.py), of which only the files a run reads are
fetched: config.json, generation_config.json, the tokenizer's files and chat template, and the
safetensors weights (the shards its index names, or model.safetensors). A repository without
safetensors weights is refused in one line: megatrain reads no other format."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .. import hub
from ..data.tokenizer import TOKENIZER_FILES
from ..errors import ConfigError
from .reader import INDEX, SINGLE

CONFIG_FILES = ["config.json", "generation_config.json"]


def local_models(cfg, weights: bool = True):
    """`cfg` with every model key that names a Hub repository (no local path of that name)
    replaced by the local snapshot of the files it reads (without `weights`: config.json in
    place of the weights, for a plan); model_revision is the revision of model_name_or_path's
    repository (and of the others where they name the same one)."""
    changes = {}
    for key, reads in hub.MODEL_KEYS.items():
        reads = reads if weights or reads != "weights" else "config"
        name = getattr(cfg, key)
        if name is None or not hub.is_hub_name(name):
            continue
        revision = cfg.model_revision if name == cfg.model_name_or_path else None
        changes[key] = str(fetch(name, key, reads, revision))
    return dataclasses.replace(cfg, **changes) if changes else cfg


def fetch(repo_id: str, key: str, reads: str, revision: str | None = None) -> Path:
    """The snapshot of `repo_id` holding what `reads` needs (weights, config, tokenizer)."""
    first = {
        "weights": [*CONFIG_FILES, INDEX, *TOKENIZER_FILES],
        "config": CONFIG_FILES,
        "tokenizer": [*TOKENIZER_FILES, "config.json"],  # AutoTokenizer may read the model type
    }[reads]
    path = hub.snapshot(repo_id, key, first, revision)
    what = (repo_id, key, revision)
    if reads == "tokenizer":
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ConfigError(
                _lacking(*what, "tokenizer_config.json", "no tokenizer.json or tokenizer_config.json")
            )
        return path
    if not (path / "config.json").is_file():
        raise ConfigError(_lacking(*what, "config.json", "no config.json"))
    if reads == "config":
        return path
    sharded = (path / INDEX).is_file()
    weights = _shards(path / INDEX, f"{key}: {repo_id}") if sharded else [SINGLE]
    path = hub.snapshot(repo_id, key, weights, revision)
    missing = next((w for w in weights if not (path / w).is_file()), None)
    if missing is not None:
        why = f"no {missing} (named by its {INDEX})" if sharded else f"no {SINGLE}"
        raise ConfigError(_lacking(*what, missing, why))
    return path


def _lacking(repo_id: str, key: str, revision: str | None, file: str, why: str) -> str:
    """A repository without a file a run reads: one the Hub does not have (as the cached listing
    of the repository says, or the Hub just did), or, offline, one the cache does not."""
    at = f" at revision {revision}" if revision else ""
    files = hub.listing(repo_id, revision)
    if hub.offline() and (files is None or file in files):
        return f"{key}: {repo_id}{at}: {why} in the Hugging Face cache ({hub.cache_dir()}); {hub.OFFLINE}"
    only = " (megatrain reads safetensors weights only, not .bin or .pt)" if file == SINGLE else ""
    return f"{key}: {repo_id}{at} holds {why} on the Hugging Face Hub{only}"


def _shards(index: Path, what: str) -> list[str]:
    """The weight files a safetensors index names."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{what}: {index.name} is malformed ({e})") from None
