"""megatrain's fp32 DPO against an fp64 run, as TRL's own fp32 DPO is, on a pretrained model: the
measurement of tests/test_trl_parity.py (`test_dpo_is_as_close_to_fp64_as_trls`, a tiny random
model) on weights that training made. No Hub checkpoint is at hand, so the model is one this
repository trains: the quickstart (examples/quickstart.yaml, a 1.9M-parameter Llama pretrained
from scratch on the synthetic stories for its 200 steps), or any causal LM given by `--model`.

    python bench/fp64_dpo.py                    # trains the quickstart first (a few minutes on 2 cores)
    python bench/fp64_dpo.py --model output/quickstart/final --out /tmp/fp64

The tokens: the first pairs of examples/preference/data.jsonl (a story's next sentence against the
same words shuffled), tokenised by megatrain's rule (TRL 1.16's) with the example's tokenizer, then
handed to both trainers as ids. Three DPO steps (sigmoid, beta 0.1) of two micro-batches of two
pairs, the clip active, the test's schedule: megatrain in fp32 (`megatrain.trainer.train`), TRL
1.16's DPOTrainer in fp32 and in fp64 (a copy of the policy as the reference model, eager
attention, its text preprocessing left out and its batches in file order, as the test feeds it).
The fp64 run stands for the exact weights; each fp32 run's distance from it over every entry:
the largest, and how many are over 1e-6. The target: megatrain within 2x TRL on both.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]
from _report import write_once  # noqa: E402

B, GA, STEPS = 2, 2, 3  # pairs a micro-batch, micro-batches a step, steps: the test's
LR, WD, MAX_NORM = 1e-3, 0.01, 0.05
OVER = 1e-6  # the count of entries farther than this from the fp64 run
TARGET = 2.0  # megatrain's distance within this many times TRL's
EXAMPLE = ROOT / "examples" / "quickstart.yaml"


def trained_model(work: Path) -> tuple[Path, dict]:
    """The quickstart for its steps, on the CPU; its final/ and its last logged losses."""
    from megatrain.cli import main

    out = work / "quickstart"
    if main(["train", str(EXAMPLE), f"output_dir={out}", "device=cpu", "disable_tqdm=true"]) != 0:
        sys.exit("the quickstart run failed")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    evals = [r for r in records if "eval_loss" in r]
    info = {
        "step": last["step"],
        "loss": last["loss"],
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
    }
    return out / "final", info


def token_pairs(data: Path, tokenizer_dir: Path, n: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) ids of the first `n` pairs, as megatrain's dpo tokenises them."""
    from megatrain.data import load_tokenizer
    from megatrain.data.preference import Limits, build_preference_pairs

    pairs = build_preference_pairs([data], load_tokenizer(tokenizer_dir), Limits(None))[:n]
    out = []
    for p in pairs:
        c, r = p.chosen, p.rejected
        prompt = c.input_ids[: c.prompt_length]
        assert r.input_ids[: r.prompt_length] == prompt, p.source  # chosen and rejected share it
        out.append((prompt, c.input_ids[c.prompt_length :], r.input_ids[r.prompt_length :]))
    return out


def run_megatrain(work: Path, model: Path, rows) -> tuple[dict, dict[str, torch.Tensor]]:
    """megatrain's fp32 run on the pre-tokenised rows: its step records and final weights."""
    from safetensors.torch import load_file

    from megatrain.config import TrainConfig
    from megatrain.trainer import train

    data = work / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}) + "\n"
            for p, c, r in rows
        )
    )
    out = work / "megatrain"
    train(
        TrainConfig(
            model_name_or_path=str(model), dataset=str(data), output_dir=str(out), stage="dpo",
            per_device_train_batch_size=B, gradient_accumulation_steps=GA, max_steps=STEPS,
            learning_rate=LR, lr_scheduler_type="constant", weight_decay=WD, max_grad_norm=MAX_NORM,
            shuffle=False, save_strategy="no", save_dtype="float32", disable_tqdm=True, device="cpu",
            max_length=max(len(p) + max(len(c), len(r)) for p, c, r in rows),
        )
    )  # fmt: skip
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return steps_of(steps, "loss", "grad_norm"), load_file(out / "final" / "model.safetensors")


def run_trl(work: Path, model: Path, rows, tokenizer_dir: Path, dtype: torch.dtype):
    """TRL's DPOTrainer on the same ids in `dtype`: its logged steps and final weights."""
    import trl
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from megatrain.data import load_tokenizer

    class Tokenised(trl.DPOTrainer):
        """Fed token ids: its text preprocessing skipped, its batches in file order."""

        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset

        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset or self.train_dataset)

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").to(
        dtype
    )
    fields = {f.name for f in dataclasses.fields(trl.DPOConfig)}
    args = trl.DPOConfig(
        output_dir=str(work / f"trl-{dtype}"), per_device_train_batch_size=B, gradient_accumulation_steps=GA,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=WD,
        max_grad_norm=MAX_NORM, use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential", **({"max_length": None} if "max_length" in fields else {}),
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in rows])
    trainer = Tokenised(
        model=hf, ref_model=copy.deepcopy(hf), args=args, train_dataset=dataset,
        processing_class=load_tokenizer(tokenizer_dir),
    )  # fmt: skip
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    weights = revert_weight_conversion(trainer.model, dict(trainer.model.named_parameters()))
    return steps_of(logs, "loss", "grad_norm"), {k: p.detach() for k, p in weights.items()}


def steps_of(records: list[dict], *keys: str) -> dict:
    assert len(records) == STEPS, len(records)
    return {k: [float(r[k]) for r in records] for k in keys}


def distance(weights: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict:
    """Every entry's distance from the fp64 run: the largest, the count over OVER, and where."""
    assert weights.keys() == exact.keys(), set(weights) ^ set(exact)
    per = {k: (weights[k].double() - exact[k]).abs() for k in exact}
    flat = torch.cat([d.flatten() for d in per.values()])
    worst = max(per, key=lambda k: per[k].max().item())
    return {
        "max_abs": flat.max().item(),
        "over_1e-6": int((flat > OVER).sum()),
        "entries": flat.numel(),
        "mean_abs": flat.mean().item(),
        "worst_tensor": worst,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| run | max abs from fp64 | entries over 1e-6 | mean abs | losses | grad norms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r.get("distance") or {}
        dist = (
            f"{d['max_abs']:.3g} | {d['over_1e-6']:,} of {d['entries']:,} | {d['mean_abs']:.3g}"
            if d
            else "- | - | -"
        )
        lines.append(
            f"| {r['run']} | {dist} | {', '.join(f'{x:.6f}' for x in r['loss'])} | "
            f"{', '.join(f'{x:.4f}' for x in r['grad_norm'])} |"
        )
    m, t = (next(r["distance"] for r in rows if r["run"] == name) for name in ("megatrain fp32", "TRL fp32"))
    ratio = m["max_abs"] / t["max_abs"]
    count = m["over_1e-6"] / max(t["over_1e-6"], 1)
    ok = "within" if max(ratio, count) <= TARGET else "NOT within"
    lines.append(
        f"\nmegatrain / TRL: max abs **{ratio:.2f}x**, entries over 1e-6 **{count:.2f}x** "
        f"({ok} the target of {TARGET:g}x)"
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a causal LM's folder (default: train the quickstart here)")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "examples" / "tokenizer")
    p.add_argument("--data", type=Path, default=ROOT / "examples" / "preference" / "data.jsonl")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--tag", default="fp64-dpo")
    a = p.parse_args()
    import transformers
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if a.model is None:
            a.model, trained = trained_model(work)
            source = f"examples/quickstart.yaml trained here for its {trained['step']} steps (not a Hub checkpoint)"
        else:
            trained, source = None, f"{a.model} (given)"
        rows = token_pairs(a.data, a.tokenizer, B * GA * STEPS)
        runs = []
        steps, final = run_megatrain(work, a.model, rows)
        runs.append({"run": "megatrain fp32", **steps, "weights": final})
        for dtype in (torch.float32, torch.float64):
            steps, weights = run_trl(work, a.model, rows, a.tokenizer, dtype)
            runs.append(
                {
                    "run": f"TRL {str(dtype).removeprefix('torch.').replace('float', 'fp')}",
                    **steps,
                    "weights": weights,
                }
            )
        n_params = sum(w.numel() for w in runs[-1]["weights"].values())
    exact = runs[-1]["weights"]
    for r in runs[:-1]:
        r["distance"] = distance(r.pop("weights"), exact)
    runs[-1].pop("weights")
    text = table(runs)
    print(text)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "command": "python bench/fp64_dpo.py " + " ".join(sys.argv[1:]),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
        "model": source,
        "model_training": trained,
        "parameters": n_params,
        "data": f"{os.path.relpath(a.data, ROOT)}: the first {len(rows)} pairs, "
        f"{sum(len(x) + len(y) + len(z) for x, y, z in rows)} ids",
        "schedule": f"DPO sigmoid, beta 0.1, {STEPS} steps of {GA} micro-batches of {B} pairs, lr {LR} constant, "
        f"weight decay {WD}, max_grad_norm {MAX_NORM}",
    }
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    title = (
        f"{stamp}_{a.tag}: fp32 DPO's distance from an fp64 run, megatrain and TRL, on a model trained here"
    )
    write_once(a.out, a.tag, title, meta, runs, text, key="runs", stamp=stamp)


if __name__ == "__main__":
    main()
