"""Worker of bench/grpo.py: GRPO with Hugging Face TRL's GRPOTrainer on one GPU, the peer of
`megatrain train` with `stage: grpo`: the model of --model (a config.json; random weights) in bf16
on the GPU (as TRL's users load a 7B there), TRL's defaults otherwise (sampling with transformers'
`generate`, gradient checkpointing, loss dapo, beta 0), the same prompts and reward as megatrain's
(bench/_grpo_reward.py: the parity of a completion's token sum).

    python bench/_trl_grpo.py --model DIR --data prompts.jsonl --generations 8 --prompts 16 \
        --completion 512 --steps 3 --out trl.json
    python bench/_trl_grpo.py --model DIR --data prompts.jsonl --prompts 2 --generations 2 \
        --completion 4 --steps 2 --out trl.json     # the CPU (fp32)

TRL takes text: the word-level tokenizer of _trl_dpo.py (word `t{i}` is token i, `t0` EOS), so a
prompt of n ids is n tokens. A step is timed from `on_step_begin` to `on_step_end` (a device sync
at each end); its tokens are completions x (prompt + TRL's `completions/mean_length`). Written to
--out (JSON, rewritten after every step) and printed one line a step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _grpo_reward import parity  # noqa: E402
from _trl_dpo import word_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a folder with a config.json")
    p.add_argument("--data", required=True, help="JSON lines with prompt_input_ids")
    p.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=512, help="max_completion_length")
    p.add_argument("--rows-per-micro-batch", type=int, default=16, help="per_device_train_batch_size")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the rate")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import datasets
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    cfg = transformers.AutoConfig.from_pretrained(a.model)
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device("cuda" if cuda else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    rows = [json.loads(x) for x in Path(a.data).read_text().splitlines() if x.strip()]
    prompts = [{"prompt": " ".join(f"t{i}" for i in r["prompt_input_ids"])} for r in rows]
    completions = a.prompts * a.generations

    rec: dict = {"system": "TRL GRPOTrainer", "trl": trl.__version__, "transformers": transformers.__version__,
                 "torch": torch.__version__, "dtype": str(dtype), "steps": []}  # fmt: skip

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            rec["steps"].append({"step_s": time.perf_counter() - self.t0})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs and rec["steps"]:
                s = rec["steps"][-1]
                s["mean_length"] = logs["completions/mean_length"]
                s["tokens"] = completions * (len(rows[0]["prompt_input_ids"]) + s["mean_length"])
                s["reward"] = logs.get("reward")
                print(json.dumps(s), flush=True)
                Path(a.out).write_text(json.dumps(rec))

    with tempfile.TemporaryDirectory() as tmp:
        args = trl.GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=a.rows_per_micro_batch,
            gradient_accumulation_steps=completions // a.rows_per_micro_batch, num_generations=a.generations,
            max_completion_length=a.completion, max_steps=a.steps, logging_steps=1, save_strategy="no",
            report_to=[], bf16=cuda, use_cpu=not cuda, learning_rate=1e-6, shuffle_dataset=False,
            dataloader_num_workers=0,
        )  # fmt: skip
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=parity, args=args, train_dataset=datasets.Dataset.from_list(prompts),
            processing_class=word_tokenizer(cfg.vocab_size), callbacks=[Timer()],
        )  # fmt: skip
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
    timed = [s for s in rec["steps"][a.warmup :] if "tokens" in s]
    rec["tokens_per_s"] = sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed) if timed else None
    rec["gpu_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    Path(a.out).write_text(json.dumps(rec))
    print(json.dumps({k: v for k, v in rec.items() if k != "steps"}), flush=True)


if __name__ == "__main__":
    main()
