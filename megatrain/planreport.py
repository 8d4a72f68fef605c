"""What `megatrain plan` prints: the plan of a run (plan.py's), the largest batch settings that
fit, and the longest sequence the smallest step may have, each in the stage's own settings
(plan.knobs_of)."""

from __future__ import annotations

from . import plan
from .checks import beyond_positions
from .host.state import state_bytes
from .models.config import ModelConfig
from .models.family import describe
from .planning.placement import Machine, fmt_bytes
from .stages import row_length, row_length_text


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def report(
    model_cfg: ModelConfig, result: plan.Check, device_name: str, dtype_name: str, cfg, data: int = 0
) -> str:
    """The text `megatrain plan` prints."""
    m = result.machine
    b = plan.batch_of(cfg, model_cfg, 2 if dtype_name == "bfloat16" else 4)
    lines = [
        f"model: {model_cfg.name}, {_count(model_cfg.num_params)} parameters ({model_cfg.num_params:,}), "
        f"{model_cfg.num_hidden_layers} layers, hidden {model_cfg.hidden_size}, vocab {model_cfg.vocab_size}",
        f"runs on: {describe(model_cfg)}",
        f"device: {device_name}, {dtype_name} compute",
        f"tokens: {b.rows} x {b.seq_len} per micro-batch"
        + (f" ({cfg.per_device_train_batch_size} {cfg.stage} samples)" if cfg.preference() else "")
        + (" (completions: prompt + max_completion_length)" if cfg.grpo() is not None else "")
        + ", "
        f"x {cfg.gradient_accumulation_steps} accumulation = {b.tokens:,} per optimizer step "
        f"(upper bound: rows padded to {row_length_text(cfg)})",
        "budget: GPU "
        + (
            "unknown (no CUDA device visible here: set max_gpu_memory)"
            if m.device == "cuda" and m.gpu_bytes is None
            else f"{fmt_bytes(m.gpu_bytes)} ({'max_gpu_memory' if m.gpu_capped else 'free now'})"
            if m.device == "cuda"
            else "none (CPU run)"
        )
        + ", host "
        + ("unknown" if m.host_bytes is None else fmt_bytes(m.host_bytes + data))
        + (
            ""
            if cfg.max_host_memory is not None
            else " (MemAvailable: set max_host_memory to plan for another machine)"
        ),
    ]
    w = m.world
    if w.ranks > 1:
        lines.append(
            f"world: {w.ranks} processes on {w.machines} machine(s), {'sharded' if w.sharded else 'plain'} traffic"
            + (", host state partitioned (memory below: one machine's part)" if w.partitioned else "")
        )
    lines.append("")
    p = result.plan
    if p is None:
        lines.append("does not fit: " + result.problem)
        return "\n".join(lines)
    lines += [f"plan: {note}" for note in p.notes] or ["plan: all state in host memory"]
    rollout = plan.rollout_memory(cfg, model_cfg, b.compute_bytes, m.world.ranks, p.rollout_layers)
    if rollout and p.device == "cuda":
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in rollout.items())
        lines.append(f"rollout: ~{fmt_bytes(sum(rollout.values()))} of the GPU kept for sampling ({parts}); "
                     "the memory below is the update's")  # fmt: skip
    if rollout and p.rollout_layers is not None:
        layers = model_cfg.num_hidden_layers
        lines.append(f"rollout: {layers - p.rollout_layers} of {layers} layers streamed through the "
                     f"{'GPU' if p.device == 'cuda' else 'device'} in every decode step (the first "
                     f"{p.rollout_layers} resident), fetched from host memory as the master weights' "
                     + ("bf16 half" if dtype_name == "bfloat16" else "two halves"))  # fmt: skip
    lines.append("")
    if p.device == "cuda":
        lines.append("GPU memory at its peak (predicted torch.cuda.max_memory_allocated)")
        lines.extend(f"  {k:<50}{fmt_bytes(v):>12}" for k, v in p.gpu.items())
        lines.append(f"  {'total':<50}{fmt_bytes(p.gpu_peak):>12}")
    lines.append("host memory (growth of the resident set)")
    host = dict(p.host)
    if data:
        host["tokenized data (estimate)"] = data
    lines.extend(f"  {k:<50}{fmt_bytes(v):>12}" for k, v in host.items())
    lines.append(f"  {'total':<50}{fmt_bytes(sum(host.values())):>12}")
    if p.device == "cuda":
        lines.append(f"  {'of which page-locked':<50}{fmt_bytes(p.pinned):>12}")
    lines += _modes(p, m, cfg)
    lines.append("")
    tps = b.tokens / p.step_time_s if p.step_time_s else 0
    lines.append(f"estimated step: {p.step_time_s:.2f} s ({tps:,.0f} tokens/s; a cost-model projection)")
    lines.append("fits")
    return "\n".join(lines)


def _modes(p, machine: Machine, cfg) -> list[str]:
    """The largest model this host holds in each optimizer mode (plan.largest_models)."""
    largest = plan.largest_models(p, machine)
    if not largest:
        return []
    lines = ["largest model whose state this host holds beside this run's other buffers, by optimizer mode"]
    for f, n in largest.items():
        how = " ".join(f"{k}={v}" for k, v in f.settings.items())
        per = f"{state_bytes(f):.2f}".rstrip("0").rstrip(".")
        ours = " (this run)" if f == cfg.moments() else ""
        lines.append(f"  {_count(n):>8}  {f.name} moments, {per} B/param: {how}{ours}")
    return lines


def limits_line(model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem=None) -> str:
    """`megatrain plan`'s answer to "how far may each batch setting go on this machine"."""
    lim = plan.limits(model_cfg, cfg, machine, compute_bytes, layer_mem)
    counts = cfg.stage + " samples" if cfg.preference() else "completions" if cfg.grpo() else None
    parts = [
        f"{k}={v}" + (f" ({counts})" if k == "per_device_train_batch_size" and counts and v else "")
        for k, v in lim.items()
    ]
    length = plan.length_knob(cfg)
    caveat = None
    if lim[length]:
        longest = plan.with_knobs(cfg, machine.world.ranks, **{length: lim[length]})
        caveat = beyond_positions(row_length(longest), model_cfg)
    line = "largest that fit, the other settings as configured: " + ", ".join(parts)
    return line + (f" ({row_length_text(longest)}: {caveat})" if caveat else "")


def context_line(model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem=None) -> str:
    """`megatrain plan`'s answer to "how long may a sequence be on this machine"."""
    found = plan.longest_context(model_cfg, cfg, machine, compute_bytes, layer_mem)
    grpo, pref = cfg.grpo(), cfg.preference()
    what = "longest completion" if grpo else "longest context"
    if found is None:
        return f"{what}: none (not one token per sequence fits)"
    n, p = found
    how = [f"MLP tiles of {p.mlp_tile_tokens:,} tokens" if 0 < p.mlp_tile_tokens < n else "MLP untiled"]
    if p.device == "cuda":
        layers = model_cfg.num_hidden_layers
        how.append(f"{p.parked_layers} of {layers} layers' boundary activations in host memory")
    how.append(f"gradients {p.grad_mode}")
    if p.device == "cuda":
        how.append(f"GPU peak ~{fmt_bytes(p.gpu_peak)}")
    how.append(f"host ~{fmt_bytes(p.host_total)}")
    name = plan.length_knob(cfg)
    longest = plan.with_knobs(cfg, machine.world.ranks, **{name: n}, **plan.smallest_step(cfg))
    caveat = beyond_positions(row_length(longest), model_cfg)
    if grpo:
        step = ", ".join(f"{k}={v}" for k, v in plan.smallest_step(cfg).items())
        line = (
            f"{what}: {n:,} tokens after a prompt of up to {row_length(longest) - n:,} (one completion a step, "
            f"a generation batch of one group: {step}; {', '.join(how)})"
        )
    else:
        step = (
            f"one {cfg.stage} sample per step, {pref.sequences} sequences"
            if pref
            else "one sequence per step"
        )
        line = f"{what}: {n:,} tokens per sequence ({step}; {', '.join(how)})"
    return line + (f"; {caveat}" if caveat else "")
