"""Hub names for models, tokenizers and datasets, without a network: the tests build a Hugging
Face cache on disk in huggingface_hub's own layout (`models--org--name/{refs/main, blobs/,
snapshots/<commit>/}`, `datasets--org--name/...`) and run offline (HF_HUB_OFFLINE), so the real
loading code reads it. A model, tokenizer and dataset named by their Hub ids train bitwise as
their local copies do; every refusal is one line."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from helpers import tiny_hf_model, tiny_tokenizer

from megatrain import hub
from megatrain.config import TrainConfig
from megatrain.errors import ConfigError
from megatrain.io.pretrained import local_models
from megatrain.trainer import train

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """HF_HOME in tmp_path, offline. huggingface_hub and datasets read these variables when
    imported, so their module constants are set as the variables would have set them."""
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf"
    env = dict(HF_HOME=home, HF_HUB_CACHE=home / "hub", HF_DATASETS_CACHE=home / "datasets")
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
        for module in (constants, datasets.config):
            if hasattr(module, k):
                monkeypatch.setattr(module, k, str(v))
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return home / "hub"


def cache_repo(cache: Path, repo: str, source: Path, repo_type: str = "model", listed: bool = False) -> Path:
    """`source`'s files as the snapshot of `repo` at COMMIT, main pointing at it (blobs named by
    their sha256, snapshot entries relative links to them, as huggingface_hub stores them);
    `listed`: with the tree listing huggingface_hub caches beside a snapshot it downloaded."""
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    root = cache / f"{repo_type}s--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    entries = {}
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        data = f.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        blob = root / "blobs" / sha
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        name = f.relative_to(source).as_posix()
        link = root / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        entries[name] = TreeCacheEntry(size=len(data), blob_id=hashlib.sha1(data).hexdigest())
    if listed:
        write_tree_cache(str(root), COMMIT, entries)
    return root / "snapshots" / COMMIT


@pytest.fixture
def local(tmp_path):
    """A tiny Llama with its tokenizer, and a text dataset: the local copies."""
    model_dir = tmp_path / "local" / "model"
    tok = tiny_tokenizer()
    tiny_hf_model("llama", num_hidden_layers=2, vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "local" / "data" / "data"
    data.mkdir(parents=True)
    lines = [json.dumps({"text": f"the word {i} was said of them all {i * 7}"}) for i in range(12)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    (data / "test.jsonl").write_text("\n".join(lines[:4]) + "\n")
    return model_dir, data


def run(tmp_path, name, **kw):
    out = tmp_path / name
    cfg = dict(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-2, max_length=32, shuffle=False, save_strategy="no", disable_tqdm=True,
        save_dtype="float32", eval_steps=3, max_grad_norm=0.5,
    )  # fmt: skip
    train(TrainConfig(**(cfg | kw)))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r.get("loss"), r.get("eval_loss"), r.get("grad_norm")) for r in records], out


def test_hub_names_train_as_their_local_copies(tmp_path, hub_cache, local):
    model_dir, data = local
    cache_repo(hub_cache, "org/tiny", model_dir)
    cache_repo(hub_cache, "org/stories", data.parent, "dataset")
    mine, mine_out = run(
        tmp_path, "local", model_name_or_path=str(model_dir), dataset=str(data / "train.jsonl"),
        eval_dataset=str(data / "test.jsonl"),
    )  # fmt: skip
    theirs, out = run(
        tmp_path, "hub", model_name_or_path="org/tiny", dataset="org/stories", eval_dataset="org/stories"
    )
    assert len(mine) == 4 and mine == theirs  # bitwise: the same floats
    assert (out / "final" / "model.safetensors").read_bytes() == (
        mine_out / "final" / "model.safetensors"
    ).read_bytes()
    # the run records where its model came from: the snapshot of the commit main names
    recorded = json.loads((out / "train_config.json").read_text())["model_name_or_path"]
    assert recorded == str(hub_cache / "models--org--tiny" / "snapshots" / COMMIT)


def test_a_tokenizer_and_a_config_by_hub_name(tmp_path, hub_cache, local):
    model_dir, _ = local
    tok = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok)
    cache_repo(hub_cache, "org/tok", tok)
    cache_repo(hub_cache, "org/tiny", model_dir)
    cfg = local_models(
        TrainConfig(model_config="org/tiny", tokenizer_name_or_path="org/tok", model_revision=COMMIT)
    )
    assert Path(cfg.tokenizer_name_or_path) == hub_cache / "models--org--tok" / "snapshots" / COMMIT
    assert (Path(cfg.model_config) / "config.json").is_file()
    # a local path of the name wins
    os.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tok").symlink_to(tok)
    assert (
        local_models(
            TrainConfig(model_config=str(model_dir), tokenizer_name_or_path="org/tok")
        ).tokenizer_name_or_path
        == "org/tok"
    )


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_refusals_are_one_line(tmp_path, hub_cache, local):
    model_dir, data = local
    with pytest.raises(ConfigError) as e:
        local_models(TrainConfig(model_name_or_path="org/absent"))
    assert "model_name_or_path: org/absent is no local path and not in the Hugging Face cache" in _one_line(e)
    assert "HF_HUB_OFFLINE" in str(e.value)
    # a repository listed (downloaded once) without safetensors: .bin weights only
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    (bin_only / "pytorch_model.bin").write_bytes(b"0" * 10)
    cache_repo(hub_cache, "org/bin", bin_only, listed=True)
    with pytest.raises(ConfigError) as e:
        local_models(TrainConfig(model_name_or_path="org/bin"))
    assert _one_line(e) == (
        "model_name_or_path: org/bin holds no model.safetensors on the Hugging Face Hub (megatrain reads "
        "safetensors weights only, not .bin or .pt)"
    )
    # cached in part (config only, no listing): offline, the weights are not in the cache
    config_only = tmp_path / "cfg"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    cache_repo(hub_cache, "org/part", config_only)
    with pytest.raises(ConfigError) as e:
        local_models(TrainConfig(model_name_or_path="org/part"))
    assert "org/part: no model.safetensors in the Hugging Face cache" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        local_models(TrainConfig(model_name_or_path="org/tiny", model_revision="v2"))
    assert "org/tiny at revision v2 is no local path and not in the Hugging Face cache" in _one_line(e)
    # datasets: absent, a split it lacks, a config it lacks, a slice
    cache_repo(hub_cache, "org/stories", data.parent, "dataset")
    cases = [
        (
            dict(dataset="org/nothing"),
            "dataset: org/nothing is no local path and not in the Hugging Face cache",
        ),
        (dict(dataset="org/stories", dataset_train_split="dev"), 'dataset: org/stories: Unknown split "dev"'),
        (
            dict(dataset="org/stories", dataset_config="big"),
            "dataset: org/stories: BuilderConfig 'big' not found",
        ),
        (dict(dataset="org/stories", dataset_train_split="train[:2]"), "split 'train[:2]' is a slice"),
    ]
    for kw, message in cases:
        with pytest.raises(ConfigError) as e:
            run(tmp_path, f"bad{len(message)}", model_name_or_path=str(model_dir), **kw)
        assert message in _one_line(e), kw


def test_a_registered_hub_dataset(tmp_path, hub_cache, local):
    """dataset_info.json's hf_hub_url, with LlamaFactory's split and columns."""
    model_dir, data = local
    cache_repo(hub_cache, "org/stories", data.parent, "dataset")
    info = tmp_path / "dataset_info.json"
    info.write_text(
        json.dumps({"s": {"hf_hub_url": "org/stories", "split": "test", "columns": {"text": "text"}}})
    )
    from megatrain.data.sources import resolve_dataset

    files = resolve_dataset(
        TrainConfig(model_name_or_path=str(model_dir), dataset="s", dataset_info=str(info))
    )
    assert [f.path.name.split("-")[-1] for f in files] == ["test.arrow"] and files[0].columns == {
        "text": "text"
    }


def test_names_that_are_not_repository_ids():
    assert hub.is_repo_id("Qwen/Qwen2.5-7B-Instruct") and hub.is_repo_id("gpt2")
    assert not any(hub.is_repo_id(n) for n in ("a/b/c", "data/x.jsonl/..", "/abs/path", "a--b/c"))


def test_what_the_hub_refuses_is_one_line(tmp_path, hub_cache, monkeypatch):
    """A stand-in for the Hub on a local port answers as the Hub does (its X-Error-Code header):
    a repository that does not exist, a gated one, a revision a repository lacks."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from huggingface_hub import constants

    answers = {
        "absent": (404, "RepoNotFound"),
        "gated": (401, "GatedRepo"),
        "tiny": (404, "RevisionNotFound"),
    }

    class Hub(BaseHTTPRequestHandler):
        def do_GET(self):
            status, code = answers[self.path.split("/")[4]]  # /api/models/org/<name>/revision/...
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", "hf_test")  # no user's token is read or sent elsewhere
    try:
        cases = [
            (
                dict(model_name_or_path="org/absent"),
                "org/absent is no local path, nor a model repository on the Hugging Face Hub",
            ),
            (
                dict(model_config="org/gated"),
                "model_config: org/gated is a gated repository on the Hugging Face Hub",
            ),
            (
                dict(model_name_or_path="org/tiny", model_revision="v9"),
                "org/tiny has no revision 'v9' on the Hugging Face Hub",
            ),
        ]
        for kw, message in cases:
            with pytest.raises(ConfigError) as e:
                local_models(TrainConfig(**kw))
            assert message in _one_line(e), kw
    finally:
        server.shutdown()
