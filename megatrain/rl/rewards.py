"""Reward functions for `stage: grpo`: `reward_funcs: [module:function, ...]` or the built-ins
below, each called as TRL calls one: keyword arguments `prompts`, `completions` (strings, or for a
conversational dataset lists of one assistant message), `completion_ids` and every other column
of the dataset (a list per column), returning one float per completion, or None to leave that
completion out of this function's reward. A function that raises, or returns the wrong number of
values or a non-number, stops the run with one line naming it and the first sample at fault.

Built in:
- `exact_match`: 1.0 where the completion, stripped, equals the `answer` (or `solution`) column,
  stripped; else 0.0.
- `format`: 1.0 where the completion is `<think>...</think>` then `<answer>...</answer>`.
- `length`: the completion's length in characters (weight it with `reward_weights`).
A prompt whose record lacks the column a built-in reads is refused before step one.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..data.prompts import Prompt
from ..errors import ConfigError, DataError, MegatrainError, first_line


class RewardError(MegatrainError):
    """A reward function failed on a sample."""


FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_match(completions, answer=None, solution=None, **_) -> list[float]:
    truth = answer if answer is not None else solution
    if truth is None:
        raise ValueError(f"needs {_needed('exact_match')} in the dataset")
    return [float(_text(c).strip() == str(t).strip()) for c, t in zip(completions, truth)]


def format_reward(completions, **_) -> list[float]:
    return [float(FORMAT.match(_text(c).strip()) is not None) for c in completions]


def length(completions, **_) -> list[float]:
    return [float(len(_text(c))) for c in completions]


BUILTIN: dict[str, Callable] = {"exact_match": exact_match, "format": format_reward, "length": length}
# The columns a built-in reads, one of which every prompt's record must hold.
NEEDS: dict[str, tuple[str, ...]] = {"exact_match": ("answer", "solution")}


def _needed(name: str) -> str:
    return "an " + " or ".join(repr(c) for c in NEEDS[name]) + " column"


@dataclass
class RewardFunc:
    name: str
    fn: Callable


def load(specs: list[str] | str | None) -> list[RewardFunc]:
    """The functions `reward_funcs` names: built-in names or `module:function` (the module
    importable from the working directory or the Python path)."""
    if not specs:
        raise ConfigError(
            f"reward_funcs: stage grpo needs at least one ({', '.join(BUILTIN)} or module:function)"
        )
    out = []
    for spec in [specs] if isinstance(specs, str) else specs:
        if spec in BUILTIN:
            out.append(RewardFunc(spec, BUILTIN[spec]))
            continue
        module, _, name = str(spec).partition(":")
        if not module or not name:
            raise ConfigError(
                f"reward_funcs: {spec!r} is neither built in ({', '.join(BUILTIN)}) nor module:function"
            )
        if os.getcwd() not in sys.path:  # `megatrain` started as a script: the working directory too
            sys.path.append(os.getcwd())
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"reward_funcs: cannot load {spec!r}: {e}") from None
        except SyntaxError as e:  # the user's module: where, not Python's traceback
            raise ConfigError(
                f"reward_funcs: cannot load {spec!r}: {e.filename}:{e.lineno}: {e.msg}"
            ) from None
        except Exception as e:  # the module raised as it ran
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise ConfigError(
                f"reward_funcs: cannot load {spec!r}: {frame.filename}:{frame.lineno}: {first_line(e)}"
            ) from None
        if not callable(fn):
            raise ConfigError(f"reward_funcs: {spec!r} is not callable")
        out.append(RewardFunc(spec, fn))
    return out


def check_columns(funcs: list[RewardFunc], prompts: list[Prompt]) -> None:
    """DataError naming the first prompt whose record lacks what a built-in of `funcs` reads
    (NEEDS): checked before step one, not found in it."""
    for f in funcs:
        needs = NEEDS.get(f.name, ())
        for p in prompts if needs else ():
            if all(p.columns.get(c) is None for c in needs):
                has = ", ".join(p.columns) or "none"
                raise DataError(
                    f"{p.source}: reward_funcs {f.name} needs {_needed(f.name)} (its columns: {has})"
                )


def score(funcs: list[RewardFunc], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], sources: list[str]) -> torch.Tensor:  # fmt: skip
    """[completions, functions] float64 rewards, NaN where a function returned None."""
    out = torch.full((len(completions), len(funcs)), math.nan, dtype=torch.float64)
    for j, f in enumerate(funcs):
        try:
            values = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # the user's code: any failure is theirs to see in one line
            raise RewardError(
                f"reward function {f.name} raised on the batch starting at {sources[0]}: {type(e).__name__}: {e}"
            ) from None
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise RewardError(
                f"reward function {f.name} returned {len(values)} values for {len(completions)} completions "
                f"(batch starting at {sources[0]})"
            )
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RewardError(
                    f"reward function {f.name} returned {v!r} for the completion of {sources[i]}"
                )
            out[i, j] = float(v)
    return out
