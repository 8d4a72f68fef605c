"""A reward function for examples/grpo.yaml, with TRL's signature: keyword arguments `prompts`,
`completions`, `completion_ids` and the dataset's other columns (here `chosen` and `rejected`),
one float per completion (or None to skip one)."""

import re

WORD = re.compile(r"[A-Za-z']+")


def short_sentence(completions, **_):
    """1.0 where the completion finishes a sentence of at most eight words, else 0.0."""
    out = []
    for completion in completions:
        m = re.search(r"[.!?]", completion)
        out.append(float(m is not None and len(WORD.findall(completion[: m.start()])) <= 8))
    return out
