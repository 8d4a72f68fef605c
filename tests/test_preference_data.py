"""Preference data: TRL's formats to prompt + completion token ids with the completion masked in,
length limits with TRL's semantics, KTO's unpaired examples and KL pairs, and one-line errors
naming file:line and field."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.config import TrainConfig
from megatrain.data import load_tokenizer
from megatrain.data.preference import (
    CompletionTokens,
    Limits,
    build_preference_pairs,
    build_unpaired_examples,
)
from megatrain.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "preference"
NO_LIMIT = Limits(None)
USER = {"role": "user", "content": "Where does Pip live?"}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ROOT / "examples" / "tokenizer")


def jsonl(tmp_path, *lines: object, name="d.jsonl") -> Path:
    """A JSONL file; str lines are written verbatim, anything else as JSON."""
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def raises(exc, path, line, what):
    """pytest.raises for a one-line message starting `path:line: ` and containing `what`."""
    return pytest.raises(exc, match=rf"^{re.escape(f'{path}:{line}')}: [^\n]*{re.escape(what)}[^\n]*$")


def split(tok, seq: CompletionTokens) -> tuple[str, str]:
    return tok.decode(seq.input_ids[: seq.prompt_length]), tok.decode(seq.input_ids[seq.prompt_length :])


# ------------------------------------------------------------------------ formats
def test_standard_pair(tok, tmp_path):
    path = jsonl(tmp_path, {"prompt": "Pip the rabbit", "chosen": " ran home.", "rejected": " home ran."})
    (pair,) = build_preference_pairs([path], tok, NO_LIMIT)
    prompt = tok("Pip the rabbit")["input_ids"]  # with the BOS the tokenizer adds
    assert prompt[0] == tok.bos_token_id
    chosen = tok(" ran home.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert pair.chosen == CompletionTokens(prompt + chosen, len(prompt))
    assert pair.rejected.input_ids[: len(prompt)] == prompt
    assert split(tok, pair.rejected) == ("<s>Pip the rabbit", " home ran.</s>")
    assert pair.chosen.labels == [-100] * len(prompt) + chosen
    assert pair.chosen.completion_mask == [False] * len(prompt) + [True] * len(chosen)
    assert pair.source == f"{path}:1"


def test_conversational_pair_uses_the_chat_template(tok, tmp_path):
    path = jsonl(
        tmp_path,
        {
            "prompt": [USER],
            "chosen": [{"role": "assistant", "content": "In the Green Forest."}],
            "rejected": [{"role": "assistant", "content": "On the moon."}],
        },
    )
    (pair,) = build_preference_pairs([path], tok, NO_LIMIT)
    rendered = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True)
    # The template's own end-of-turn closes the completion: no EOS is added, no second BOS.
    assert split(tok, pair.chosen) == (rendered, "In the Green Forest.<|im_end|>\n")
    assert split(tok, pair.rejected) == (rendered, "On the moon.<|im_end|>\n")
    assert (
        pair.chosen.input_ids.count(tok.bos_token_id) == 1 and tok.eos_token_id not in pair.chosen.input_ids
    )


def test_implicit_prompt_of_messages_is_the_shared_prefix(tok, tmp_path):
    system = {"role": "system", "content": "Be kind."}
    path = jsonl(
        tmp_path,
        {
            "chosen": [system, USER, {"role": "assistant", "content": "In the forest."}],
            "rejected": [system, USER, {"role": "assistant", "content": "Nowhere."}],
        },
    )
    (pair,) = build_preference_pairs([path], tok, NO_LIMIT)
    rendered = tok.apply_chat_template([system, USER], tokenize=False, add_generation_prompt=True)
    assert split(tok, pair.chosen) == (rendered, "In the forest.<|im_end|>\n")
    assert split(tok, pair.rejected) == (rendered, "Nowhere.<|im_end|>\n")


def test_implicit_prompt_of_strings_keeps_the_space_with_the_completions(tok, tmp_path):
    # TRL's extract_prompt: the shared characters, less a space right before the first difference.
    path = jsonl(tmp_path, {"chosen": "The cat sat. It purred.", "rejected": "The cat sat. purred It."})
    (pair,) = build_preference_pairs([path], tok, NO_LIMIT)
    assert split(tok, pair.chosen) == ("<s>The cat sat.", " It purred.</s>")
    assert split(tok, pair.rejected) == ("<s>The cat sat.", " purred It.</s>")


def test_a_string_prompt_beside_conversations_is_ignored_as_in_trl(tok, tmp_path):
    path = jsonl(
        tmp_path,
        {
            "prompt": "Where does Pip live?",
            "chosen": [USER, {"role": "assistant", "content": "In the forest."}],
            "rejected": [USER, {"role": "assistant", "content": "Nowhere."}],
        },
    )
    (pair,) = build_preference_pairs([path], tok, NO_LIMIT)
    assert split(tok, pair.chosen)[0] == tok.apply_chat_template(
        [USER], tokenize=False, add_generation_prompt=True
    )


def test_pretokenised_pairs_need_no_tokenizer(tmp_path):
    rec = {"prompt_input_ids": [5, 6, 7], "chosen_input_ids": [8, 9], "rejected_input_ids": [10]}
    (pair,) = build_preference_pairs([jsonl(tmp_path, rec)], None, NO_LIMIT)
    assert pair.chosen == CompletionTokens([5, 6, 7, 8, 9], 3)  # ids as given: no EOS added
    assert pair.rejected == CompletionTokens([5, 6, 7, 10], 3)


def test_files_are_read_in_order_and_json_lists_too(tok, tmp_path):
    a = jsonl(tmp_path, {"prompt": "A", "chosen": " b", "rejected": " c"}, name="a.jsonl")
    b = tmp_path / "b.json"
    rec = json.dumps({"prompt": "D", "chosen": " e", "rejected": " f"})
    b.write_text(f"[\n{rec},\n\n{rec}\n]\n")
    pairs = build_preference_pairs([a, b], tok, NO_LIMIT)
    assert [p.source for p in pairs] == [f"{a}:1", f"{b}:2", f"{b}:4"]


# ------------------------------------------------------------------------ KTO
def test_unpaired_examples_and_their_kl_pairs(tok, tmp_path):
    rows = [{"prompt": f"P{i}", "completion": f" c{i}", "label": i % 2 == 0} for i in range(5)]
    examples = build_unpaired_examples([jsonl(tmp_path, *rows)], tok, NO_LIMIT, kl_batch_size=2)
    assert [e.label for e in examples] == [True, False, True, False, True]
    assert [split(tok, e.sequence) for e in examples][1] == ("<s>P1", " c1</s>")
    # Blocks of 2: each prompt with the block's previous completion (the first with its last);
    # the last block has one example, which gets its own completion, as in TRL.
    kl = [tok.decode(e.kl.input_ids) for e in examples]
    assert kl == ["<s>P0 c1</s>", "<s>P1 c0</s>", "<s>P2 c3</s>", "<s>P3 c2</s>", "<s>P4 c4</s>"]
    assert all(e.kl.prompt_length == e.sequence.prompt_length for e in examples)


def test_paired_data_is_unpaired_chosen_first(tok, tmp_path):
    rows = [{"prompt": f"P{i}", "chosen": f" good{i}", "rejected": f" bad{i}"} for i in range(2)]
    examples = build_unpaired_examples([jsonl(tmp_path, *rows)], tok, NO_LIMIT, kl_batch_size=None)
    assert [(tok.decode(e.sequence.input_ids), e.label) for e in examples] == [
        ("<s>P0 good0</s>", True),
        ("<s>P1 good1</s>", True),
        ("<s>P0 bad0</s>", False),
        ("<s>P1 bad1</s>", False),
    ]
    assert all(e.kl is None for e in examples)


def test_pretokenised_unpaired(tmp_path):
    rec = {"prompt_input_ids": [3, 4], "completion_input_ids": [5], "label": False}
    (ex,) = build_unpaired_examples([jsonl(tmp_path, rec)], None, NO_LIMIT, kl_batch_size=None)
    assert (ex.sequence, ex.label) == (CompletionTokens([3, 4, 5], 2), False)


def test_kto_needs_two_examples_per_batch(tok, tmp_path):
    path = jsonl(tmp_path, {"prompt": "P", "completion": " c", "label": True})
    with pytest.raises(ConfigError, match=r"^per_device_train_batch_size: KTO needs at least 2"):
        build_unpaired_examples([path], tok, NO_LIMIT, kl_batch_size=1)


# ------------------------------------------------------------------------ length limits
PROMPT, COMPLETION = [1, 2, 3, 4, 5], [6, 7, 8]


@pytest.mark.parametrize(
    "limits, expected",
    [
        (Limits(6, truncation_mode="keep_start"), CompletionTokens([1, 2, 3, 4, 5, 6], 5)),
        (Limits(6, truncation_mode="keep_end"), CompletionTokens([3, 4, 5, 6, 7, 8], 3)),
        (Limits(2, truncation_mode="keep_end"), CompletionTokens([7, 8], 0)),  # into the completion
        (Limits(4), CompletionTokens([1, 2, 3, 4], 4)),  # keep_start by default: the completion gone
        (Limits(8), CompletionTokens(PROMPT + COMPLETION, 5)),  # within the limit
    ],
)
def test_limits_follow_trl(limits, expected):
    assert limits.cut(PROMPT, COMPLETION) == expected


def test_keep_end_cut_into_the_completion_leaves_its_first_token_unpredicted():
    seq = Limits(2, truncation_mode="keep_end").cut(PROMPT, COMPLETION)
    assert (seq.n_targets, seq.labels) == (1, [7, 8])  # labels[0] is never a target


def test_pairs_left_without_a_completion_are_skipped(tok, tmp_path, caplog):
    long = "Once upon a time there was a rabbit who lived in the forest"
    path = jsonl(
        tmp_path,
        {"prompt": "Hi", "chosen": " a", "rejected": " b"},
        {"prompt": long, "chosen": " a", "rejected": " b"},
    )
    limits = Limits(6, "keep_start")
    with caplog.at_level(logging.WARNING):
        pairs = build_preference_pairs([path], tok, limits)
    assert [p.source for p in pairs] == [f"{path}:1"]
    assert f"skipped 1 pairs that keep no completion token (first: {path}:2)" in caplog.text
    only_long = jsonl(tmp_path, {"prompt": long, "chosen": " a", "rejected": " b"}, name="long.jsonl")
    with pytest.raises(
        DataError, match=r"^no trainable pairs: all 1 keep no completion token .*max_length 6"
    ):
        build_preference_pairs([only_long], tok, limits)


@pytest.mark.parametrize(
    "kw, key",
    [(dict(max_length=0), "max_length"), (dict(max_length=2.5), "max_length"),
     (dict(truncation_mode="left"), "truncation_mode")],
)  # fmt: skip
def test_bad_limits_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        Limits(**({"max_length": 8} | kw))


@pytest.mark.parametrize(
    "stage, mode, rule", [("dpo", "keep_start", "joint"), ("kto", "keep_start", "joint"),
                          ("orpo", "keep_start", "answer"), ("simpo", "keep_start", "answer")],
)  # fmt: skip
def test_each_stage_tokenises_and_cuts_as_its_trl_trainer(stage, mode, rule):
    """dpo and kto: TRL 1.16's joint tokenisation; orpo and simpo: TRL 1.16's ORPO and CPO
    trainers' tokenize_row; all four keep_start by default, max_length the one bound (rm's pairs:
    build_reward_pairs, tests/test_reward.py)."""
    limits = TrainConfig(model_config="unused", stage=stage).preference().limits(64)
    assert (limits.max_length, limits.truncation_mode, limits.rule) == (64, mode, rule)


@pytest.mark.parametrize(
    "stage, kw, what",
    [("dpo", dict(max_prompt_length=192), "max_prompt_length: not in stage dpo: TRL 1.x's DPOTrainer and KTOTrainer "
      "have none: prompt + completion are tokenised together and bounded by max_length alone"),
     ("kto", dict(max_completion_length=64), "max_completion_length: not in stage kto: TRL 1.x's"),
     ("dpo", dict(max_prompt_length=None), "max_prompt_length: not in stage dpo"),
     ("kto", dict(truncation_mode="keep_end"), "truncation_mode: TRL 1.x's KTOTrainer has none: a sequence keeps "
      "its first max_length tokens"),
     ("orpo", dict(max_prompt_length=192), "max_prompt_length: not in stage orpo: TRL 1.16's ORPOTrainer and "
      "CPOTrainer have none for a causal LM: prompt + completion are bounded by max_length alone"),
     ("simpo", dict(max_completion_length=64), "max_completion_length: not in stage simpo: TRL 1.16's ORPOTrainer"),
     ("simpo", dict(truncation_mode="keep_end"), "truncation_mode: TRL 1.x's CPOTrainer has none"),
     ("orpo", dict(truncation_mode="keep_end"), "truncation_mode: TRL 1.x's ORPOTrainer has none")],
)  # fmt: skip
def test_keys_trl1_dropped_from_its_preference_trainers_are_refused_in_one_line(stage, kw, what):
    with pytest.raises(ConfigError, match=rf"^{re.escape(what)}[^\n]*$"):
        TrainConfig(model_config="unused", stage=stage, **kw)
    assert (
        TrainConfig(
            model_config="unused", stage="grpo", per_device_train_batch_size=8, max_prompt_length=192
        ).max_prompt_length
        == 192
    )


# ------------------------------------------------------------------------ errors
ASSISTANT = {"role": "assistant", "content": "Hello"}


@pytest.mark.parametrize(
    "record, what",
    [
        ({"prompt": "P", "chosen": " a"}, "cannot detect the preference format"),
        ({"prompt": "P", "chosen": " a", "rejectd": " b"}, "missing field 'rejected'"),
        ({"prompt": "P", "chosen": " a", "rejected": None}, "field 'rejected' is null"),
        ({"prompt": "P", "chosen": " a", "rejected": 3}, "field 'rejected' must be a string or a non-empty list"),
        ({"prompt": 7, "chosen": " a", "rejected": " b"}, "field 'prompt' must be a string"),
        ({"prompt": "P", "chosen": " a", "rejected": [ASSISTANT]}, "'chosen' and 'rejected' must both be strings"),
        ({"prompt": [USER], "chosen": [{"role": "bot", "content": "x"}], "rejected": [ASSISTANT]}, "unknown role 'bot'"),
        ({"prompt": [USER], "chosen": [{"role": "assistant"}], "rejected": [ASSISTANT]}, "message 0 of 'chosen'"),
        ({"prompt": [ASSISTANT], "chosen": [ASSISTANT], "rejected": [ASSISTANT]}, "it must be a user or tool turn"),
        ({"chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are identical"),
        ({"chosen": [USER, ASSISTANT], "rejected": [USER, ASSISTANT]}, "no completion after their shared messages"),
        ({"chosen": [ASSISTANT], "rejected": [USER]}, "have no leading message"),
        ({"prompt_input_ids": [1], "chosen_input_ids": [], "rejected_input_ids": [2]}, "'chosen_input_ids' is empty"),
        ({"prompt_input_ids": [1], "chosen_input_ids": [9999], "rejected_input_ids": [2]}, "token id 9999"),
        ({"prompt_input_ids": [1], "chosen_input_ids": ["a"], "rejected_input_ids": [2]}, "list of integers"),
    ],
)  # fmt: skip
def test_bad_pairs_name_file_line_and_field(tok, tmp_path, record, what):
    good = {"prompt": "P", "chosen": " a", "rejected": " b"}
    if "prompt_input_ids" in record:
        good = {"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}
    path = jsonl(tmp_path, good, record) if "cannot detect" not in what else jsonl(tmp_path, record)
    line = 1 if "cannot detect" in what else 2
    with raises(DataError, path, line, what):
        build_preference_pairs([path], tok, NO_LIMIT)


@pytest.mark.parametrize(
    "record, what",
    [
        ({"prompt": "P", "completion": " a", "label": 1}, "field 'label' must be true or false"),
        (
            {"prompt": [USER], "completion": " a", "label": True},
            "'prompt' and 'completion' must both be strings",
        ),
        ({"prompt": "P", "completion": None, "label": True}, "field 'completion' is null"),
        ({"prompt": "P", "completion": " a", "label": None}, "field 'label' must be true or false"),
    ],
)
def test_bad_unpaired_examples_name_file_line_and_field(tok, tmp_path, record, what):
    path = jsonl(tmp_path, {"prompt": "P", "completion": " c", "label": True}, record)
    with raises(DataError, path, 2, what):
        build_unpaired_examples([path], tok, NO_LIMIT, kl_batch_size=None)


def test_paired_stages_refuse_unpaired_files(tok, tmp_path):
    path = jsonl(tmp_path, {"prompt": "P", "completion": " c", "label": True})
    with raises(DataError, path, 1, "unpaired (KTO) preference data; this stage needs chosen and rejected"):
        build_preference_pairs([path], tok, NO_LIMIT)


def test_text_needs_a_tokenizer_and_chats_a_template(tok, tmp_path):
    path = jsonl(tmp_path, {"prompt": "P", "chosen": " a", "rejected": " b"})
    with raises(ConfigError, path, 1, "needs a tokenizer (set tokenizer_name_or_path)"):
        build_preference_pairs([path], None, NO_LIMIT)
    chat = jsonl(tmp_path, {"prompt": [USER], "chosen": [ASSISTANT], "rejected": [ASSISTANT]}, name="c.jsonl")
    bare = tmp_path / "bare" / "tokenizer.json"  # without its tokenizer_config.json: no chat template
    bare.parent.mkdir()
    bare.write_bytes((ROOT / "examples" / "tokenizer" / "tokenizer.json").read_bytes())
    plain = load_tokenizer(bare)
    with pytest.raises(ConfigError, match=rf"has no chat template; {re.escape(str(chat))}:1 is chat data"):
        build_preference_pairs([chat], plain, NO_LIMIT)


def test_token_ids_beyond_the_models_vocabulary_are_refused(tok, tmp_path):
    path = jsonl(tmp_path, {"prompt": "P", "chosen": " a", "rejected": " b"})
    with raises(DataError, path, 1, "outside the model's vocabulary [0, 10)"):
        build_preference_pairs([path], tok, NO_LIMIT, vocab_size=10)


# ------------------------------------------------------------------------ the example dataset
def test_example_dataset_is_what_its_script_makes_and_fits_the_quickstart(tok):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "make_data.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data = EXAMPLE / "data.jsonl"
    assert data.stat().st_size < 300_000
    pairs = build_preference_pairs([data], tok, Limits(256, "keep_end"))
    assert len(pairs) == len(data.read_text().splitlines()) >= 200  # none skipped
    for p in pairs:
        assert max(len(p.chosen.input_ids), len(p.rejected.input_ids)) <= 256
        prompt, chosen = split(tok, p.chosen)
        assert split(tok, p.rejected)[0] == prompt
        rejected = split(tok, p.rejected)[1]
        # the same characters in another order: the rejected sentence is the chosen one shuffled
        assert rejected != chosen and sorted(rejected.replace(" ", "")) == sorted(chosen.replace(" ", ""))
