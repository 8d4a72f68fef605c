"""Does a GPU run repeat itself? The same training run, twice in PyTorch's default mode and twice
under `full_determinism`, at training lengths: each run's final weights against the first run of
its mode, and the step time of each mode.

A Llama of `--shape` (bench/_shapes.py) from random weights, rows of `--seq` random tokens, one
row a micro-batch and `--accum` a step, the clip active, through `megatrain.trainer.train` as
`megatrain train` runs it. In the default mode the attention backward (FlashAttention 2) adds dQ
over key blocks atomically; under the switch it takes its deterministic algorithm.

    python bench/determinism.py --shape S --seq 4096 --accum 4 --steps 6 --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402

from megatrain.config import TrainConfig  # noqa: E402
from megatrain.trainer import train  # noqa: E402

MODES = {"default": False, "full_determinism": True}


def write_inputs(work: Path, shape: dict, seq: int, rows: int) -> dict:
    """The model's config.json and a tokens JSONL of `rows` rows of `seq` tokens."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"], intermediate_size=shape["ffn"], vocab_size=shape["vocab"],
        max_position_embeddings=seq,
    ).save_pretrained(work / "model")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with open(work / "data.jsonl", "w") as f:
        for _ in range(rows):
            f.write(
                json.dumps({"input_ids": torch.randint(shape["vocab"], (seq,), generator=g).tolist()}) + "\n"
            )
    return dict(model_config=str(work / "model"), dataset=str(work / "data.jsonl"))


def one_run(base: dict, out: Path, on: bool) -> tuple[dict, list[float], list[float]]:
    """(final weights, grad norms, step seconds) of one run."""
    train(TrainConfig(**base, output_dir=str(out), full_determinism=on))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r]
    return (
        load_file(out / "final" / "model.safetensors"),
        [r["grad_norm"] for r in recs],
        [r["step_time_s"] for r in recs],
    )


def compare(w: dict, ref: dict) -> tuple[int, float]:
    """(tensors that differ, the largest element difference over them)."""
    differ = [k for k in ref if not torch.equal(w[k], ref[k])]
    return len(differ), max(((w[k] - ref[k]).abs().max().item() for k in differ), default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="S", choices=sorted(DENSE_SHAPES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--runs", type=int, default=2, help="runs in each mode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = DENSE_SHAPES[a.shape]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = write_inputs(work, shape, a.seq, a.accum * a.steps) | dict(
            device=a.device, max_length=a.seq, per_device_train_batch_size=1, gradient_accumulation_steps=a.accum,
            max_steps=a.steps, learning_rate=1e-4, max_grad_norm=0.1, shuffle=False, save_strategy="no",
            save_dtype="float32", disable_tqdm=True, seed=0,
        )  # fmt: skip
        for mode, on in MODES.items():
            first = None
            for i in range(a.runs):
                w, norms, times = one_run(base, work / f"{mode}-{i}", on)
                first = first or (w, norms)
                differ, largest = compare(w, first[0])
                row = dict(mode=mode, run=i + 1, step_s=round(statistics.median(times[2:] or times), 4),
                           tensors=len(w), differ=differ, largest=largest, norms_equal=norms == first[1],
                           grad_norms=norms)  # fmt: skip
                rows.append(row)
                print({k: v for k, v in row.items() if k != "grad_norms"}, flush=True)
    base_s = statistics.median(r["step_s"] for r in rows if r["mode"] == "default")
    lines = ["| mode | run | median step s (from step 3) | vs default | tensors differing from run 1 | "
             "largest difference | grad norms as run 1's |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['mode']} | {r['run']} | {r['step_s']:.4f} | {r['step_s'] / base_s:.3f}x | "
                     f"{r['differ']} of {r['tensors']} | {r['largest']:.3g} | {r['norms_equal']} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if a.out:
        cuda = torch.cuda.is_available() and a.device.startswith("cuda")
        meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                    device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                    shape=f"{a.shape} {shape}", seq=a.seq, accum=a.accum, steps=a.steps,
                    command="python bench/determinism.py " + " ".join(sys.argv[1:]))  # fmt: skip
        print(write_once(a.out, "determinism", "Does a GPU run repeat itself?", meta, rows, table))


if __name__ == "__main__":
    main()
