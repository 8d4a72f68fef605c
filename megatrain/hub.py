"""Names on the Hugging Face Hub: a repository's files fetched through huggingface_hub, as
transformers and datasets fetch them (its cache under HF_HOME or HF_HUB_CACHE, HF_HUB_OFFLINE, the
token of HF_TOKEN or `hf auth login`), only the files asked for; a Hub dataset's split read by
`datasets.load_dataset` (the `hub` extra). A name is a Hub repository's only where no local path
of that name exists: the callers look there first. Every failure is one ConfigError line naming
the key: a repository missing or private, gated, a revision it lacks, offline and not cached.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError, first_line

OFFLINE = "HF_HUB_OFFLINE is set, so the Hub is not asked"
# The settings naming a model's directory or Hub repository -> what of it a run reads
# (io/pretrained.py): weights, a config alone, or a tokenizer alone.
MODEL_KEYS = {
    "model_name_or_path": "weights",
    "ref_model_name_or_path": "weights",
    "model_config": "config",
    "tokenizer_name_or_path": "tokenizer",
}


def is_repo_id(name: str) -> bool:
    """Whether `name` has the form of a Hub repository id (`org/name` or `name`), by
    huggingface_hub's own rule."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def is_hub_name(name: str) -> bool:
    """Whether a model key's value names a Hub repository: no local path of that name exists, it
    is no `.json` file's name, and it has a repository id's form."""
    path = Path(name)
    return not path.exists() and path.suffix != ".json" and is_repo_id(name)


def offline() -> bool:
    """Whether huggingface_hub is in offline mode (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


def cache_dir() -> str:
    """The hub cache huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def listing(repo_id: str, revision: str | None = None) -> set[str] | None:
    """The files of a model repository at `revision` as the cache last listed them from the Hub
    (huggingface_hub keeps the listing with the snapshot); None where no listing is cached."""
    try:
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:  # a huggingface_hub before 1.14 keeps no listing
        return None
    try:
        return {f.path for f in get_cached_repo_tree(repo_id, revision=revision)}
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None


def snapshot(
    repo_id: str, key: str, patterns: list[str], revision: str | None = None, repo_type: str = "model"
) -> Path:
    """The local snapshot of `repo_id` at `revision` (default main) holding the files of
    `patterns` that the repository has (fetched where they are not cached); ConfigError naming
    `key` when the Hub refuses or cannot be reached and nothing is cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{key}: {repo_id}"
    kind = "dataset" if repo_type == "dataset" else "model"
    try:
        return Path(
            snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns)
        )
    except GatedRepoError:
        raise ConfigError(
            f"{what} is a gated repository on the Hugging Face Hub: accept its terms on its page, then "
            "set HF_TOKEN (or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{what} is no local path, nor a {kind} repository on the Hugging Face Hub (a private one "
            "needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"{what} has no revision {revision!r} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError as e:
        raise ConfigError(not_cached(what, revision, e)) from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{what}: the Hugging Face Hub refused it ({first_line(e)})") from None


def not_cached(what: str, revision: str | None, error: BaseException | None = None) -> str:
    """The message for a repository (or its files) that neither the cache nor the Hub gives."""
    at = f" at revision {revision}" if revision else ""
    if offline():
        return f"{what}{at} is no local path and not in the Hugging Face cache ({cache_dir()}); {OFFLINE}"
    why = f" ({first_line(error.__cause__ or error)})" if error is not None else ""
    return f"{what}{at} is no local path, not cached, and the Hugging Face Hub cannot be reached{why}"


def dataset_files(
    repo_id: str, key: str, split: str, config: str | None = None, data_dir: str | None = None
) -> list[Path]:
    """The Arrow files `datasets.load_dataset` prepares for `split` of the Hub dataset `repo_id`
    (config `config`, its files under `data_dir`), in order. Offline, the datasets cache's copy
    where datasets prepared it before, else the repository's files in the hub cache."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{key}: {repo_id} names a Hub dataset, which needs the datasets library "
            "(pip install 'megatrain[hub]')"
        ) from None
    if "[" in split:
        raise ConfigError(
            f"{key}: split {split!r} is a slice; megatrain reads whole splits (name one, such as train)"
        )
    what = f"{key}: {repo_id}"
    kwargs = dict(name=config, split=split, data_dir=data_dir)
    try:
        ds = _load(datasets, repo_id, key, kwargs)
    except ValueError as e:  # an unknown split or config: datasets names the ones there are
        raise ConfigError(f"{what}: {first_line(e).removeprefix('ValueError: ')}") from None
    except datasets.exceptions.DatasetNotFoundError as e:
        raise ConfigError(f"{what}: {first_line(e).split(': ', 1)[-1]}") from None
    except (FileNotFoundError, ConnectionError) as e:
        raise ConfigError(f"{what}: {first_line(e)}") from None
    files = [Path(f["filename"]) for f in ds.cache_files]
    if not files:
        raise ConfigError(f"{what}: datasets gave split {split} in memory, not as files")
    return files


def _load(datasets, repo_id: str, key: str, kwargs: dict):
    """load_dataset of the Hub name; offline, where datasets has no prepared copy, of the
    repository's snapshot in the hub cache."""
    try:
        return datasets.load_dataset(repo_id, **kwargs)
    except ConnectionError:
        if not offline():
            raise
    # datasets reads a Hub dataset offline only from its own cache; the hub cache's snapshot of
    # the repository (its README's configs, its data files) loads as a local dataset repository.
    local = snapshot(repo_id, key, ["*"], repo_type="dataset")
    return datasets.load_dataset(str(local), **kwargs)
