"""Vision-language SFT throughput and memory: `megatrain train` with `stage: sft` (the vision tower
and projector frozen, megatrain's default) beside TRL's SFTTrainer (bench/_trl_vision.py: bf16
weights on the GPU, TRL's defaults for vision-language SFT) on the same random-weight LLaVA
shape and the same image chats, in one call.

    python bench/vision.py --shape llava_1_5_7b --image-size 448 --text-tokens 448 --batch 8 --accum 2 --steps 6
    python bench/vision.py --smoke --out /tmp/vision-smoke   # the CPU: a tiny LLaVA, both systems

The shape is LLaVA-1.5-7B's (llava-hf/llava-1.5-7b-hf's config.json: CLIP ViT-L/14 at 336 px, 576
image tokens, a Llama-2-7B language model, 7.06 B parameters). Not Qwen2.5-VL's: both systems
read images through the model's processor (megatrain's data/vision.py, TRL's vision collator),
and Qwen2.5-VL's processor cannot be built without torchvision in transformers 5 (its video
processor needs it, and the processor refuses to exist without one); LLaVA's CLIP image processor
needs only Pillow and numpy.

Inputs, written once into a temporary folder and read by both systems: the model directory
(config.json and the processor's files: a word-level tokenizer, `t{i}` being token i, so every
text has an exact token count; ChatML turns; CLIP's image processor), `--batch * --accum * --steps`
random-pixel PNG images of `--image-size` square, and a JSONL of TRL's vision format (`messages`
with an image part and an `images` column), one image per sample, each sample exactly
`--text-tokens` text tokens (the chat template's six included) beside its image tokens.

tokens/s counts every token of a sample (text and image tokens) and images/s its images, over the
steps after the first `--warmup`, each step from the end of the one before (megatrain's
`step_time_s`; TRL's between `on_step_end` callbacks), so both include fetching the step's
batches: TRL's collator decodes and processes the images there. TRL's compute alone
(`on_step_begin` to `on_step_end`) is in the JSON. Peaks: megatrain's from plan.json beside the
plan's; TRL's the allocator's peak and the process's VmHWM. Each row is printed as its run
finishes; writes {stamp}_{tag}.json/.md into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the repository
from _report import write_once  # noqa: E402

WARMUP = 2  # steps left out of the rates (--warmup)
# Each shape's language model (a Llama), CLIP tower and tokenizer words (`words` plus the five
# tokens of `processor`, within the vocabulary).
SHAPES = {
    # llava-hf/llava-1.5-7b-hf's config.json, LlamaConfig's and CLIPVisionConfig's defaults for the rest
    "llava_1_5_7b": dict(
        text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, vocab_size=32064),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        words=32000,
    ),
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, vocab_size=320),
        vision=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                    image_size=32, patch_size=8, projection_dim=32),
        words=256,
    ),
}  # fmt: skip
REFUSED = {
    "qwen2_5_vl_7b": "Qwen2.5-VL's processor needs torchvision (its video processor) in transformers 5; "
    "the LLaVA shape llava_1_5_7b is measured instead (this module's docstring)"
}
SMOKE = dict(shape="tiny", image_size=48, text_tokens=40, batch=4, accum=1, steps=4)
IMAGE, TURN, END = "<image>", "<|im_start|>", "<|im_end|>"
# ChatML whose turns take TRL's content parts; the image part is the processor's placeholder.
TEMPLATE = (
    "{% for m in messages %}" + TURN + "{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + IMAGE + "{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}" + END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + TURN + "assistant\n{% endif %}"
)
TEMPLATE_TOKENS = 6  # a user and an assistant turn: TURN, the role, END each


def image_tokens(shape: dict) -> int:
    """Image tokens of one image: CLIP's patches, the CLS feature dropped (the `default` strategy)."""
    v = shape["vision"]
    return (v["image_size"] // v["patch_size"]) ** 2


def processor(shape: dict):
    """LLaVA's processor over a word-level tokenizer (bench/_trl_dpo.py's: `t{i}` is token i) with
    ChatML's tokens, the roles and the image token added, and CLIP's image processor at the tower's size."""
    from _trl_dpo import word_tokenizer
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tok = word_tokenizer(shape["words"])
    tok.add_special_tokens({"additional_special_tokens": [TURN, END, IMAGE]})
    tok.add_tokens(["user", "assistant"])
    if len(tok) > shape["text"]["vocab_size"]:
        raise ValueError(f"{len(tok)} tokens for a vocabulary of {shape['text']['vocab_size']}")
    side = shape["vision"]["image_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=shape["vision"]["patch_size"],
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token=IMAGE, chat_template=TEMPLATE)  # fmt: skip


def model_config(shape: dict, proc):
    """LlavaConfig of the shape (LLaVA-1.5's projector and feature layer), its image token the processor's."""
    from transformers import LlavaConfig

    tok = proc.tokenizer
    return LlavaConfig(
        text_config=dict(model_type="llama", pad_token_id=tok.pad_token_id, **shape["text"]),
        vision_config=dict(model_type="clip_vision_model", **shape["vision"]),
        image_token_id=tok.convert_tokens_to_ids(IMAGE),
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def chat(rng: random.Random, words: int, text_tokens: int, image: str) -> dict:
    """A TRL vision record of exactly `text_tokens` text tokens: a user turn of the image and a
    question, an assistant answer, random words t1.. (t0 is the tokenizer's EOS and padding)."""
    n = text_tokens - TEMPLATE_TOKENS
    if n < 2:
        raise ValueError(f"--text-tokens {text_tokens}: fewer than the template's {TEMPLATE_TOKENS} + 2")
    said = lambda k: " ".join(f"t{rng.randrange(1, words)}" for _ in range(k))  # noqa: E731
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": said(n // 2)}]},
            {"role": "assistant", "content": [{"type": "text", "text": said(n - n // 2)}]},
        ],
        "images": [image],
    }


def num_params(config) -> int:
    """Every parameter of the composite model (tower, projector, language model)."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())


def write_inputs(d: Path, shape: dict, args) -> tuple[Path, Path, int]:
    """The model directory (config.json, the processor's files), the images and the JSONL of
    chats; and the model's parameters."""
    import numpy as np
    from PIL import Image

    proc = processor(shape)
    config = model_config(shape, proc)
    config.save_pretrained(d / "model")
    proc.save_pretrained(d / "model")
    (d / "imgs").mkdir()
    rng, pixels = random.Random(0), np.random.default_rng(0)
    with open(d / "data.jsonl", "w") as f:
        for i in range(args.batch * args.accum * args.steps):
            side = args.image_size
            Image.fromarray(pixels.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
                d / f"imgs/{i}.png"
            )
            f.write(json.dumps(chat(rng, shape["words"], args.text_tokens, f"imgs/{i}.png")) + "\n")
    return d / "model", d / "data.jsonl", num_params(config)


def run_megatrain(d: Path, model: Path, data: Path, args) -> dict:
    out = d / "out"
    settings = dict(
        model_config=str(model), tokenizer_name_or_path=str(model), dataset=str(data), stage="sft",
        output_dir=str(out), max_length=args.seq, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum, max_steps=args.steps, learning_rate=1e-5,
        save_strategy="no", save_final_model=False, disable_tqdm=True, logging_steps=1, shuffle=False,
    )  # fmt: skip
    (d / "sft.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items()))
    cmd = [sys.executable, "-m", "megatrain", "train", str(d / "sft.yaml"), *args.megatrain]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rec: dict = {"system": "megatrain", "command": " ".join(cmd[1:]), "wall_s": time.perf_counter() - t0,
                 "rc": proc.returncode, "settings": settings}  # fmt: skip
    if proc.returncode != 0:
        rec["error"] = (proc.stdout + proc.stderr)[-4000:]
        return rec
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    plan = json.loads((out / "plan.json").read_text())
    rec.update(
        step_s=[r["step_time_s"] for r in steps],
        tokens=[r["tokens"] for r in steps],
        samples=[r["samples"] for r in steps],
        losses=[r["loss"] for r in steps],
        plan_step_s=plan["plan"].get("step_time_s"),
        predicted=plan.get("predicted"),
        measured=plan.get("measured"),
        log_tail=proc.stdout[-2500:],
    )
    if set(rec["tokens"]) != {args.batch * args.accum * args.seq}:
        rec["error"] = f"tokens per step {rec['tokens']}, not {args.batch * args.accum} samples of {args.seq}"
    return rec


def run_trl(d: Path, model: Path, data: Path, args) -> dict:
    out = d / "trl.json"
    cmd = [sys.executable, str(HERE / "_trl_vision.py"), "--model", str(model), "--data", str(data),
           "--batch", str(args.batch), "--accum", str(args.accum), "--steps", str(args.steps),
           "--out", str(out)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rec = {"system": "TRL SFTTrainer", "command": " ".join(cmd[1:]), "rc": proc.returncode,
           "wall_s": time.perf_counter() - t0}  # fmt: skip
    if out.exists():
        rec |= json.loads(out.read_text())
    if proc.returncode != 0 or not rec.get("step_s"):
        rec["error"] = rec.get("error") or (proc.stdout + proc.stderr)[-3000:]
    elif rec.get("seq") != args.seq:
        rec["error"] = f"TRL's samples are {rec.get('seq')} tokens, not {args.seq}"
    return rec


# ---------------------------------------------------------------------------------------- report
def figures(r: dict, args) -> dict:
    """(measured, plan's or None) of a run: tokens/s, images/s, step s, GPU peak, host peak."""
    if r["system"] == "megatrain":
        timed, plan = r["step_s"][args.warmup :], r.get("plan_step_s")
        measured, predicted = r.get("measured") or {}, r.get("predicted") or {}
        gpu = (measured.get("gpu_peak_allocated"), predicted.get("gpu_peak_allocated"))
        host = (measured.get("host_peak_rss"), predicted.get("host_peak_rss"))
    else:  # from one step's end to the next (step_end_to_end_s[k] ends step k + 2)
        timed, plan = r["step_end_to_end_s"][args.warmup - 1 :], None
        gpu, host = (r.get("gpu_peak_bytes"), None), (r.get("host_peak_bytes"), None)
    step = sum(timed) / len(timed)
    per_step = args.batch * args.accum
    return dict(
        tokens_per_s=(per_step * args.seq / step, per_step * args.seq / plan if plan else None),
        images_per_s=(per_step / step, per_step / plan if plan else None),
        step_s=(step, plan),
        gpu=gpu,
        host=host,
    )


HEADER = (
    "| system | tokens/s (plan) | images/s (plan) | step s after warm-up (plan) | GPU peak GiB (plan) "
    "| host peak GiB (plan) |\n|---|---|---|---|---|---|"
)
FORMATS = dict(
    tokens_per_s=lambda v: f"{v:,.0f}",
    images_per_s=lambda v: f"{v:.2f}",
    step_s=lambda v: f"{v:.2f}",
    gpu=lambda b: f"{b / 2**30:.1f}",
    host=lambda b: f"{b / 2**30:.1f}",
)


def row(r: dict, args) -> str:
    if r.get("error"):
        return f"| {r['system']} | failed: see the json | | | | |"
    f = figures(r, args)

    def cell(k: str) -> str:
        measured, plan = f[k]
        return (FORMATS[k](measured) if measured else "-") + (f" ({FORMATS[k](plan)})" if plan else "")

    return f"| {r['system']} | " + " | ".join(cell(k) for k in FORMATS) + " |"


def ratios(runs: list[dict], args) -> list[str]:
    """megatrain / TRL of each figure, where both ran."""
    ok = {r["system"]: figures(r, args) for r in runs if not r.get("error")}
    if "megatrain" not in ok or "TRL SFTTrainer" not in ok:
        return []
    a, b = ok["megatrain"], ok["TRL SFTTrainer"]
    names = dict(tokens_per_s="tokens/s", images_per_s="images/s", step_s="step s", gpu="GPU peak",
                 host="host peak")  # fmt: skip
    parts = [f"{name} **{a[k][0] / b[k][0]:.2f}x**" for k, name in names.items() if a[k][0] and b[k][0]]
    return ["megatrain / TRL SFTTrainer: " + ", ".join(parts)]


def table(runs: list[dict], args) -> str:
    extra = ratios(runs, args)
    return "\n".join([HEADER, *(row(r, args) for r in runs)] + ([""] + extra if extra else []))


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llava_1_5_7b", help=f"{', '.join(SHAPES)}")
    p.add_argument("--image-size", type=int, default=448, help="each image's side in pixels")
    p.add_argument(
        "--text-tokens", type=int, default=448, help="text tokens of a sample, the template's included"
    )
    p.add_argument(
        "--batch", type=int, default=8, help="samples per micro-batch (per_device_train_batch_size)"
    )
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=WARMUP, help="steps left out of the rates (at least 1)")
    p.add_argument("--systems", default="megatrain,trl")
    p.add_argument(
        "--smoke", action="store_true", help="the CPU: " + " ".join(f"--{k} {v}" for k, v in SMOKE.items())
    )
    p.add_argument("--megatrain", nargs="*", default=[], help="extra key=value for megatrain")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", help="default: vision-<shape>")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    if a.shape in REFUSED:
        p.error(f"--shape {a.shape}: {REFUSED[a.shape]}")
    if a.shape not in SHAPES:
        p.error(f"--shape {a.shape}: not one of {', '.join(SHAPES)}")
    if not 1 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup}: at least 1 and fewer than --steps {a.steps}")
    a.systems = [x for x in a.systems.split(",") if x]
    a.seq = image_tokens(SHAPES[a.shape]) + a.text_tokens
    a.tag = a.tag or f"vision-{a.shape}" + ("-smoke" if a.smoke else "")
    return a


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    shape = SHAPES[args.shape]
    runs = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        d = Path(tmp)
        model, data, params = write_inputs(d, shape, args)
        print(HEADER, flush=True)
        for system in args.systems:
            runs.append((run_megatrain if system == "megatrain" else run_trl)(d, model, data, args))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "log_tail"})[:1500], file=sys.stderr)
            print(row(runs[-1], args), flush=True)
    print("\n".join(ratios(runs, args)))
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "command": "python bench/vision.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": args.shape,
        "num_params": params,
        "image_size": args.image_size,
        "image_tokens": image_tokens(shape),
        "text_tokens": args.text_tokens,
        "seq": args.seq,
        "samples_per_step": args.batch * args.accum,
        "tokens_per_step": args.batch * args.accum * args.seq,
        "warmup": args.warmup,
        "trained": "megatrain: the language model (tower and projector frozen, its default); "
        "TRL: every parameter (its default)",
    }
    title = f"{now:%Y-%m-%d_%H%M}_{args.tag}: vision-language SFT, " + " beside ".join(
        r["system"] for r in runs
    )
    write_once(
        args.out, args.tag, title, meta, runs, table(runs, args), key="runs", stamp=f"{now:%Y-%m-%d_%H%M}"
    )


if __name__ == "__main__":
    main()
