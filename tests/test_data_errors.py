"""Malformed data is refused with one line naming the file and line (or the setting) at fault."""

from __future__ import annotations

import json
import re

import pytest
from helpers import tiny_tokenizer

from megatrain.config import TrainConfig
from megatrain.data import Batcher, Sample, build_samples, load_tokenizer, pad_token_id
from megatrain.errors import ConfigError, DataError

USER = {"role": "user", "content": "Hi"}
BOT = {"role": "assistant", "content": "Hello"}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer("chatml")


def cfg_for(dataset, **kw) -> TrainConfig:
    return TrainConfig(model_config="unused", dataset=str(dataset), **kw)


def jsonl(tmp_path, *lines: object, name="d.jsonl"):
    """A JSONL file; str lines are written verbatim, anything else as JSON."""
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def raises(exc, path, line, what):
    """pytest.raises for a one-line message starting `path:line: ` and containing `what`."""
    where = re.escape(f"{path}:{line}" if line is not None else f"{path}")
    return pytest.raises(exc, match=rf"^{where}: .*{re.escape(what)}[^\n]*$")


@pytest.mark.parametrize(
    "records,line,what",
    [
        ([{"messages": [USER, BOT]}, '{"messages": [', {"messages": [USER, BOT]}], 2, "not valid JSON"),
        ([{"text": "ok"}, {"txt": "oops"}], 2, "missing field 'text'"),
        ([{"text": "ok"}, {"text": 5}], 2, "field 'text' must be a string, got int"),
        ([{"text": "ok"}, {"text": None}], 2, "field 'text' is null, expected a string"),
        ([{"instruction": "Say hi."}], 1, "cannot detect the dataset format from the keys ['instruction']"),
        ([{"instruction": "a", "output": "b"}, {"instruction": "a"}], 2, "missing field 'output'"),
        (
            [{"messages": [USER, BOT]}, {"messages": [USER, {"role": "bot", "content": "x"}]}],
            2,
            "unknown role 'bot'",
        ),
        ([{"messages": [USER, {"role": ["x"], "content": "x"}]}], 1, "turn 1 has unknown role ['x']"),
        ([{"messages": [USER, BOT]}, {"messages": []}], 2, "'messages' is an empty conversation"),
        ([{"messages": "hello"}], 1, "'messages' must be a list of turns, got str"),
        (
            [{"messages": [USER, {"role": "assistant", "content": None}]}],
            1,
            "content must be a string or a list of parts, got NoneType",
        ),
        ([{"messages": [USER, {"role": "assistant"}]}], 1, "turn 1 of 'messages' has no 'content'"),
        (
            [{"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}],
            1,
            "unknown role 'robot'",
        ),
        ([{"prompt": "a", "completion": 3}], 1, "field 'completion' must be a string"),
        (
            [{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}],
            1,
            "fields 'prompt' and 'completion' must both be strings or both lists of messages",
        ),
        ([{"text": "a"}, [1, 2]], 2, "expected a JSON object per record, got list"),
    ],
)
def test_malformed_records(tmp_path, tok, records, line, what):
    p = jsonl(tmp_path, *records)
    with raises(DataError, p, line, what):
        build_samples(cfg_for(p), tok)


@pytest.mark.parametrize(
    "records,line,what",
    [
        ([{"input_ids": [1, 2, 3], "labels": [1, 2]}], 1, "'labels' has 2 entries but 'input_ids' has 3"),
        (
            [{"input_ids": [1, 2]}, {"input_ids": [1, 600]}],
            2,
            "token id 600 in 'input_ids' is outside the vocabulary [0, 600)",
        ),
        ([{"input_ids": [1, "2"]}], 1, "'input_ids' must be a list of integers"),
        ([{"input_ids": [1, 2], "labels": [-100, 7000]}], 1, "label 7000 is neither -100 nor a token id"),
        ([{"input_ids": []}], 1, "'input_ids' is empty"),
    ],
)
def test_malformed_token_records(tmp_path, tok, records, line, what):
    p = jsonl(tmp_path, *records)
    with raises(DataError, p, line, what):
        build_samples(cfg_for(p), tok)


def test_json_list_errors_name_the_line(tmp_path, tok):
    p = tmp_path / "d.json"
    p.write_text('[\n  {"text": "a"},\n  {"text": "b"\n  {"text": "c"}\n]\n')
    with raises(DataError, p, 4, "not valid JSON"):
        build_samples(cfg_for(p), tok)
    p.write_text('[\n  {"text": "a"},\n\n  {"tex": "b"}\n]\n')
    with raises(DataError, p, 4, "missing field 'text'"):
        build_samples(cfg_for(p), tok)


def test_empty_files(tmp_path, tok):
    for text, what in [
        ("", "file is empty"),
        ("  \n\n", "file is empty"),
        ("[]", "no records"),
        ("[ ]\n", "no records"),
    ]:
        p = tmp_path / "e.json"
        p.write_text(text)
        with raises(DataError, p, None, what):
            build_samples(cfg_for(p), tok)


def test_over_long_sample_without_truncation(tmp_path, tok):
    p = jsonl(
        tmp_path, {"messages": [USER, BOT]}, {"messages": [{"role": "user", "content": "the " * 50}, BOT]}
    )
    with raises(DataError, p, 2, "more than max_length 32 (set truncation: true"):
        build_samples(cfg_for(p, max_length=32, truncation=False), tok)
    assert len(build_samples(cfg_for(p, max_length=32), tok)) == 1  # truncated: no label left, skipped


def test_rows_without_labels_are_dropped_counted_per_file_and_reason(tmp_path, tok):
    """One policy for a conversation without an assistant turn and one whose assistant turn
    max_length cuts off: dropped, one warning per file and reason, with the count."""
    long_prompt = {"messages": [{"role": "user", "content": "the " * 50}, BOT]}
    p = jsonl(
        tmp_path, *[{"messages": [USER, USER]}] * 1000, {"messages": [USER, BOT]}, long_prompt, long_prompt
    )
    said = []
    samples = build_samples(cfg_for(p, max_length=32), tok, warn=said.append)
    assert [s.source for s in samples] == [f"{p}:1001"]
    assert said == [
        f"megatrain: warning: dropped 1,000 of 1,003 rows of {p}: no assistant turn (first: {p}:1)",
        f"megatrain: warning: dropped 2 of 1,003 rows of {p}: no assistant tokens after truncation to "
        f"max_length=32 (first: {p}:1002)",
    ]
    # With train_on_prompt a conversation without an assistant turn has labels: it is kept.
    assert len(build_samples(cfg_for(p, max_length=32, train_on_prompt=True), tok, warn=said.append)) == 1003


def test_all_samples_without_labels(tmp_path, tok):
    p = jsonl(tmp_path, {"messages": [{"role": "user", "content": "the " * 50}, BOT]}, {"messages": [USER]})
    said = []
    with pytest.raises(DataError) as e:
        build_samples(cfg_for(p, max_length=16), tok, warn=said.append)
    assert str(e.value) == (
        "dataset: no trainable samples: all 2 rows dropped (1 with no assistant tokens after truncation to "
        f"max_length=16; 1 with no assistant turn; first: {p}:1)"
    )
    assert said == []  # the error says it all


def test_chat_data_needs_a_chat_template(tmp_path):
    p = jsonl(tmp_path, {"messages": [USER, BOT]})
    plain = tiny_tokenizer(None)
    plain.save_pretrained(tmp_path / "tk")
    loaded = load_tokenizer(tmp_path / "tk")
    with pytest.raises(
        ConfigError,
        match=rf"tokenizer at {re.escape(str(tmp_path / 'tk'))} has no chat template; {re.escape(str(p))} is chat data",
    ):
        build_samples(cfg_for(p), loaded)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: the messages format needs a tokenizer"):
        build_samples(cfg_for(p), None)
    q = jsonl(tmp_path, {"text": "a"}, name="t.jsonl")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(q))}: the text format needs a tokenizer"):
        build_samples(cfg_for(q), None)


def test_template_errors_name_the_record(tmp_path):
    tok = tiny_tokenizer("chatml")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    p = jsonl(
        tmp_path, {"messages": [USER, BOT]}, {"messages": [{"role": "system", "content": "s"}, USER, BOT]}
    )
    with raises(DataError, p, 2, "the chat template refused this conversation (no system role)"):
        build_samples(cfg_for(p), tok)


def test_missing_dataset_and_registry_errors(tmp_path, tok):
    with pytest.raises(
        ConfigError, match=rf"dataset {re.escape(str(tmp_path / 'nope.jsonl'))}: no such file"
    ):
        build_samples(cfg_for(tmp_path / "nope.jsonl"), tok)
    info = tmp_path / "dataset_info.json"
    info.write_text(json.dumps({"hub": {"ms_hub_url": "org/x"}, "gone": {"file_name": "gone.json"}}))
    with pytest.raises(
        ConfigError, match=r"'hub' has ms_hub_url, but only local files and hf_hub_url are read"
    ):
        build_samples(cfg_for("hub", dataset_info=str(info)), tok)
    with pytest.raises(
        ConfigError, match=rf"'gone': file_name {re.escape(str(tmp_path / 'gone.json'))} does not exist"
    ):
        build_samples(cfg_for("gone", dataset_info=str(info)), tok)
    with pytest.raises(
        ConfigError,
        match=rf"dataset other: no such file, and not a name in {re.escape(str(info))} \(registered: gone, hub\)",
    ):
        build_samples(cfg_for("other", dataset_info=str(info)), tok)
    info.write_text("{\n  'bad': 1\n}")
    with pytest.raises(ConfigError, match=rf"dataset_info {re.escape(str(info))}:2: not valid JSON"):
        build_samples(cfg_for("bad", dataset_info=str(info)), tok)


def test_bad_parquet(tmp_path, tok):
    p = tmp_path / "d.parquet"
    p.write_bytes(b"this is not parquet")
    with raises(DataError, p, None, "not a readable Parquet file"):
        build_samples(cfg_for(p), tok)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(
        ConfigError, match=rf"tokenizer {re.escape(str(tmp_path / 'x'))}: no such file or directory"
    ):
        load_tokenizer(tmp_path / "x")
    with pytest.raises(
        ConfigError, match=rf"tokenizer {re.escape(str(tmp_path))}: directory has no tokenizer.json"
    ):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(
        ConfigError, match=rf"tokenizer {re.escape(str(tmp_path / 'tokenizer.json'))}:1: not valid JSON"
    ):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_dataset_smaller_than_one_step():
    samples = [Sample([1, 2, 3], [1, 2, 3], f"mem:{k}") for k in range(5)]
    with pytest.raises(
        DataError,
        match=r"dataset too small: 5 samples \(15 tokens\), but one optimizer step needs 6 samples \(per_device_train_batch_size 3 x gradient_accumulation_steps 2\)",
    ):
        Batcher(samples, batch_size=3, grad_accum=2, max_length=8)
    with pytest.raises(
        DataError,
        match=r"5 samples \(15 tokens\) pack into 3 rows of max_length 8, but one optimizer step needs 4 rows",
    ):
        Batcher(samples, batch_size=2, grad_accum=2, max_length=8, packing=True)


# ---------------------------------------------------------------------------- JSON corner cases
@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\u0085"])
def test_jsonl_lines_end_at_newline_only(tmp_path, tok, sep):
    """JSON allows these unescaped inside strings; str.splitlines() would split the record there."""
    p = tmp_path / "d.jsonl"
    p.write_text(f'{{"text": "one{sep}two"}}\r\n\r\n{{"text": "three"}}\r\n', encoding="utf-8", newline="")
    samples = build_samples(cfg_for(p), tok)
    assert [s.source for s in samples] == [f"{p}:1", f"{p}:3"]
    assert tok.decode(samples[0].input_ids, skip_special_tokens=True) == f"one{sep}two"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_lone_surrogate_names_the_line(tmp_path, tok, suffix):
    records = ['{"text": "fine \\ud83d\\ude00"}', '{"messages": "x", "text": "half \\udc00 a pair"}']
    p = tmp_path / f"d{suffix}"
    p.write_text("\n".join(records) + "\n" if suffix == ".jsonl" else "[\n" + ",\n".join(records) + "\n]\n")
    line = 2 if suffix == ".jsonl" else 3  # a JSON list starts with "[" on line 1
    with raises(DataError, p, line, "a string holds an unpaired UTF-16 surrogate escape"):
        build_samples(cfg_for(p, dataset_format="text"), tok)
    p.write_text(p.read_text().replace("\\udc00", "\\u00e9"))  # the pair on line 1 is fine
    assert len(build_samples(cfg_for(p, dataset_format="text"), tok)) == 2


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_deep_nesting_names_the_line(tmp_path, tok, suffix):
    deep = '{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    records = ['{"text": "ok"}', deep]
    p = tmp_path / f"d{suffix}"
    p.write_text("\n".join(records) + "\n" if suffix == ".jsonl" else "[\n" + ",\n".join(records) + "\n]\n")
    with raises(DataError, p, 2 if suffix == ".jsonl" else 3, "JSON nested too deeply to read"):
        build_samples(cfg_for(p), tok)


def test_token_ids_checked_against_the_models_vocabulary(tmp_path, tok):
    """The model's vocab_size bounds every id, read or produced by the tokenizer: an id past the
    embedding fails only in the middle of a run."""
    p = jsonl(tmp_path, {"input_ids": [1, 96]}, {"input_ids": [1, 2, 97]})
    with raises(DataError, p, 2, "token id 97 in 'input_ids' is outside the vocabulary [0, 97)"):
        build_samples(cfg_for(p), tok, vocab_size=97)
    p = jsonl(
        tmp_path, {"input_ids": [1, 2], "labels": [-100, 2]}, {"input_ids": [1, 2], "labels": [-100, 97]}
    )
    with raises(DataError, p, 2, "label 97 is neither -100 nor a token id of the vocabulary [0, 97)"):
        build_samples(cfg_for(p), tok, vocab_size=97)
    p = jsonl(tmp_path, {"input_ids": [1, 2**70]})  # without any vocabulary: still an int64
    with raises(DataError, p, 1, f"token id {2**70} in 'input_ids' is outside the vocabulary [0, {2**63})"):
        build_samples(cfg_for(p), None)
    p = jsonl(tmp_path, {"text": "the"}, {"text": "the people"}, name="t.jsonl")
    high = max(tok("the people")["input_ids"])
    assert high > max(tok("the")["input_ids"])
    with raises(DataError, p, 2, f"the tokenizer gives token id {high}, outside the model's vocabulary"):
        build_samples(cfg_for(p), tok, vocab_size=high)


def test_pad_id_is_a_row_of_the_embedding():
    tok = tiny_tokenizer("chatml")
    assert pad_token_id(tok, 600) == tok.pad_token_id == 0
    tok.pad_token = "<|eot_id|>"  # id 8: beyond a 5-row model, so its EOS pads
    assert pad_token_id(tok, 5) == tok.eos_token_id == 2
    assert pad_token_id(None, 97, 7) == 7  # the model config's pad_token_id
    assert pad_token_id(None, 97, 200) == 0 and pad_token_id(None, 97) == 0


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_invalid_utf8_names_the_line(tmp_path, tok, suffix):
    import gzip

    data = b'{"text": "one"}\n{"text": "two"}\n{"text": "caf\xe9"}\n'
    p = tmp_path / f"u{suffix}"
    p.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    with raises(DataError, p, 3, "not UTF-8 text (invalid continuation byte at byte 45"):
        build_samples(cfg_for(p), tok)


@pytest.mark.parametrize(
    "suffix,text",
    [
        (".jsonl", '{"text": "one"}\n{"text": "two"}\n'),
        (".json", '[{"text": "one"},\n {"text": "two"}]\n'),
        (".csv", "text\none\ntwo\n"),
        (".tsv", "text\none\ntwo\n"),
    ],
)
def test_a_byte_order_mark_is_read_past(tmp_path, tok, suffix, text):
    """Editors' and Excel's UTF-8 exports start with U+FEFF: the same samples as without it."""
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
    plain.write_text(text, encoding="utf-8")
    marked.write_text("\ufeff" + text, encoding="utf-8")
    want = build_samples(cfg_for(plain, dataset_format="text"), tok)
    got = build_samples(cfg_for(marked, dataset_format="text"), tok)
    assert [s.input_ids for s in got] == [s.input_ids for s in want] and len(got) == 2
    assert [s.source.rsplit(":", 1)[1] for s in got] == [s.source.rsplit(":", 1)[1] for s in want]


@pytest.mark.parametrize("corrupt", ["tokenizer.json", "tokenizer_config.json"])
def test_a_corrupt_tokenizer_file_is_named(tmp_path, tok, corrupt):
    """A tokenizer directory with one file cut short: the error names that file and its line."""
    tok.save_pretrained(tmp_path)
    path = tmp_path / corrupt
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    line = text[: len(text) // 2].count("\n") + 1
    with pytest.raises(ConfigError, match=rf"^tokenizer {re.escape(str(path))}:{line}: not valid JSON \("):
        load_tokenizer(tmp_path)
    if corrupt == "tokenizer.json":
        with pytest.raises(ConfigError, match=rf"^tokenizer {re.escape(str(path))}:{line}: not valid JSON"):
            load_tokenizer(path)
