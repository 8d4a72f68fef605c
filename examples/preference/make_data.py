#!/usr/bin/env python3
"""Generate examples/preference/data.jsonl, preference pairs for the quickstart's story model.

    python examples/preference/make_data.py            # (re)write data.jsonl
    python examples/preference/make_data.py --check    # compare the committed file with a fresh one

Each pair takes the opening sentences of one of the quickstart's held-out stories
(examples/data/stories_eval.jsonl) as the prompt; the chosen completion is the story's next
sentence, the rejected one the same words in a shuffled order. A model that has learnt the
stories' grammar prefers the chosen sentence, so preference training raises its reward accuracy
quickly. Three pairs per story, cut after different sentences; everything follows from SEED.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STORIES = HERE.parent / "data" / "stories_eval.jsonl"
OUT = HERE / "data.jsonl"
SEED = 2468
PAIRS_PER_STORY = 3
MIN_WORDS = 4  # a shorter sentence has too few orders to make a clearly wrong one
# A sentence ends at . ! or ? (and a closing quote after it) followed by whitespace.
SENTENCE_END = re.compile(r'(?<=[.!?])"?\s+')


def sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the sentences of a story."""
    spans, start = [], 0
    for m in SENTENCE_END.finditer(text):
        end = m.start() + (1 if text[m.start()] == '"' else 0)
        spans.append((start, end))
        start = m.end()
    spans.append((start, len(text)))
    return spans


def shuffled(sentence: str, rng: random.Random) -> str:
    """The sentence's words in another order, its final punctuation kept last."""
    words, stop = sentence[:-1].split(), sentence[-1]
    order = words[:]
    while order == words:
        rng.shuffle(order)
    return " ".join(order) + stop


def pairs_of(text: str, rng: random.Random) -> list[dict]:
    """Up to PAIRS_PER_STORY pairs cut after different sentences of one story."""
    spans = sentences(text)
    # A continuation without quotes, after a prompt of at least two sentences with balanced quotes.
    cuts = [
        k
        for k in range(2, len(spans))
        if '"' not in text[slice(*spans[k])]
        and len(text[slice(*spans[k])].split()) >= MIN_WORDS
        and text[: spans[k][0]].count('"') % 2 == 0
    ]
    out = []
    for k in sorted(rng.sample(cuts, min(PAIRS_PER_STORY, len(cuts)))):
        prompt_end, (start, end) = spans[k - 1][1], spans[k]
        gap, sentence = text[prompt_end:start], text[start:end]
        out.append(
            {"prompt": text[:prompt_end], "chosen": gap + sentence, "rejected": gap + shuffled(sentence, rng)}
        )
    return out


def make_pairs() -> list[dict]:
    """All pairs, in story order."""
    rng = random.Random(SEED)
    stories = [json.loads(line)["text"] for line in STORIES.read_text().splitlines() if line.strip()]
    return [pair for story in stories for pair in pairs_of(story, rng)]


def render(pairs: list[dict]) -> str:
    """The JSONL text of the pairs."""
    return "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the committed file, write nothing")
    args = parser.parse_args()
    text = render(make_pairs())
    if args.check:
        same = OUT.is_file() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'differs from the generator'}")
        return 0 if same else 1
    tmp = OUT.with_name(OUT.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(OUT)  # atomic: a reader never sees half a file
    print(f"wrote {OUT} ({text.count(chr(10))} pairs, {len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
