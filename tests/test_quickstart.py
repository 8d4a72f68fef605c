"""The quickstart, end to end: the shipped assets, a golden loss curve, the exported model
against transformers, and the chat fine-tune on top of it.

The golden test runs examples/quickstart.yaml through the CLI for GOLDEN_STEPS fixed-seed steps
(shorter rows and batches than the real quickstart, for speed) and compares the loss of every
step, and the eval loss on the held-out stories after the last one, with
tests/golden/quickstart_losses.json to a relative 1e-4. On the CPU in float32 the run
is deterministic: the same losses bit for bit from run to run and for 1, 2 or 4 threads. A
mismatch therefore means the numbers changed: the data pipeline (tokenizer, packing, order), the
random initialisation, the forward/backward or the optimizer. When the change is intended,
regenerate the golden file and commit it with the change:

    MEGATRAIN_UPDATE_GOLDEN=1 python -m pytest tests/test_quickstart.py
    # or: python tests/test_quickstart.py --update-golden
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from megatrain.cli import main
from megatrain.config import TrainConfig
from megatrain.data import build_samples, load_tokenizer
from megatrain.data.batch import IGNORE_INDEX, MicroBatch
from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model, cpu_threads
from megatrain.trackers import is_eval

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden" / "quickstart_losses.json"
GOLDEN_STEPS = 8
GOLDEN_OVERRIDES = [
    f"max_steps={GOLDEN_STEPS}",
    "max_length=128",
    "per_device_train_batch_size=4",
    "gradient_accumulation_steps=1",
    "warmup_steps=1",
    "learning_rate=0.003",
    "seed=42",
    "save_dtype=bfloat16",  # the default export dtype; the parity test loads both sides from it
    "logging_steps=1",
    "disable_tqdm=true",
    "device=cpu",
]
REL_TOL = 1e-4


def run_quickstart(output_dir: Path) -> tuple[list[float], float]:
    """The golden run; returns the loss of every step and then the eval loss after the last
    (the quickstart evaluates every 25 steps and after the last) from metrics.jsonl."""
    rc = main(["train", str(EXAMPLES / "quickstart.yaml"), *GOLDEN_OVERRIDES, f"output_dir={output_dir}"])
    assert rc == 0, f"megatrain train examples/quickstart.yaml exited {rc}"
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [r for r in records if not is_eval(r)], [r for r in records if is_eval(r)]
    assert [r["step"] for r in steps] == list(range(1, GOLDEN_STEPS + 1))
    assert [r["step"] for r in evals] == [GOLDEN_STEPS] and records[-1] is evals[0]
    return [r["loss"] for r in steps], evals[0]["eval_loss"]


def write_golden(losses: list[float], eval_loss: float) -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "comment": "regenerate: MEGATRAIN_UPDATE_GOLDEN=1 python -m pytest tests/test_quickstart.py",
        "config": "examples/quickstart.yaml",
        "overrides": GOLDEN_OVERRIDES,
        "torch": torch.__version__,
        "losses": losses,
        "eval_loss": eval_loss,
    }
    GOLDEN.write_text(json.dumps(data, indent=2) + "\n")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[Path, list[float], float]:
    out = tmp_path_factory.mktemp("quickstart")
    return out, *run_quickstart(out)


# --------------------------------------------------------------------------- shipped assets
def test_tokenizer_and_chat_template():
    tok = load_tokenizer(EXAMPLES / "tokenizer")
    model = json.loads((EXAMPLES / "tiny-llama" / "config.json").read_text())
    assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
    assert model["vocab_size"] == len(tok)
    for name in ("bos", "eos", "pad"):
        assert getattr(tok, f"{name}_token_id") is not None
        assert model[f"{name}_token_id"] == getattr(tok, f"{name}_token_id")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3

    text = 'Once upon a time, Pip the rabbit said, "Hello!"\n\nThe end.'
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == text

    chat = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Who is Pip?"},
        {"role": "assistant", "content": "Pip is a rabbit who lives in the Green Forest."},
    ]
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert rendered == (
        "<s><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWho is Pip?<|im_end|>\n"
        "<|im_start|>assistant\nPip is a rabbit who lives in the Green Forest.<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    chat_ids = tok(rendered, add_special_tokens=False).input_ids
    assert tok.decode(chat_ids) == rendered  # round trip
    for special in ("<|im_start|>", "<|im_end|>", "<s>"):
        assert len(tok(special, add_special_tokens=False).input_ids) == 1
        assert special in tok.all_special_tokens
    assert "<|im_start|>" not in tok.decode(chat_ids, skip_special_tokens=True)


def test_shipped_data_is_what_the_generator_writes():
    """The JSONL assets are a pure function of the generator's seeds (the tokenizer is checked
    by `scripts/make_quickstart_assets.py --check`, which also depends on the tokenizers
    version)."""
    spec = importlib.util.spec_from_file_location(
        "make_assets", ROOT / "scripts" / "make_quickstart_assets.py"
    )
    gen = importlib.util.module_from_spec(spec)
    sys.modules["make_assets"] = gen  # dataclasses look their module up there
    try:
        spec.loader.exec_module(gen)
    finally:
        del sys.modules["make_assets"]
    stories = gen.make_stories(gen.N_STORIES, gen.STORY_SEED)
    held_out = gen.make_eval_stories(gen.N_EVAL_STORIES, gen.EVAL_STORY_SEED, stories)
    chats = gen.make_chats(gen.N_CHATS, gen.CHAT_SEED)

    def jsonl(records):
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)

    assert (EXAMPLES / "data" / "stories.jsonl").read_text(encoding="utf-8") == jsonl(
        {"text": t} for t in stories
    )
    assert (EXAMPLES / "chat" / "data.jsonl").read_text(encoding="utf-8") == jsonl(chats)
    assert (EXAMPLES / "data" / "stories_eval.jsonl").read_text(encoding="utf-8") == jsonl(
        {"text": t} for t in held_out
    )
    assert len(held_out) == gen.N_EVAL_STORIES and not set(held_out) & set(stories)  # held out
    size = (EXAMPLES / "data" / "stories.jsonl").stat().st_size
    assert 1.5e6 < size < 3e6


def test_chat_data_trains_on_assistant_turns_only():
    cfg = TrainConfig.load(EXAMPLES / "chat.yaml", ["model_name_or_path=unused"])
    assert cfg.dataset_format == "messages" and not cfg.train_on_prompt
    tok = load_tokenizer(cfg.tokenizer_name_or_path)
    samples = build_samples(cfg, tok)
    records = [json.loads(line) for line in (EXAMPLES / "chat" / "data.jsonl").read_text().splitlines()]
    assert len(samples) == len(records)
    for sample, rec in list(zip(samples, records))[:50]:
        assert len(sample.input_ids) <= cfg.max_length
        trained = [t for t in sample.labels if t != IGNORE_INDEX]
        want = "".join(m["content"] + "<|im_end|>" for m in rec["messages"] if m["role"] == "assistant")
        assert tok.decode(trained) == want


# --------------------------------------------------------------------------- training runs
def test_golden_losses(quickstart):
    _, losses, eval_loss = quickstart
    if os.environ.get("MEGATRAIN_UPDATE_GOLDEN"):
        write_golden(losses, eval_loss)
    assert GOLDEN.is_file(), f"{GOLDEN} is missing; create it with MEGATRAIN_UPDATE_GOLDEN=1"
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == GOLDEN_OVERRIDES, "the golden run's settings changed: regenerate the file"
    expected = golden["losses"]
    assert len(losses) == len(expected)
    for step, (got, want) in enumerate(zip(losses, expected), start=1):
        assert got == pytest.approx(want, rel=REL_TOL), (
            f"step {step}: loss {got!r}, golden {want!r}\n  got    {losses}\n  golden {expected}\n"
            "If the change in numerics is intended, regenerate: MEGATRAIN_UPDATE_GOLDEN=1 python -m pytest "
            "tests/test_quickstart.py"
        )
    assert eval_loss == pytest.approx(golden["eval_loss"], rel=REL_TOL), (eval_loss, golden["eval_loss"])
    # And the run learns: from ~ln(vocab) = 7.5 clearly down within these few steps, on the
    # held-out stories too.
    assert losses[0] == pytest.approx(7.54, abs=0.15)
    assert losses[-1] < losses[0] - 1.0
    assert eval_loss < losses[0] - 1.0


def test_export_loads_in_transformers_with_the_same_logits(quickstart):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = quickstart[0] / "final"
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template and tok.convert_tokens_to_ids("<|im_end|>") == 4
    texts = [
        json.loads(line)["text"] for line in (EXAMPLES / "data" / "stories.jsonl").open().readlines()[:2]
    ]
    ids = torch.tensor([tok(t).input_ids[:48] for t in texts])

    # Both sides read the same exported (bfloat16) weights and compute in float32.
    model = build_model(ModelConfig.from_json(final), weights=final, device="cpu", compute_dtype="float32")
    try:
        ours = model.engine.logits(MicroBatch(ids, ids))
    finally:
        model.close()
    hf = AutoModelForCausalLM.from_pretrained(final).float().eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits.float()
    assert ours.shape == ref.shape == (2, 48, len(tok))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # The exported weights are the trained ones, not a fresh initialisation (loss ~7.5).
    loss = torch.nn.functional.cross_entropy(ref[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert loss < 7.0


def test_chat_finetune_runs_on_the_exported_model(quickstart, tmp_path):
    final = quickstart[0] / "final"
    rc = main([
        "train", str(EXAMPLES / "chat.yaml"), f"model_name_or_path={final}", f"output_dir={tmp_path}",
        "max_steps=2", "max_length=128", "per_device_train_batch_size=2", "disable_tqdm=true", "device=cpu",
    ])  # fmt: skip
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["label_tokens"] > 0 for r in records)
    assert (tmp_path / "final" / "model.safetensors").is_file()


def cli(*argv) -> None:
    assert main([str(a) for a in argv]) == 0


@pytest.fixture(scope="module")
def run_threads():
    """The example runs below compute on the threads a run of the command line picks
    (runtime.cpu_threads: every core here), not the suite's one: the quickstart's model is large
    enough to gain from them, and nothing else runs beside these tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads())  # OMP_NUM_THREADS is set (conftest): runs keep it
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def whole_quickstart(tmp_path_factory, run_threads):
    """The README's quickstart as it ships (200 steps), but for its evaluations every 25 steps (the
    examples below read only its model, the same bit for bit without them; the golden test
    evaluates): its output directory."""
    quick = tmp_path_factory.mktemp("whole") / "quick"
    cli(
        "train", EXAMPLES / "quickstart.yaml", f"output_dir={quick}", "eval_strategy=no", "disable_tqdm=true",
        "device=cpu",
    )  # fmt: skip
    return quick


@pytest.mark.slow
def test_the_chat_example_answers_and_stops(whole_quickstart, tmp_path):
    """The README's path, whole: the quickstart, the chat fine-tune on its model, `megatrain
    export`, then plain `generate()` (greedy, no stopping criteria of our own): the model answers
    a question from the chat data and stops at the template's end-of-turn token."""
    import transformers

    quick, chat, exported = whole_quickstart, tmp_path / "chat", tmp_path / "my-model"
    cli(
        "train", EXAMPLES / "chat.yaml", f"model_name_or_path={quick / 'final'}", f"output_dir={chat}",
        "disable_tqdm=true", "device=cpu",
    )  # fmt: skip
    cli("export", chat / "checkpoint-100", exported, "--dtype", "bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end in model.generation_config.eos_token_id
    chats = [json.loads(line) for line in (EXAMPLES / "chat" / "data.jsonl").read_text().splitlines()]
    # Questions whose answer in the data is a sentence (others ask for a whole story).
    questions = [
        c["messages"][:1]
        for c in chats
        if c["messages"][0]["content"].rstrip().endswith("?")
        and len(c["messages"][1]["content"].split()) < 15
    ][:5]
    assert len(questions) == 5
    for prompt in questions:
        ids = tok.apply_chat_template(
            prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(**ids, max_new_tokens=48, do_sample=False)[0, ids["input_ids"].shape[1] :]
        assert out[-1] == end and end not in out[:-1].tolist(), tok.decode(
            out
        )  # stopped at the end of the turn
        assert len(out) > 2 and tok.decode(out[:-1]).strip(), tok.decode(out)  # after an answer


@pytest.mark.slow
def test_the_dpo_example_learns_the_preferences(whole_quickstart, tmp_path):
    """examples/dpo.yaml as the README runs it, on the quickstart's model: the DPO loss falls from
    log 2 and the reward accuracy rises to nearly every pair; the reference log-probs are stored."""
    out = tmp_path / "dpo"
    cli(
        "train", EXAMPLES / "dpo.yaml", f"model_name_or_path={whole_quickstart / 'final'}", f"output_dir={out}",
        "disable_tqdm=true", "device=cpu",
    )  # fmt: skip
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the policy is the reference
    last = steps[-10:]
    assert sum(r["loss"] for r in last) / 10 < 0.35
    assert sum(r["rewards/accuracies"] for r in last) / 10 >= 0.9
    assert sum(r["rewards/margins"] for r in last) / 10 > 1.0
    assert (out / "reference" / "logps.safetensors").is_file()


def train_example(name: str, whole_quickstart, tmp_path, monkeypatch) -> tuple[list[dict], Path]:
    """examples/<name>.yaml from the repository root on the quickstart's model: its metrics.jsonl
    records and its output directory."""
    monkeypatch.chdir(EXAMPLES.parent)
    out = tmp_path / name
    cli(
        "train", EXAMPLES / f"{name}.yaml", f"model_name_or_path={whole_quickstart / 'final'}", f"output_dir={out}",
        "disable_tqdm=true", "device=cpu",
    )  # fmt: skip
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()], out


@pytest.mark.slow
def test_the_grpo_example_learns_its_reward(whole_quickstart, tmp_path, monkeypatch):
    """examples/grpo.yaml from the repository root: the mean reward rises to nearly 1."""
    records, out = train_example("grpo", whole_quickstart, tmp_path, monkeypatch)
    rewards = [r["reward"] for r in records]
    assert sum(rewards[-10:]) / 10 >= 0.9 > sum(rewards[:10]) / 10
    assert (out / "completions.jsonl").stat().st_size > 0


@pytest.mark.slow
def test_the_rloo_example_learns_its_reward(whole_quickstart, tmp_path, monkeypatch):
    """examples/rloo.yaml from the repository root: the mean reward rises from ~0.6 to ~0.9."""
    records, _ = train_example("rloo", whole_quickstart, tmp_path, monkeypatch)
    steps = [r for r in records if "loss" in r]
    rewards = [r["reward"] for r in steps]
    assert sum(rewards[-10:]) / 10 >= 0.8 > 0.7 > sum(rewards[:10]) / 10
    assert all("kl" in r for r in steps[1:])  # beta 0.05: the KL penalty to the initial policy


def test_dpo_example_config_reads_the_shipped_pairs(quickstart, tmp_path):
    """examples/dpo.yaml on the short quickstart's model: three steps, TRL's metrics logged."""
    rc = main([
        "train", str(EXAMPLES / "dpo.yaml"), f"model_name_or_path={quickstart[0] / 'final'}",
        f"output_dir={tmp_path}", "max_steps=3", "per_device_train_batch_size=2", "disable_tqdm=true",
        "device=cpu",
    ])  # fmt: skip
    assert rc == 0
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and all(0 <= r["rewards/accuracies"] <= 1 for r in steps)
    assert steps[0]["samples"] == 2 and steps[0]["rows"] == 4  # two pairs: four sequences


if __name__ == "__main__":
    if sys.argv[1:] != ["--update-golden"]:
        sys.exit("usage: python tests/test_quickstart.py --update-golden")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        losses, eval_loss = run_quickstart(Path(tmp))
    write_golden(losses, eval_loss)
    print(f"wrote {GOLDEN}: {losses}, eval_loss {eval_loss}")
