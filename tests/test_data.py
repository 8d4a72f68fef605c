"""The data pipeline: every format's tokens and labels, chat masking per turn, dataset
resolution, batching, packing (checked against the model itself) and exact resume."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_hf_model, tiny_tokenizer

from megatrain.config import TrainConfig
from megatrain.data import Batcher, Sample, build_samples, load_tokenizer, pack_rows
from megatrain.data.batch import MicroBatch
from megatrain.data.samples import split_windows
from megatrain.errors import DataError
from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model

CONV = [
    {"role": "system", "content": "You are a good help."},
    {"role": "user", "content": "What is the name of the house?"},
    {"role": "assistant", "content": "The house has no name."},
    {"role": "user", "content": "Tell me more about it."},
    {"role": "assistant", "content": "It is big and old, with water around."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are well come."},
]
ASSISTANT = [m["content"] for m in CONV if m["role"] == "assistant"]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def cfg_for(dataset, **kw) -> TrainConfig:
    return TrainConfig(model_config="unused", dataset=dataset, **kw)


def supervised_spans(tok, sample: Sample) -> list[str]:
    """Decoded runs of consecutive labelled tokens (labels[0] is never a target: skipped)."""
    runs, cur = [], []
    for t, (i, lab) in enumerate(zip(sample.input_ids, sample.labels)):
        if lab != -100 and t > 0:
            assert lab == i, "chat labels must equal the input token"
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer("chatml")


# ----------------------------------------------------------------------------- formats
def test_text_format_adds_bos_and_eos(tmp_path, tok):
    texts = ["the house is old.", "hello world, how are you?"]
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    samples = build_samples(cfg_for(f), tok)
    assert len(samples) == 2
    for s, t in zip(samples, texts):
        body = tok(t, add_special_tokens=False)["input_ids"]
        assert s.input_ids == [tok.bos_token_id, *body, tok.eos_token_id]
        assert s.labels == s.input_ids
    assert samples[1].source == f"{f}:2"


def test_tokens_format_without_tokenizer(tmp_path):
    f = write_jsonl(
        tmp_path / "k.jsonl",
        [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11], "labels": [-100, 10, 11]}],
    )
    samples = build_samples(cfg_for(f, dataset_format="tokens"), None)
    assert [(s.input_ids, s.labels) for s in samples] == [
        ([5, 6, 7, 8], [5, 6, 7, 8]),
        ([9, 10, 11], [-100, 10, 11]),
    ]


@pytest.mark.parametrize("template,eot", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_messages_every_assistant_turn_supervised(tmp_path, template, eot):
    tok = tiny_tokenizer(template)
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV, "tools": [{"name": "x"}]}])
    (s,) = build_samples(cfg_for(f), tok)
    rendered = tok.apply_chat_template(CONV, tokenize=False)
    assert s.input_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert supervised_spans(tok, s) == [c + eot for c in ASSISTANT]
    # Exactly one BOS: the template writes it, tokenising must not add another.
    bos = tok.bos_token_id
    assert s.input_ids.count(bos) == (1 if template == "llama3" else 0)
    assert (s.input_ids[0] == bos) == (template == "llama3")
    n_label = sum(lab != -100 for lab in s.labels)
    assert n_label == sum(len(tok(c + eot, add_special_tokens=False)["input_ids"]) for c in ASSISTANT)


def test_train_on_prompt_supervises_everything(tmp_path, tok):
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}])
    (s,) = build_samples(cfg_for(f, train_on_prompt=True), tok)
    assert s.labels == s.input_ids


def test_sharegpt_alpaca_prompt_completion_match_messages(tmp_path, tok):
    def one(records, **kw):
        return build_samples(cfg_for(write_jsonl(tmp_path / "x.jsonl", records), **kw), tok)

    def msgs(*pairs):
        return [{"role": r, "content": c} for r, c in pairs]

    sharegpt = [
        {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
        for m in CONV
    ]
    ref = one([{"messages": CONV}])[0]
    got = one([{"conversations": sharegpt}])[0]
    assert (got.input_ids, got.labels) == (ref.input_ids, ref.labels)

    alpaca = one(
        [
            {
                "instruction": "Answer this.",
                "input": "What is two?",
                "output": "A number.",
                "system": "Be good.",
            },
            {"instruction": "Say hello.", "input": "", "output": "Hello!"},
        ]
    )
    ref = one(
        [
            {
                "messages": msgs(
                    ("system", "Be good."),
                    ("user", "Answer this.\n\nWhat is two?"),
                    ("assistant", "A number."),
                )
            },
            {"messages": msgs(("user", "Say hello."), ("assistant", "Hello!"))},
        ]
    )
    assert [(s.input_ids, s.labels) for s in alpaca] == [(s.input_ids, s.labels) for s in ref]
    assert supervised_spans(tok, alpaca[0]) == ["A number.<|im_end|>"]


@pytest.mark.parametrize("template", [None, "chatml"])
def test_text_prompt_completion_is_plain_text_and_eos_as_trls(tmp_path, template):
    """TRL's SFT of a text prompt-completion record, chat template or not: prompt + completion +
    EOS tokenised together, the loss from where the prompt's own tokens part from it (here " hou"
    and "se" merge into " house": the completion takes the merged token)."""
    tok = tiny_tokenizer(template)
    prompt, completion = "Where is the hou", "se?"
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": completion}])
    (s,) = build_samples(cfg_for(f), tok)
    ids = tok(prompt + completion + "</s>")["input_ids"]
    p = tok(prompt)["input_ids"]
    cut = next(i for i, (a, b) in enumerate(zip(p + [-1], ids)) if a != b)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert s.input_ids == ids
    assert s.labels == [-100] * cut + ids[cut:]
    assert cut < len(p) and tok.decode(ids[cut:]) == " house?</s>"


def test_conversational_prompt_completion_is_trls(tmp_path, tok):
    """TRL's conversational prompt-completion record: the prompt rendered with the generation
    prompt, the whole conversation after it trained on (the end-of-turn token and the newline the
    ChatML template writes after it); earlier assistant turns of the prompt are not."""
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "What is the name?"}]  # fmt: skip
    completion = [{"role": "assistant", "content": "It has none."}]
    f = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": completion}])
    (s,) = build_samples(cfg_for(f), tok)
    full = tok.apply_chat_template(prompt + completion, tokenize=False)
    head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert s.input_ids == tok(full, add_special_tokens=False)["input_ids"]
    assert supervised_spans(tok, s) == [full[len(head) :]] == ["It has none.<|im_end|>\n"]
    (msgs_sample,) = build_samples(
        cfg_for(write_jsonl(tmp_path / "m.jsonl", [{"messages": prompt + completion}])), tok
    )
    assert msgs_sample.input_ids == s.input_ids  # messages: every assistant turn, up to its <|im_end|>
    assert supervised_spans(tok, msgs_sample) == ["Hello.<|im_end|>", "It has none.<|im_end|>"]


def test_template_that_is_not_prefix_stable(tmp_path):
    # The header depends on the whole conversation, so no prefix rendering is a prefix of the
    # full one: the spans must still be found (by locating each assistant content).
    tok = tiny_tokenizer("chatml")
    tok.chat_template = "turns {{ messages | length }}\n" + tok.chat_template
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}])
    (s,) = build_samples(cfg_for(f), tok)
    assert supervised_spans(tok, s) == [c + "<|im_end|>" for c in ASSISTANT]


# ----------------------------------------------------------------------------- files and mixing
def test_mixed_files_json_array_and_parquet(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "the house"}, {"text": "old water"}])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([{"messages": CONV[1:3]}, {"prompt": "Hi", "completion": "Hello"}], indent=2))
    c = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist([{"instruction": "Say yes.", "output": "Yes."}] * 2), c)
    # Each record of a JSON list knows its line: where its "{" is.
    starts = [i for i, line in enumerate(b.read_text().splitlines(), 1) if line == "  {"]
    # b.json mixes formats inside one file: the first record's keys decide, so the second is an error.
    with pytest.raises(DataError, match=rf"{b}:{starts[1]}: missing field 'messages'"):
        build_samples(cfg_for([a, str(b), str(c)]), tok)
    b.write_text(json.dumps([{"messages": CONV[1:3]}, {"messages": CONV[3:5]}], indent=2))
    starts = [i for i, line in enumerate(b.read_text().splitlines(), 1) if line == "  {"]
    samples = build_samples(cfg_for([a, str(b), str(c)]), tok)
    assert [s.source for s in samples] == [
        f"{a}:1",
        f"{a}:2",
        *(f"{b}:{n}" for n in starts),
        f"{c}:1",
        f"{c}:2",
    ]
    assert tok.decode(samples[0].input_ids) == "<s>the house</s>"
    assert supervised_spans(tok, samples[3]) == [CONV[4]["content"] + "<|im_end|>"]
    assert supervised_spans(tok, samples[5]) == ["Yes.<|im_end|>"]


def test_dataset_info_registry(tmp_path, tok):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "alp.jsonl", [{"q": "Say hi.", "ctx": "now", "a": "Hi.", "sys": "Be kind."}])
    openai = [{"role": m["role"], "content": m["content"]} for m in CONV[1:5]]
    write_jsonl(d / "chat.jsonl", [{"dialog": openai}])
    info = {
        "alp": {
            "file_name": "alp.jsonl",
            "columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys"},
        },
        "chat": {
            "file_name": "chat.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "dialog"},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
            },
        },
    }
    (d / "dataset_info.json").write_text(json.dumps(info))

    alp, chat = build_samples(cfg_for(["alp", "chat"], dataset_info=str(d / "dataset_info.json")), tok)
    rendered = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Say hi.\n\nnow"},
            {"role": "assistant", "content": "Hi."},
        ],
        tokenize=False,
    )
    assert alp.input_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert supervised_spans(tok, chat) == [
        CONV[2]["content"] + "<|im_end|>",
        CONV[4]["content"] + "<|im_end|>",
    ]
    # "dir/name" finds the registry beside the name; a directory means all of its datasets.
    (only_chat,) = build_samples(cfg_for(str(d / "chat")), tok)
    assert only_chat.input_ids == chat.input_ids
    both = build_samples(cfg_for(str(d)), tok)
    assert [s.input_ids for s in both] == [alp.input_ids, chat.input_ids]


def test_truncation_split_and_skipping(tmp_path, tok):
    long_text = " ".join(["the house is old"] * 20)
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": long_text}])
    (whole,) = build_samples(cfg_for(f, max_length=1000), tok)
    n = len(whole.input_ids)
    assert n > 40
    (cut,) = build_samples(cfg_for(f, max_length=16), tok)
    assert cut.input_ids == whole.input_ids[:16]
    # With packing, plain text is split into windows instead, as truncation: split does.
    pieces = build_samples(cfg_for(f, max_length=16, packing=True), tok)
    split = build_samples(cfg_for(f, max_length=16, truncation="split"), tok)
    assert len(pieces) > 2 and [(p.input_ids, p.labels) for p in pieces] == [
        (p.input_ids, p.labels) for p in split
    ]

    # The prompt alone fills max_length for the first conversation: skipped with a warning.
    long_prompt = [{"role": "user", "content": long_text}, {"role": "assistant", "content": "Yes."}]
    g = write_jsonl(tmp_path / "m.jsonl", [{"messages": long_prompt}, {"messages": CONV[1:3]}])
    said = []
    samples = build_samples(cfg_for(g, max_length=40), tok, warn=said.append)
    assert [s.source for s in samples] == [f"{g}:2"]
    assert said == [
        f"megatrain: warning: dropped 1 of 2 rows of {g}: no assistant tokens after truncation to max_length=40 "
        f"(first: {g}:1)"
    ]


def _targets(samples: list[Sample], starts: list[int]) -> list[tuple[int, int]]:
    """(position in the whole sample, label) of every target of windows starting at `starts`."""
    return [
        (a + t, lab)
        for a, w in zip(starts, samples)
        for t, lab in enumerate(w.labels)
        if t > 0 and lab != -100
    ]


@pytest.mark.parametrize("m", [12, 16, 30])  # 12: the last window ends exactly at the sample's end
def test_split_windows_make_every_target_once(tmp_path, tok, m):
    """truncation: split: windows of max_length tokens overlapping by one; every token but the
    first is a target exactly once, with its own label, the first of a continuation included."""
    text = " ".join(["the house is old and the water is big"] * 12)
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": text}])
    (whole,) = build_samples(cfg_for(f, max_length=10_000), tok)
    n = len(whole.input_ids)
    windows = build_samples(cfg_for(f, max_length=m, truncation="split"), tok)
    starts = [k * (m - 1) for k in range(len(windows))]
    assert n > 3 * m and all(len(w.input_ids) <= m for w in windows)
    assert [w.input_ids for w in windows] == [whole.input_ids[a : a + m] for a in starts]
    assert starts[-1] + len(windows[-1].input_ids) == n  # the last window ends the sample
    assert _targets(windows, starts) == [(t, whole.input_ids[t]) for t in range(1, n)]
    # Packed, each window is a document: packing masks its first label, which is context only.
    rows = Batcher(windows, batch_size=1, grad_accum=1, max_length=m, packing=True, shuffle=False)
    labelled = sum(mb.num_label_tokens for step in rows.epoch_steps() for mb in step)
    assert labelled == n - 1


def test_split_windows_keep_chat_prompts_masked(tmp_path, tok):
    """A conversation split mid-way: the targets are exactly the whole conversation's (assistant
    turns), each once; prompt tokens stay unlabelled in every window."""
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}])
    (whole,) = build_samples(cfg_for(f, max_length=10_000), tok)
    m = 12
    every = split_windows(whole, m)
    starts = [k * (m - 1) for k in range(len(every))]
    assert len(every) > 4
    assert _targets(every, starts) == [
        (t, lab) for t, lab in enumerate(whole.labels) if t > 0 and lab != -100
    ]
    # build_samples gives the same windows, less those holding only prompt tokens (no target).
    windows = build_samples(cfg_for(f, max_length=m, truncation="split"), tok)
    assert [w.input_ids for w in windows] == [w.input_ids for w in every if w.has_labels]
    assert len(windows) < len(every)


def test_load_tokenizer_directory_and_file(tmp_path, tok):
    tok.save_pretrained(tmp_path / "tk")
    for path in (tmp_path / "tk", tmp_path / "tk" / "tokenizer.json"):
        loaded = load_tokenizer(path)
        assert loaded.is_fast
        assert loaded("the house")["input_ids"] == tok("the house")["input_ids"]
        assert loaded.chat_template == tok.chat_template
        assert (loaded.eos_token, loaded.pad_token_id) == ("</s>", tok.pad_token_id)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "my.json").write_text(tok.backend_tokenizer.to_str())
    bare = load_tokenizer(tmp_path / "bare" / "my.json")
    assert (
        bare("the house", add_special_tokens=False)["input_ids"]
        == tok("the house", add_special_tokens=False)["input_ids"]
    )


# ----------------------------------------------------------------------------- batching
def _samples(lengths, seed=0):
    """Random samples whose first token (k + 3) identifies them; a third of each is prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(lengths):
        ids = [k + 3] + torch.randint(3, 97, (n - 1,), generator=g).tolist()
        labels = [-100] * (n // 3) + ids[n // 3 :]
        out.append(Sample(ids, labels, f"mem:{k + 1}"))
    return out


def test_batcher_padding_and_epoch_coverage():
    samples = _samples([5, 9, 3, 12, 7, 4, 8, 6, 10, 11, 2, 13])
    b = Batcher(
        samples, batch_size=2, grad_accum=3, max_length=10, packing=False, shuffle=True, seed=1, pad_id=0
    )
    assert b.steps_per_epoch == 2
    seen = []
    for _ in range(2):
        mbs = b.next_step()
        assert len(mbs) == 3
        for mb in mbs:
            assert mb.input_ids.dtype == mb.labels.dtype == torch.int64
            assert mb.position_ids is None and mb.document_ids is None
            rows = [samples[r[0] - 3] for r in mb.input_ids.tolist()]
            width = max(min(len(s.input_ids), 10) for s in rows)
            assert mb.input_ids.shape == (2, width)  # padded to the longest, truncated to max_length
            for s, ids, lab in zip(rows, mb.input_ids.tolist(), mb.labels.tolist()):
                n = min(len(s.input_ids), 10)
                assert ids == s.input_ids[:n] + [0] * (width - n)
                assert lab == s.labels[:n] + [-100] * (width - n)  # pads never labelled
            seen += [r[0] - 3 for r in mb.input_ids.tolist()]
    assert sorted(seen) == list(range(12))  # every sample exactly once per epoch
    assert b.epoch == 1.0


def test_batcher_no_shuffle_follows_file_order():
    samples = _samples([4, 6, 5, 3, 7, 2, 8])
    b = Batcher(samples, batch_size=2, grad_accum=1, max_length=16, shuffle=False, seed=0, pad_id=0)
    assert b.steps_per_epoch == 3
    firsts = [b.next_step()[0].input_ids[:, :2].tolist() for _ in range(4)]
    expect = [[s.input_ids[:2] for s in samples[i : i + 2]] for i in (0, 2, 4, 0)]
    assert firsts == expect


def test_batcher_buckets_similar_lengths():
    lengths = [int(x) for x in torch.randint(4, 200, (800,), generator=torch.Generator().manual_seed(0))]
    samples = _samples(lengths)
    b = Batcher(samples, batch_size=8, grad_accum=1, max_length=256, seed=3, pad_id=0)
    pads = real = 0
    widths = []
    for _ in range(b.steps_per_epoch):
        (mb,) = b.next_step()
        real += int((mb.input_ids != 0).sum())
        pads += mb.num_tokens
        widths.append(mb.input_ids.shape[1])
    assert real / pads > 0.95  # random batches of 8 would waste ~30%
    assert len(set(widths)) > 20  # micro-batch order is shuffled, not one long sorted run
    assert widths != sorted(widths)


def test_batcher_determinism_and_exact_resume():
    samples = _samples([3 + (k * 7) % 11 for k in range(30)])
    kw = dict(batch_size=2, grad_accum=2, max_length=12, seed=5, pad_id=0)

    def run(b, n):
        return [[(mb.input_ids.tolist(), mb.labels.tolist()) for mb in b.next_step()] for _ in range(n)]

    for packing in (False, True):
        full = run(Batcher(samples, packing=packing, **kw), 25)  # several epochs
        assert full == run(Batcher(samples, packing=packing, **kw), 25)
        other = run(Batcher(samples, packing=packing, **{**kw, "seed": 6}), 25)
        assert other != full
        spe = Batcher(samples, packing=packing, **kw).steps_per_epoch
        assert full[:spe] != full[spe : 2 * spe]  # each epoch has its own order
        for cut in (1, spe, spe + 2, 11):
            first = Batcher(samples, packing=packing, **kw)
            head = run(first, cut)
            state = json.loads(json.dumps(first.state_dict()))
            resumed = Batcher(samples, packing=packing, **kw)
            resumed.load_state_dict(state)
            assert resumed.epoch == pytest.approx(cut / spe)
            assert head + run(resumed, 25 - cut) == full


def test_packing_layout():
    samples = _samples([5, 9, 3, 12, 7, 4, 8, 6])
    b = Batcher(samples, batch_size=1, grad_accum=1, max_length=16, packing=True, seed=0, pad_id=0)
    by_ids = {tuple(s.input_ids[:16]): s for s in samples}
    seen = []
    for _ in range(b.steps_per_epoch):
        (mb,) = b.next_step()
        assert mb.input_ids.shape == (1, 16)
        ids, lab, pos, doc = (
            t[0].tolist() for t in (mb.input_ids, mb.labels, mb.position_ids, mb.document_ids)
        )
        segments = []
        for t in range(16):
            if t == 0 or doc[t] != doc[t - 1]:
                segments.append([t, t])
                assert pos[t] == 0
            else:
                assert pos[t] == pos[t - 1] + 1
            segments[-1][1] = t + 1
        assert len({doc[a] for a, _ in segments}) == len(segments)
        for a, e in segments:
            key = tuple(ids[a:e])
            if key in by_ids:
                s = by_ids[key]
                assert lab[a] == -100 and lab[a + 1 : e] == s.labels[1 : e - a]
                seen.append(key)
            else:  # the padded tail: last, all pad, no labels
                assert [a, e] == segments[-1] and set(key) == {0} and set(lab[a:e]) == {-100}
    assert sorted(seen) == sorted(by_ids)  # each sample once, none split


def test_micro_batches_count_their_samples():
    """A micro-batch says how many samples it holds: one per row, or with packing each
    document of a row (a padded tail is no document). The metrics' `samples` per step."""
    lengths = [5, 9, 3, 12, 7, 4, 8, 6]
    samples = _samples(lengths)
    kw = dict(batch_size=2, grad_accum=1, max_length=16, seed=0, pad_id=0)
    plain = Batcher(samples, packing=False, **kw)
    assert [mb.num_samples for _ in range(4) for mb in plain.next_step()] == [2, 2, 2, 2]
    packed = Batcher(samples, packing=True, **kw)
    assert sum(lengths) < packed.steps_per_epoch * 2 * 16  # some rows end in padding
    counts = []
    for _ in range(packed.steps_per_epoch):
        (mb,) = packed.next_step()
        assert mb.attention_mask is not None
        docs = [len(set(d[m.bool()].tolist())) for d, m in zip(mb.document_ids, mb.attention_mask)]
        counts.append((mb.num_samples, sum(docs)))
    assert all(a == b for a, b in counts) and sum(a for a, _ in counts) == len(samples)


def test_pack_rows_first_fit_and_next_fit():
    lengths = [6, 8, 4, 2, 10]
    # First fit: 4 fills the gap after 6, 2 the gap after 8.
    assert pack_rows(list(range(5)), lengths, 10, open_rows=16) == [[0, 2], [1, 3], [4]]
    # Next fit keeps the order: a row closes as soon as a sample does not fit.
    assert pack_rows(list(range(5)), lengths, 10, open_rows=1) == [[0], [1], [2, 3], [4]]


def test_packed_logits_match_documents_one_by_one(tmp_path):
    """Packing must be invisible to the model: each document's logits in a packed row equal
    its logits when run alone, and no label crosses a document boundary."""
    tok = tiny_tokenizer("chatml")
    f = write_jsonl(
        tmp_path / "m.jsonl",
        [{"messages": CONV[1:3]}, {"messages": CONV[3:5]}, {"messages": CONV[5:7]}, {"messages": CONV[1:5]}],
    )
    # Text documents are labelled from their first token on: packing must unlabel it.
    g = write_jsonl(tmp_path / "t.jsonl", [{"text": "the old house and the water"}, {"text": "hello world"}])
    samples = build_samples(cfg_for([f, g]), tok)
    hf = tiny_hf_model("llama", vocab_size=len(tok))
    hf.save_pretrained(tmp_path / "hf")
    model = build_model(ModelConfig.from_json(tmp_path / "hf"), weights=tmp_path / "hf", device="cpu")

    max_length = max(len(s.input_ids) for s in samples)  # the longest fills a row exactly
    b = Batcher(
        samples,
        batch_size=1,
        grad_accum=1,
        max_length=max_length,
        packing=True,
        shuffle=True,
        seed=0,
        pad_id=0,
    )
    checked = multi_doc_rows = 0
    for _ in range(b.steps_per_epoch):
        (mb,) = b.next_step()
        logits = model.engine.logits(mb)
        for r in range(mb.input_ids.shape[0]):
            doc = mb.document_ids[r]
            for d in doc.unique().tolist():
                (where,) = torch.nonzero(doc == d, as_tuple=True)
                a, e = int(where[0]), int(where[-1]) + 1
                ids = mb.input_ids[r, a:e]
                match = [s for s in samples if s.input_ids == ids.tolist()]
                if not match:  # the padded tail
                    continue
                alone = MicroBatch(ids[None], torch.tensor([match[0].labels]))
                torch.testing.assert_close(
                    logits[r, a:e], model.engine.logits(alone)[0], atol=1e-5, rtol=1e-5
                )
                # Targets inside a packed document are exactly those of the document alone.
                assert mb.shifted_labels[r, a:e].tolist() == alone.shifted_labels[0].tolist()
                checked += 1
            multi_doc_rows += int(doc.max()) >= 2  # two documents (0, 1) and more, or padding
    assert checked == len(samples)
    assert multi_doc_rows >= 2


def test_metrics_record_rows_and_samples_per_step(tmp_path):
    """Each step's record says what its tokens were: rows of max_length and the samples in them,
    so a packed run shows its documents per row (unpacked: one sample per row)."""
    from test_checkpoint import make_run, metrics

    from megatrain.trainer import train

    base = make_run(tmp_path)  # 48 samples of 6-30 tokens, 2 rows x 2 micro-batches of 32 tokens
    for packing in (False, True):
        out = tmp_path / f"packing-{packing}"
        cfg = TrainConfig(**base, packing=packing, max_steps=3, save_strategy="no", output_dir=str(out))
        train(cfg)
        recs = metrics(out)
        assert [r["rows"] for r in recs] == [4, 4, 4]
        # The same steps the run took, from a Batcher of the same samples and settings.
        b = Batcher(build_samples(cfg, None, 97), 2, 2, 32, packing=packing, seed=cfg.seed)
        want = [sum(mb.num_samples for mb in b.next_step()) for _ in range(3)]
        assert [r["samples"] for r in recs] == want
        if packing:
            assert all(r["samples"] > r["rows"] for r in recs)  # several documents per row
        else:
            assert want == [4, 4, 4]
