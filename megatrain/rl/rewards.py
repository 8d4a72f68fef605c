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

A reward model (a sequence-classification model directory, such as stage rm exports, or a Hub
repository's name) scores as TRL's GRPOTrainer scores with a model in `reward_funcs`: prompt +
completion as text (a conversation rendered by the reward model's own chat template), its own
tokenizer, right-padded, no special tokens added, the score of its one label; a plain transformers
forward in the compute dtype on the run's device, where it stays for the run (the plan counts it).

A prompt whose record lacks the column a built-in reads is refused before step one.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    """As reward_funcs names it: a built-in's name or module:function (what messages say)."""
    fn: Callable

    @property
    def metric_name(self) -> str:
        """The name its metrics take (`rewards/<name>/mean`), TRL's: the function's __name__ (a
        partial's function's, a callable object's class name); a built-in's own name."""
        if self.name in BUILTIN:
            return self.name
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        return getattr(fn, "__name__", type(fn).__name__)


class RewardModel:
    """A reward model as a reward function (the module docstring)."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForSequenceClassification

        from ..data.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(path)
        if self.tokenizer.pad_token is None:  # TRL's: its EOS pads
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device

    def __call__(self, prompts, completions, **_) -> list[float]:
        if isinstance(prompts[0], list):  # conversational: the reward model's chat template
            texts = [
                self.tokenizer.apply_chat_template(p + c, tokenize=False)
                for p, c in zip(prompts, completions)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()


def model_dirs(specs: list[str] | str | None) -> list[str]:
    """The entries of `reward_funcs` that name reward models: a directory holding a config.json,
    or a Hub repository's name (`org/name`: no `:`, which a module:function has)."""
    from .. import hub

    found = []
    for spec in [specs] if isinstance(specs, str) else specs or []:
        if spec in BUILTIN or ":" in str(spec):
            continue
        if (Path(spec) / "config.json").is_file() or (
            "/" in spec and not Path(spec).exists() and hub.is_repo_id(spec)
        ):
            found.append(spec)
    return found


def model_path(spec: str, reads: str = "weights") -> str:
    """A reward model's local directory: `spec`, or its Hub repository's snapshot (of what
    `reads`, io/pretrained.py)."""
    if Path(spec).is_dir():
        return spec
    from ..io.pretrained import fetch

    return str(fetch(spec, "reward_funcs", reads))


def model_config(spec: str) -> str:
    """A reward model's config.json directory (for the plan: no weights fetched)."""
    return model_path(spec, "config")


def load(
    specs: list[str] | str | None, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> list[RewardFunc]:
    """The functions `reward_funcs` names: built-in names, `module:function` (the module
    importable from the working directory or the Python path), or reward models (`model_dirs`,
    loaded on `device` in `dtype`)."""
    if not specs:
        raise ConfigError(
            f"reward_funcs: stage grpo needs at least one ({', '.join(BUILTIN)}, module:function or a "
            "reward model's directory)"
        )
    models = model_dirs(specs)
    out = []
    for spec in [specs] if isinstance(specs, str) else specs:
        if spec in BUILTIN:
            out.append(RewardFunc(spec, BUILTIN[spec]))
            continue
        if spec in models:
            out.append(RewardFunc(spec, RewardModel(model_path(spec), device or torch.device("cpu"), dtype)))
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
