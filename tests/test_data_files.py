"""Dataset files as people have them: directories Hugging Face `datasets` saved (a Dataset, a
DatasetDict; built here with pyarrow in the layout `save_to_disk` writes), Arrow files,
CSV/TSV, gzip- and zstandard-compressed text, and the `columns` mapping; each read as the
same records in JSONL gives, bad rows refused with one line naming the file, line or row and
the field."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from helpers import tiny_tokenizer

from megatrain.config import TrainConfig
from megatrain.data import build_samples
from megatrain.errors import ConfigError, DataError
from megatrain.trainer import train

CHAT = [
    {
        "messages": [
            {"role": "user", "content": "Where is the house?"},
            {"role": "assistant", "content": "By the water."},
        ]
    },
    {"messages": [{"role": "user", "content": "Is it old?"}, {"role": "assistant", "content": "Very old."}]},
    {"messages": [{"role": "user", "content": "Who lives there?"}, {"role": "assistant", "content": "Pip."}]},
]
QA = [
    {"question": "Say hi.", "answer": "Hi, there.", "id": "1"},
    {"question": "Say yes,\nplease.", "answer": 'He said "yes".', "id": "2"},
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer("chatml")


def cfg_for(dataset, **kw) -> TrainConfig:
    return TrainConfig(
        model_config="unused", dataset=dataset if isinstance(dataset, list) else str(dataset), **kw
    )


def ids(samples) -> list[tuple[list[int], list[int]]]:
    return [(s.input_ids, s.labels) for s in samples]


def jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def arrow_stream(path: Path, records: list[dict]) -> Path:
    """An Arrow IPC stream file, as `datasets` writes its data files."""
    import pyarrow as pa

    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1):  # several record batches, as datasets writes
            writer.write_batch(batch)
    return path


def save_to_disk(directory: Path, records: list[dict], shards: int = 2) -> Path:
    """The layout of `datasets.Dataset.save_to_disk`: data-0000i-of-0000n.arrow stream files,
    state.json listing them in order, and a dataset_info.json of its own (not a registry)."""
    directory.mkdir(parents=True)
    per = -(-len(records) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        arrow_stream(directory / name, records[i * per : (i + 1) * per])
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (directory / "state.json").write_text(json.dumps(state, indent=2))
    info = {"citation": "", "description": "", "features": {"messages": {"feature": {}, "_type": "List"}}}
    (directory / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return directory


def save_dict_to_disk(directory: Path, splits: dict[str, list[dict]]) -> Path:
    """The layout of `datasets.DatasetDict.save_to_disk`: dataset_dict.json and a directory per split."""
    for name, records in splits.items():
        save_to_disk(directory / name, records, shards=1)
    (directory / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return directory


# ---------------------------------------------------------------------------- datasets' directories
def test_saved_dataset_reads_as_its_jsonl(tmp_path, tok):
    want = ids(build_samples(cfg_for(jsonl(tmp_path / "chat.jsonl", CHAT)), tok))
    saved = save_to_disk(tmp_path / "saved", CHAT)
    samples = build_samples(cfg_for(saved), tok)
    assert ids(samples) == want
    a, b = saved / "data-00000-of-00002.arrow", saved / "data-00001-of-00002.arrow"
    assert [s.source for s in samples] == [
        f"{a}:1",
        f"{a}:2",
        f"{b}:1",
    ]  # each file's rows, in state.json's order


def test_dataset_dict_picks_train_and_eval_splits(tmp_path, tok):
    d = save_dict_to_disk(tmp_path / "dd", {"train": CHAT[:2], "validation": CHAT[2:], "test": CHAT[:1]})
    plain = {
        k: build_samples(cfg_for(jsonl(tmp_path / f"{k}.jsonl", v)), tok)
        for k, v in (("train", CHAT[:2]), ("validation", CHAT[2:]), ("test", CHAT[:1]))
    }
    assert ids(build_samples(cfg_for(d), tok)) == ids(plain["train"])
    cfg = cfg_for(d, eval_dataset=str(d))
    assert ids(build_samples(cfg, tok, key="eval_dataset")) == ids(plain["validation"])
    assert ids(build_samples(cfg_for(d / "test"), tok)) == ids(
        plain["test"]
    )  # a split named by its directory
    # A dataset_info.json entry's `split` picks one.
    (tmp_path / "dataset_info.json").write_text(
        json.dumps(
            {
                "dd_test": {
                    "file_name": "dd",
                    "formatting": "sharegpt",
                    "columns": {"messages": "messages"},
                    "split": "test",
                }
            }
        )
    )
    assert ids(build_samples(cfg_for(str(tmp_path / "dd_test")), tok)) == ids(plain["test"])

    only = save_dict_to_disk(tmp_path / "only", {"test": CHAT})
    with pytest.raises(
        ConfigError,
        match=rf"^dataset {re.escape(str(only))}: a dataset dictionary without a train split \(splits: test\); name one as {re.escape(str(only / 'test'))}$",
    ):
        build_samples(cfg_for(only), tok)


def test_incomplete_saved_dataset_is_one_line(tmp_path, tok):
    saved = save_to_disk(tmp_path / "saved", CHAT)
    (saved / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(
        ConfigError,
        match=rf"^dataset {re.escape(str(saved))}: data-00001-of-00002.arrow, listed in state.json, is missing$",
    ):
        build_samples(cfg_for(saved), tok)
    (saved / "state.json").write_text("{")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(saved / 'state.json'))}: not readable JSON"):
        build_samples(cfg_for(saved), tok)


def test_arrow_files_stream_and_file_format(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.feather as feather

    want = ids(build_samples(cfg_for(jsonl(tmp_path / "chat.jsonl", CHAT)), tok))
    stream = arrow_stream(tmp_path / "stream.arrow", CHAT)
    assert ids(build_samples(cfg_for(stream), tok)) == want
    file = tmp_path / "file.arrow"
    feather.write_feather(pa.Table.from_pylist(CHAT), str(file), compression="uncompressed")
    assert ids(build_samples(cfg_for(file), tok)) == want
    # A directory of them, beside other data files, in name order.
    assert ids(build_samples(cfg_for(tmp_path), tok)) == want * 3
    bad = tmp_path / "bad" / "x.arrow"
    bad.parent.mkdir()
    bad.write_bytes(b"not arrow at all")
    with pytest.raises(DataError, match=rf"^{re.escape(str(bad))}: not a readable Arrow file \("):
        build_samples(cfg_for(bad), tok)


def test_arrow_bad_row_names_file_row_and_field(tmp_path, tok):
    rows = [{"text": "the house"}, {"text": None}]
    f = arrow_stream(tmp_path / "t.arrow", rows)
    with pytest.raises(DataError, match=rf"^{re.escape(str(f))}:2: field 'text' is null, expected a string$"):
        build_samples(cfg_for(f), tok)


# ---------------------------------------------------------------------------- CSV, TSV
def _csv_text(rows: list[dict], sep: str) -> str:
    import csv
    import io

    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(rows[0]), delimiter=sep)
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()


@pytest.mark.parametrize("suffix,sep", [(".csv", ","), (".tsv", "\t")])
def test_csv_and_tsv_with_columns(tmp_path, tok, suffix, sep):
    """A question/answer table with the columns mapped to prompt_completion's fields, a quoted
    field over two lines, Excel's byte-order mark: the samples of the same JSONL."""
    want = ids(
        build_samples(
            cfg_for(
                jsonl(
                    tmp_path / "pc.jsonl", [{"prompt": r["question"], "completion": r["answer"]} for r in QA]
                )
            ),
            tok,
        )
    )
    f = tmp_path / f"qa{suffix}"
    f.write_text("\ufeff" + _csv_text(QA, sep), encoding="utf-8")
    columns = {"prompt": "question", "completion": "answer"}
    samples = build_samples(cfg_for(f, columns=columns), tok)
    assert ids(samples) == want
    assert [s.source for s in samples] == [f"{f}:2", f"{f}:3"]
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(str(f))}:2: cannot detect the dataset format from the keys \['answer', 'id', 'question'\]; expected",
    ):
        build_samples(cfg_for(f), tok)


def test_csv_bad_rows_name_file_line_and_field(tmp_path, tok):
    f = tmp_path / "t.csv"
    f.write_text('text,source\n"one\ntwo",a\nthree,b,extra\n')
    with pytest.raises(
        DataError, match=rf"^{re.escape(str(f))}:4: 3 fields, but the header has 2 \(text, source\)$"
    ):
        build_samples(cfg_for(f), tok)
    f.write_text("prompt,completion\nSay hi.,Hi.\nSay no.\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(f))}:3: 1 fields, but the header has 2"):
        build_samples(cfg_for(f), tok)
    f.write_text("text,text\na,b\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(f))}:1: the header names column 'text' twice$"):
        build_samples(cfg_for(f), tok)
    f.write_text("question,answer\nSay hi.,Hi.\n")
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(str(f))}:2: missing field 'reply' \(record has \['answer', 'question'\]\)$",
    ):
        build_samples(
            cfg_for(
                f, columns={"prompt": "question", "completion": "reply"}, dataset_format="prompt_completion"
            ),
            tok,
        )
    f.write_text("text\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(f))}: no records$"):
        build_samples(cfg_for(f), tok)


# ---------------------------------------------------------------------------- compressed
def test_gzip_and_zstandard_jsonl(tmp_path, tok):
    import zstandard

    plain = jsonl(tmp_path / "chat.jsonl", CHAT)
    want = ids(build_samples(cfg_for(plain), tok))
    gz = tmp_path / "chat.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    zst = tmp_path / "chat.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    streamed = tmp_path / "streamed.json.zst"  # a JSON list, compressed without the frame's size
    c = zstandard.ZstdCompressor().compressobj()
    streamed.write_bytes(c.compress(json.dumps(CHAT, indent=1).encode()) + c.flush())
    assert ids(build_samples(cfg_for(streamed), tok)) == want
    for f in (gz, zst):
        samples = build_samples(cfg_for(f), tok)
        assert ids(samples) == want and [s.source for s in samples] == [f"{f}:{n}" for n in (1, 2, 3)]
    # Errors name the line of the decompressed text.
    gz.write_bytes(gzip.compress(plain.read_bytes() + b'{"messages": oops}\n'))
    with pytest.raises(DataError, match=rf"^{re.escape(str(gz))}:4: not valid JSON"):
        build_samples(cfg_for(gz), tok)
    gz.write_bytes(gzip.compress(plain.read_bytes())[:-12])
    with pytest.raises(DataError, match=rf"^{re.escape(str(gz))}: not a readable gzip file \("):
        build_samples(cfg_for(gz), tok)
    zst.write_bytes(b"\x28\xb5\x2f\xfd garbage")
    with pytest.raises(DataError, match=rf"^{re.escape(str(zst))}: not a readable zstandard file \("):
        build_samples(cfg_for(zst), tok)


def test_compressed_csv(tmp_path, tok):
    f = tmp_path / "qa.csv.gz"
    f.write_bytes(gzip.compress(_csv_text(QA, ",").encode()))
    samples = build_samples(cfg_for(f, columns={"prompt": "question", "completion": "answer"}), tok)
    assert len(samples) == 2 and [s.source for s in samples] == [f"{f}:2", f"{f}:3"]


def test_zst_without_zstandard_is_one_line(tmp_path, tok, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setitem(sys.modules, "compression.zstd", None)  # Python 3.14's own
    f = tmp_path / "d.jsonl.zst"
    f.write_bytes(b"\x28\xb5\x2f\xfd")
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(str(f))}: reading .zst files needs zstandard \(pip install zstandard\)$",
    ):
        build_samples(cfg_for(f), tok)


# ---------------------------------------------------------------------------- columns
def test_columns_map_every_format(tmp_path, tok):
    """Each format's fields under other names give the samples of the format's own names."""
    cases = [
        ({"text": "the old house"}, {"body": "the old house"}, {"text": "body"}),
        (
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
            {"ids": [5, 6, 7], "lab": [-100, 6, 7]},
            {"input_ids": "ids", "labels": "lab"},
        ),
        (
            {"instruction": "Say hi.", "input": "now", "output": "Hi."},
            {"q": "Say hi.", "ctx": "now", "a": "Hi."},
            {"prompt": "q", "query": "ctx", "response": "a"},
        ),
        (
            {"prompt": "Say hi.", "completion": "Hi."},
            {"question": "Say hi.", "answer": "Hi."},
            {"prompt": "question", "completion": "answer"},
        ),
        (CHAT[0], {"dialog": CHAT[0]["messages"], "sys": "Be kind."}, {"messages": "dialog"}),
    ]
    for n, (own, renamed, columns) in enumerate(cases):
        want = build_samples(cfg_for(jsonl(tmp_path / f"own{n}.jsonl", [own])), tok)
        got = build_samples(cfg_for(jsonl(tmp_path / f"renamed{n}.jsonl", [renamed]), columns=columns), tok)
        assert ids(got) == ids(want), columns
    # messages with a system column
    with_system = build_samples(
        cfg_for(tmp_path / "renamed4.jsonl", columns={"messages": "dialog", "system": "sys"}), tok
    )
    system_first = {"messages": [{"role": "system", "content": "Be kind."}, *CHAT[0]["messages"]]}
    assert ids(with_system) == ids(build_samples(cfg_for(jsonl(tmp_path / "sys.jsonl", [system_first])), tok))


def test_bad_columns_key():
    with pytest.raises(
        ConfigError,
        match=r"^columns: 'answer' is not a field \(fields: text, input_ids, labels, prompt, completion, query, response, system, history, messages\)",
    ):
        cfg_for("d.jsonl", columns={"answer": "reply"})
    with pytest.raises(ConfigError, match=r"^columns: prompt's column must be a name, got 3"):
        cfg_for("d.jsonl", columns={"prompt": 3})


# ---------------------------------------------------------------------------- a run
def test_training_on_a_saved_dataset_dict(tmp_path):
    """A run reads the train split and evaluates on the validation split of one saved DatasetDict."""
    from helpers import tiny_config

    tiny_config("llama", vocab_size=640).save_pretrained(tmp_path / "model")
    tiny_tokenizer("chatml").save_pretrained(tmp_path / "tok")
    d = save_dict_to_disk(tmp_path / "dd", {"train": CHAT * 4, "validation": CHAT[:2]})
    out = tmp_path / "out"
    train(
        TrainConfig(
            model_config=str(tmp_path / "model"),
            tokenizer_name_or_path=str(tmp_path / "tok"),
            dataset=str(d),
            eval_dataset=str(d),
            eval_steps=2,
            max_steps=2,
            max_length=64,
            per_device_train_batch_size=2,
            output_dir=str(out),
            disable_tqdm=True,
            save_strategy="no",
        )
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (
        [r["step"] for r in records] == [1, 2, 2] and records[0]["samples"] == 2 and "eval_loss" in records[2]
    )
