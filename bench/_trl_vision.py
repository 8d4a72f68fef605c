"""Worker of bench/vision.py: vision-language SFT with TRL's SFTTrainer, the peer of `megatrain train`
with `stage: sft` on the same model directory and image chats.

    python bench/_trl_vision.py --model DIR --data data.jsonl --batch 8 --accum 2 --steps 6 --out trl.json

The model is built from the directory's config.json with random weights, in bf16 on the GPU (fp32
on the CPU); everything else is TRL's default for vision-language SFT (every parameter trained,
gradient checkpointing, the processor's collator tokenising and processing images each batch),
with `max_length=None` as TRL's vision-language guide sets it (truncation would cut image tokens).
The dataset is the JSONL's records, its `images` paths (relative to the file) cast to a `datasets`
Image column, as a user loads them (`dataset`). Steps are timed by bench/_trl_dpo.py's callback
(each from `on_step_begin` to `on_step_end`, and from one `on_step_end` to the next), the record
written to --out after every step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _systems import Result, classify, sync, vm_hwm_bytes
from _trl_dpo import gpu_peak, step_timer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a folder with config.json and the processor's files")
    p.add_argument("--data", required=True, help="JSONL of TRL's vision format (messages, images)")
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (max_steps)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the callback's rate")
    p.add_argument("--out", help="the result's JSON file")
    return p.parse_args(argv)


def dataset(path: str | Path):
    """The JSONL's records as a `datasets.Dataset`, `images` decoded to Pillow images on access."""
    from datasets import Dataset, Image, Sequence

    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        r["images"] = [str(path.parent / p) for p in r["images"]]
    return Dataset.from_list(rows).cast_column("images", Sequence(Image()))


def build(a: argparse.Namespace, res: Result, out_dir: str):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    with torch.device("cuda" if cuda else "cpu"):  # random init where it trains: no host copy
        model = AutoModelForImageTextToText.from_config(
            AutoConfig.from_pretrained(a.model), dtype=torch.bfloat16 if cuda else torch.float32
        )
    res.update(params=sum(p.numel() for p in model.parameters()), model_init_s=time.perf_counter() - t0,
               trainable=sum(p.numel() for p in model.parameters() if p.requires_grad))  # fmt: skip
    data = dataset(a.data)
    args = SFTConfig(
        output_dir=out_dir, per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accum,
        max_steps=a.steps, learning_rate=1e-5, max_length=None, bf16=cuda, use_cpu=not cuda,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    processor = AutoProcessor.from_pretrained(a.model)
    timer = step_timer(res, res.data["tokens_per_step"], a.warmup)
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=processor, callbacks=[timer]
    )
    res.update(optim=str(args.optim), gradient_checkpointing=args.gradient_checkpointing, rows=len(data))
    return trainer, timer


def tokens_per_sample(a: argparse.Namespace) -> int:
    """A sample's length as TRL's collator makes it (all samples are one length here)."""
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    batch = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(a.model))(
        [dataset(a.data)[0]]
    )
    return batch["input_ids"].shape[1]


def run(a: argparse.Namespace, res: Result) -> None:
    import transformers
    import trl

    seq = tokens_per_sample(a)
    res.update(versions={"trl": trl.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__}, seq=seq, tokens_per_step=a.batch * a.accum * seq)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out_dir:
        trainer, timer = build(a, res, out_dir)
        trainer.train()
        sync()
    losses = [g["loss"] for g in timer.logs if "loss" in g]
    res.update(losses=losses, gpu_peak_bytes=gpu_peak(), host_peak_bytes=vm_hwm_bytes(),
               gpu_reserved_peak_bytes=torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None)  # fmt: skip
    if len(timer.step_s) != a.steps:
        raise RuntimeError(f"{len(timer.step_s)} optimizer steps timed, {a.steps} asked for")
    if not losses or not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"losses not finite: {losses}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = a.out or os.path.join(tempfile.mkdtemp(), "trl_vision.json")
    res = Result(out, system="TRL SFTTrainer", error=None, command=" ".join(sys.argv), warmup=a.warmup,
                 batch=a.batch, accum=a.accum, steps=a.steps,
                 gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)  # fmt: skip
    ok = True
    try:
        run(a, res)
    except BaseException as e:  # recorded; bench/vision.py reads the file and the exit code
        ok = False
        res.data["error"], res.data["error_detail"] = classify(e)
        print(res.data.get("error_detail") or res.data["error"], file=sys.stderr)
    res.update(host_peak_bytes=vm_hwm_bytes(), gpu_peak_bytes=gpu_peak() or res.data.get("gpu_peak_bytes"))
    print(json.dumps({k: v for k, v in res.data.items() if k not in ("logs", "error_detail")}), flush=True)
    sys.stderr.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    os._exit(main())  # no interpreter teardown (as bench/_trl_dpo.py)
