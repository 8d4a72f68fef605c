"""Worker of bench/dpo.py: DPO with Hugging Face TRL's DPOTrainer and DeepSpeed ZeRO-3 (parameters and
optimizer offloaded to pinned host memory, fp32 master weights and CPUAdam there, bf16 compute),
`precompute_ref_log_probs=True`, on one GPU; the peer of `megatrain train` with `stage: dpo`.

    python bench/_trl_dpo.py --shape B --prompt 512 --completion 512 --tokens-per-step 16384 --steps 6
    python bench/_trl_dpo.py --model DIR --data pairs.jsonl --pairs 8 --out trl.json   # as bench/dpo.py calls it
    python bench/_trl_dpo.py --shape tiny --prompt 16 --completion 16 --pairs 2 --steps 2 --ds none  # the CPU

A randomly initialised model of a shape of _shapes.py (or the config.json in --model) is trained on
random pre-tokenised pairs (those of --data, else drawn as bench/dpo.py draws them). TRL takes text,
so a word-level tokenizer maps token i to the word `t{i}` (`t0` is EOS and ends each completion:
TRL would append one otherwise): every sequence is exactly prompt + completion tokens.

A step counts both sequences of each pair (the prompt twice): 8 pairs of 512 + 512 are 16,384 tokens.
Its time runs from `on_step_begin` to `on_step_end` (fetching the step's batches before, logging after,
are outside), a device sync at each end; tokens/s is over the steps after --warmup. The reference
pass (TRL runs it inside DPOTrainer.__init__, through a DeepSpeed inference engine over the policy) is
timed apart. Host peak: the process's VmHWM. Written to --out (JSON, rewritten after every step) and
printed as a table and one JSON line. Tested with TRL 1.9.2 (bench/README.md says why that one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from typing import Any

import torch
from _shapes import DENSE_SHAPES
from _systems import Result, classify, model_config, single_process_env, sync, vm_hwm_bytes, zero3

LR, BETA = 1e-6, 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", default="B", help="a dense shape of bench/_shapes.py")
    src.add_argument("--model", help="a folder with a config.json (bench/dpo.py writes one)")
    p.add_argument("--data", help="JSON lines of prompt_input_ids, chosen_input_ids, rejected_input_ids")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of each pair")
    p.add_argument("--completion", type=int, default=512, help="tokens of each of chosen and rejected")
    p.add_argument("--pairs", type=int, help="pairs per optimizer step (or --tokens-per-step)")
    p.add_argument("--tokens-per-step", type=int, default=16384, help="2 (prompt + completion) per pair")
    p.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--mbs", type=int, help="per_device_train_batch_size (default: pairs / accum)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (max_steps)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the rate")
    p.add_argument("--ds", choices=("offload", "gpu", "none"), default="offload",
                   help="ZeRO-3 with CPU offload, ZeRO-3 on the GPU, or no DeepSpeed (the CPU smoke test)")  # fmt: skip
    p.add_argument("--out", help="the result's JSON file")
    a = p.parse_args(argv)
    seq = a.prompt + a.completion
    if a.pairs is None:
        if a.tokens_per_step % (2 * seq):
            p.error(f"--tokens-per-step {a.tokens_per_step} is not a whole number of pairs of 2 x {seq}")
        a.pairs = a.tokens_per_step // (2 * seq)
    if a.mbs:
        a.accum = a.pairs // a.mbs
    if a.accum < 1 or a.pairs % a.accum:
        p.error(f"{a.pairs} pairs a step do not split into {a.accum} micro-batches")
    a.mbs = a.pairs // a.accum
    return a


# ---------------------------------------------------------------------------------------- inputs
def load_config(a: argparse.Namespace):
    """The model: bench's LlamaConfig of --shape, or the config.json in --model (SDPA attention)."""
    if a.model is None:
        return model_config({"shape": DENSE_SHAPES[a.shape], "seq": a.prompt + a.completion})
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(a.model)
    cfg._attn_implementation = "sdpa"
    return cfg


def token_rows(a: argparse.Namespace, vocab: int) -> list[dict[str, list[int]]]:
    """--data's rows, else `pairs * steps` random ones drawn as bench/dpo.py draws them (ids >= 1)."""
    if a.data:
        with open(a.data) as f:
            return [json.loads(line) for line in f if line.strip()]
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    return [
        dict(
            prompt_input_ids=ids(a.prompt),
            chosen_input_ids=ids(a.completion),
            rejected_input_ids=ids(a.completion),
        )
        for _ in range(a.pairs * a.steps)
    ]


def word_tokenizer(vocab: int):
    """A tokenizer of the model's vocabulary that needs no file: word `t{i}` is token i, `t0` is EOS and
    padding; no BOS, no special tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t0", unk_token="t0")


def text_row(r: dict[str, list[int]]) -> dict[str, str]:
    """A pair in TRL's standard preference format; the last completion token becomes EOS, so TRL adds none."""
    words = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    return dict(
        prompt=words(r["prompt_input_ids"]) + " ",
        chosen=words(r["chosen_input_ids"][:-1] + [0]),
        rejected=words(r["rejected_input_ids"][:-1] + [0]),
    )


def text_dataset(rows: list[dict[str, list[int]]]):
    from datasets import Dataset

    return Dataset.from_list([text_row(r) for r in rows])


def ds_config(offload: bool) -> dict[str, Any]:
    """bench's ZeRO-3 settings; batch, clipping, precision and AdamW's hyper-parameters come from
    DPOConfig ("auto"), as a TRL user would write it."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": zero3(offload),
        "wall_clock_breakdown": False,
        "steps_per_print": 10**9,
    }


def dpo_config(a: argparse.Namespace, out_dir: str):
    """DPOConfig of the run. Built before the model: with a DeepSpeed config it makes transformers
    create the model partitioned (zero.Init)."""
    from trl import DPOConfig

    cuda = torch.cuda.is_available()
    return DPOConfig(
        output_dir=out_dir, per_device_train_batch_size=a.mbs, gradient_accumulation_steps=a.accum,
        max_steps=a.steps, learning_rate=LR, loss_type=["sigmoid"], beta=BETA, bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        precompute_ref_log_probs=True, max_length=a.prompt + a.completion, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        deepspeed=None if a.ds == "none" else ds_config(a.ds == "offload"),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- timing
def trainer_class() -> tuple[type, list[dict[str, Any]]]:
    """DPOTrainer with its reference pass timed (TRL runs it inside __init__), and the list of passes."""
    from trl import DPOTrainer

    passes: list[dict[str, Any]] = []

    class TimedDPOTrainer(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            sync()
            t = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            sync()
            passes.append({"split": name, "rows": len(dataset), "batch": batch_size,
                           "s": time.perf_counter() - t, "gpu_peak_bytes": gpu_peak()})  # fmt: skip
            return out

    return TimedDPOTrainer, passes


def step_timer(res: Result, tokens_per_step: int, warmup: int):
    """A TrainerCallback timing each optimizer step between device syncs; the record is rewritten
    after every step, so a run that dies keeps the steps it finished."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.step_s, self.end_to_end_s, self.last_end, self.logs = 0.0, [], [], None, []

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            t = time.perf_counter()
            self.step_s.append(t - self.begin)
            if self.last_end is not None:  # everything between two steps: batches fetched, logging
                self.end_to_end_s.append(t - self.last_end)
            self.last_end = t
            res.update(**rates(self.step_s, tokens_per_step, warmup), step_end_to_end_s=self.end_to_end_s,
                       gpu_peak_bytes=gpu_peak(), host_peak_bytes=vm_hwm_bytes())  # fmt: skip

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))
            res.update(logs=self.logs)

    return StepTimer()


def rates(step_s: list[float], tokens_per_step: int, warmup: int) -> dict[str, Any]:
    timed = step_s[warmup:] or step_s
    return {"step_s": step_s, "tokens_per_s": tokens_per_step * len(timed) / sum(timed)}


def gpu_peak() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


# ---------------------------------------------------------------------------------------- run
def versions(a: argparse.Namespace) -> dict[str, str]:
    """The libraries under test; with DeepSpeed also its single-process rendezvous."""
    import datasets
    import transformers
    import trl

    out = {"trl": trl.__version__, "transformers": transformers.__version__, "datasets": datasets.__version__}
    if a.ds != "none":  # without CUDA DeepSpeed takes its CPU accelerator: fp32, a check of the plumbing
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
        single_process_env()
    return out


def build(a: argparse.Namespace, res: Result, out_dir: str):
    """Config, model, data and trainer; the trainer's construction runs the reference pass."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(a)
    rows = token_rows(a, cfg.vocab_size)
    lengths = {
        len(r["prompt_input_ids"]) + len(r[k])
        for r in rows
        for k in ("chosen_input_ids", "rejected_input_ids")
    }
    if lengths != {a.prompt + a.completion}:
        raise ValueError(f"sequence lengths {sorted(lengths)[:5]} in the data, not prompt + completion")
    t0 = time.perf_counter()
    args = dpo_config(a, out_dir)  # first: it makes transformers partition the model (zero.Init)
    # ZeRO-3 keeps bf16 weights and its own fp32 master copy; without DeepSpeed, fp32 weights and bf16 autocast
    dtype = torch.bfloat16 if args.bf16 and a.ds != "none" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    res.update(params=params, rows=len(rows), model_init_s=time.perf_counter() - t0,
               ds_config=args.deepspeed if isinstance(args.deepspeed, dict) else None)  # fmt: skip

    t1 = time.perf_counter()
    cls, passes = trainer_class()
    timer = step_timer(res, res.data["tokens_per_step"], a.warmup)
    trainer = cls(model=model, args=args, train_dataset=text_dataset(rows),
                  processing_class=word_tokenizer(cfg.vocab_size), callbacks=[timer])  # fmt: skip
    if not passes:
        raise RuntimeError("DPOTrainer ran no reference pass (precompute_ref_log_probs ignored?)")
    res.update(
        trainer_init_s=time.perf_counter() - t1, reference=passes, reference_s=sum(p["s"] for p in passes)
    )
    return trainer, timer


def run(a: argparse.Namespace, res: Result) -> None:
    """Build (reference pass included), train --steps optimizer steps, check and record them."""
    res.update(versions=versions(a) | res.data["versions"], tokens_per_step=a.pairs * 2 * (a.prompt + a.completion),
               mbs=a.mbs, grad_accum=a.accum, ds=a.ds)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out_dir:
        trainer, timer = build(a, res, out_dir)
        out = trainer.train()
        sync()
    engine = trainer.model_wrapped  # the DeepSpeed engine: its optimizer and step count prove the set-up
    if hasattr(engine, "global_steps"):
        opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
        res.update(ds_global_steps=engine.global_steps, ds_optimizer=type(opt).__name__)
    losses = [g["loss"] for g in timer.logs if "loss" in g]
    host = vm_hwm_bytes()
    res.update(losses=losses, train_runtime_s=out.metrics.get("train_runtime"), gpu_peak_bytes=gpu_peak(),
               gpu_reserved_peak_bytes=torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
               host_peak_bytes=host, bytes_per_param=host / res.data["params"] if host else None)  # fmt: skip
    if len(timer.step_s) != a.steps:
        raise RuntimeError(f"{len(timer.step_s)} optimizer steps timed, {a.steps} asked for")
    if not losses or not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"losses not finite: {losses}")


def table(d: dict[str, Any]) -> str:
    gib = lambda k: f"{d[k] / 2**30:.1f}" if d.get(k) else "-"  # noqa: E731
    steps = d.get("step_s", [])
    return "\n".join([
        "| system | tokens/s | step s (after warm-up) | reference pass s | GPU peak GiB | host peak GiB | host B/param |",
        "|---|---|---|---|---|---|---|",
        f"| trl+deepspeed ({d.get('ds')}) | {d.get('tokens_per_s') or 0:,.0f} | "
        f"{sum(steps[d['warmup']:]) / max(len(steps[d['warmup']:]), 1):.2f} | {d.get('reference_s') or 0:.1f} | "
        f"{gib('gpu_peak_bytes')} | {gib('host_peak_bytes')} | {d.get('bytes_per_param') or 0:.1f} |",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = a.out or os.path.join(tempfile.mkdtemp(), "trl_dpo.json")
    res = Result(out, system="trl+deepspeed", error=None, command=" ".join(sys.argv), warmup=a.warmup,
                 shape=None if a.model else a.shape, prompt=a.prompt, completion=a.completion, pairs=a.pairs,
                 steps=a.steps, versions={"torch": torch.__version__},
                 gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)  # fmt: skip
    ok = True
    try:
        run(a, res)
    except BaseException as e:  # recorded; bench/dpo.py reads the file and the exit code
        ok = False
        res.data["error"], res.data["error_detail"] = classify(e)
        print(res.data.get("error_detail") or res.data["error"], file=sys.stderr)
    res.update(host_peak_bytes=vm_hwm_bytes(), gpu_peak_bytes=gpu_peak() or res.data.get("gpu_peak_bytes"))
    if ok:
        print(table(res.data))
    bulky = ("logs", "error_detail", "ds_config")
    print(json.dumps({k: v for k, v in res.data.items() if k not in bulky}), flush=True)
    sys.stderr.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    # Skip interpreter teardown: DeepSpeed's and pinned memory's destructors can hang (as bench/_systems.py).
    os._exit(main())
