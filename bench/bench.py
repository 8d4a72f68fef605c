"""megatrain vs DeepSpeed ZeRO-3 offload vs GPU-resident PyTorch, one invocation.

Every (system, tokens per step) runs in its own worker process (bench/_systems.py) with a timeout,
so an out-of-memory kill or a crash of one cannot take the others down, and host memory is
measured per system. Results are written after every run (JSON, Markdown, PNG in --out), so a run
cut short still leaves what it measured. See bench/README.md for the columns and formulas.

    python bench/bench.py --model A --tokens-per-step 16384,65536
    python bench/bench.py --smoke          # tiny model; on a CPU-only host megatrain runs on CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402  (a sibling module; bench/ is not a package)
from _shapes import DENSE_SHAPES, MOE_SHAPES, inactive_params, is_moe  # noqa: E402
from _shapes import model_config as shape_config  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORKER = BENCH / "_systems.py"
# megatrain-host: megatrain with every weight and moment kept in host memory (gpu_state=off).
SYSTEMS = ("megatrain", "megatrain-host", "deepspeed", "resident")
SHAPE_KEYS = ("hidden", "layers", "heads", "kv", "ffn", "vocab")
MODELS: dict[str, dict] = {**DENSE_SHAPES, **MOE_SHAPES}


def parse_tokens(text: str) -> list[int]:
    """`16384,65536` or `16k,64k`."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, choices=sorted(MODELS), help="shape preset (default A)")
    for k in SHAPE_KEYS:
        ap.add_argument(f"--{k}", type=int, default=None, help=f"override the preset's {k}")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 4096)")
    ap.add_argument("--tokens-per-step", default=None, help="comma list, e.g. 16384,65536 or 16k,64k")
    ap.add_argument("--mbs", type=int, default=None, help="sequences per micro-batch (default 16384/seq)")
    ap.add_argument("--ds-mbs", type=int, default=None, help="DeepSpeed micro-batch (default --mbs)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps incl. warm-up (default 7)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps excluded (default 3)")
    ap.add_argument(
        "--systems",
        default="megatrain,resident,deepspeed",
        help="comma list, run in this order (default: the slow, crash-prone DeepSpeed last)",
    )
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per system run")
    ap.add_argument(
        "--deadline", type=float, default=560.0, help="seconds for the whole invocation; 0 = none"
    )
    ap.add_argument(
        "--max-host-memory",
        default=None,
        help="megatrain's host budget, e.g. 480GiB (hosts whose MemTotal grows as memory is used)",
    )
    ap.add_argument(
        "--max-gpu-memory", default=None, help="megatrain's GPU budget, e.g. 70GiB (an 80 GB card's)"
    )
    ap.add_argument(
        "--gpu-step-units",
        default="0",
        help="megatrain's gpu_step_units: streamed units stepped on the GPU (a number, or auto)",
    )
    ap.add_argument(
        "--keep-layers",
        type=int,
        default=None,
        help="megatrain's kept layer graphs (the last N layers not recomputed; default: the plan's)",
    )
    ap.add_argument(
        "--optim",
        default="adamw_torch",
        help="megatrain's optim (Hugging Face's names): adamw_torch (fp32 moments), adamw_8bit; bf16 "
        "moments are adamw_anyprecision with --optim-args momentum_dtype=bfloat16,variance_dtype=bfloat16",
    )
    ap.add_argument("--optim-args", default=None, help="megatrain's optim_args")
    ap.add_argument(
        "--update-order",
        default="auto",
        choices=("auto", "layer", "micro_batch"),
        help="megatrain's update_order",
    )
    ap.add_argument(
        "--fetch-both-halves",
        action="store_true",
        help="in bf16, fetch both of the master's halves (4 B a parameter, as the fp32 master did before "
        "the halves) and keep their hi: the same weights, the bytes of before, for comparison",
    )
    ap.add_argument(
        "--embedding-rows",
        nargs="?",
        const="true",
        default="auto",
        choices=("auto", "true", "false"),
        help="megatrain's embedding_rows: step the embedding in host memory, fetch the rows a step "
        "looks up (default auto: where the plan says it pays; alone: true)",
    )
    ap.add_argument(
        "--full-determinism",
        action="store_true",
        help="megatrain's full_determinism: PyTorch's strict deterministic mode for its runs",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="keep each run's profiled step as a gzipped Chrome trace in the logs folder",
    )
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (CPU allowed)")
    a = ap.parse_args(argv)
    smoke = dict(model="tiny", seq=128, tokens_per_step="256,512", mbs=1, steps=5, warmup=3, tag="smoke")
    # Warm-up 3: megatrain decides GPU-resident state after step 1 and kept layers at step 3.
    normal = dict(model="A", seq=4096, tokens_per_step="16384,65536", mbs=None, steps=7, warmup=3, tag=None)
    for k, v in (smoke if a.smoke else normal).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.shape = {**MODELS[a.model], **{k: getattr(a, k) for k in SHAPE_KEYS if getattr(a, k) is not None}}
    a.custom = any(getattr(a, k) is not None for k in SHAPE_KEYS)
    a.tokens = parse_tokens(a.tokens_per_step)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in a.systems if s not in SYSTEMS]
    if bad:
        ap.error(f"--systems: unknown {bad} (choose from {', '.join(SYSTEMS)})")
    if a.mbs is None:
        a.mbs = max(1, 16384 // a.seq)
    if not 0 <= a.warmup < a.steps:
        ap.error("--warmup must be >= 0 and < --steps")
    for t in a.tokens:
        if t <= 0 or t % a.seq:
            ap.error(f"--tokens-per-step {t} is not a positive multiple of --seq {a.seq}")
        for m in (a.mbs, a.ds_mbs or a.mbs):
            if (t // a.seq) % min(m, t // a.seq):
                ap.error(f"{t // a.seq} sequences per step do not split into micro-batches of {m}")
    if a.shape["hidden"] % a.shape["heads"] or a.shape["heads"] % a.shape["kv"]:
        ap.error("hidden must be a multiple of heads, and heads a multiple of kv")
    if a.tag is None:
        a.tag = f"{'custom' if a.custom else a.model}_" + "-".join(f"{t // 1024}k" for t in a.tokens)
    return a


# ------------------------------------------------------------------------------------ accounting
def param_counts(m: dict) -> dict[str, int]:
    """Parameters of an untied Llama of this shape (no biases), as megatrain counts them; of an
    MoE shape (router, experts, q/k norms), with `params_nonembedding` those a token passes through."""
    h, d = m["hidden"], m.get("head_dim") or m["hidden"] // m["heads"]
    embed = lm_head = m["vocab"] * h
    if is_moe(m):  # counted on megatrain's templates of the shape (tested against transformers)
        nonemb = shape_config(m).num_params - embed - lm_head
    else:
        attn = h * m["heads"] * d * 2 + 2 * h * m["kv"] * d
        nonemb = m["layers"] * (attn + 3 * h * m["ffn"] + 2 * h) + h  # decoder layers + final norm
    return {
        "params": embed + lm_head + nonemb,
        "params_nonembedding": nonemb - inactive_params(m),
        "lm_head": lm_head,
    }


def hw_flops(m: dict[str, int], seq: int, tokens: int, kept: int = 0) -> float:
    """Matmul FLOPs the GPU executes per optimizer step when every layer but the last `kept`
    is recomputed: layers 2NT forward + 2NT recompute + 4NT backward; attention (causal) A
    forward, A recompute, 2A backward; LM head 2 forward + 4 backward per token, never recomputed."""
    pc = param_counts(m)
    q_dim = m["heads"] * (m.get("head_dim") or m["hidden"] // m["heads"])
    attn_fwd = 4 * seq * seq * q_dim * m["layers"] * 0.5 * (tokens // seq)
    fwd = 2 * pc["params_nonembedding"] * tokens + attn_fwd  # one forward pass of all layers
    recompute = fwd * (m["layers"] - kept) / m["layers"]
    return 3 * fwd + recompute + 6 * pc["lm_head"] * tokens


def derive(rec: dict[str, Any], shape: dict[str, int]) -> None:
    """Fill the derived metrics of one record from its raw measurements."""
    gib = 2**30
    for raw, out in (("host_peak_rss_bytes", "host_peak_rss_gib"), ("gpu_peak_bytes", "gpu_peak_gib")):
        rec[out] = rec[raw] / gib if rec.get(raw) else None
    rec["host_sys_peak_gib"] = rec["host_sys_peak_bytes"] / gib if rec.get("host_sys_peak_bytes") else None
    rec["bytes_per_param"] = (
        rec["host_peak_rss_bytes"] / rec["params"] if rec.get("host_peak_rss_bytes") else None
    )
    step = rec.get("step_s")
    ok = rec.get("error") is None and step
    T = rec["tokens_per_step"]
    rec["tokens_per_s"] = T / step if ok else None
    active = rec["params"] - inactive_params(shape)  # MoE: the experts a token passes through
    rec["model_tflops"] = 6 * active * T / step / 1e12 if ok else None
    kept = rec.get("keep_layers") or 0  # megatrain's kept layer graphs skip their recompute
    rec["hw_tflops"] = hw_flops(shape, rec["seq_len"], T, kept) / step / 1e12 if ok else None
    for d in ("h2d", "d2h"):
        b = rec.get(f"{d}_bytes_per_step")
        rec[f"{d}_gbps"] = b / step / 1e9 if ok and b is not None else None
    for k in ("gpu_busy", "opt_s", "step_s"):
        rec.setdefault(k, None)
    rec.setdefault("step_times", [])


# ------------------------------------------------------------------------------------ host facts
def meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def mem_used_bytes() -> int:
    """System-wide used memory: sees pinned/driver allocations that a process RSS may not."""
    m = meminfo()
    return m.get("MemTotal", 0) - m.get("MemAvailable", 0)


def gpu_name() -> str | None:
    """From nvidia-smi, so this process never creates a CUDA context of its own."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        return out.splitlines()[0].strip() if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ workers
def _terminate(pid: int) -> tuple[int, Any]:
    """SIGTERM the worker's process group, then SIGKILL; reap it with its resource usage."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 60.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            p, status, ru = os.wait4(pid, os.WNOHANG)
            if p:
                return status, ru
            time.sleep(0.2)
    _, status, ru = os.wait4(pid, 0)
    return status, ru


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_worker(spec: dict[str, Any], timeout: float, log_path: Path) -> dict[str, Any]:
    """Run one system in a fresh process; return its raw record (never raises for its failures)."""
    work = Path(tempfile.mkdtemp(prefix="megatrain-bench-"))
    spec = dict(spec, result_path=str(work / "result.json"))
    (work / "spec.json").write_text(json.dumps(spec))
    env = os.environ.copy()  # inherits PYTHONPATH (e.g. the DeepSpeed wheels) and CUDA settings
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if spec["system"] == "deepspeed" and "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(free_port())  # a lingering socket of a previous run cannot clash
    base = peak = mem_used_bytes()
    t0 = time.monotonic()
    timed_out = False
    cmd = [sys.executable, str(WORKER), str(work / "spec.json")]
    if spec.get("nproc", 1) > 1:  # data parallel: every rank a worker, started by torchrun
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['nproc']}"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,  # its own process group: a timeout kills all it spawned
        )
    try:
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, mem_used_bytes())
            if time.monotonic() - t0 > timeout:
                timed_out = True
                status, ru = _terminate(proc.pid)
                break
            time.sleep(0.2)
    except BaseException:  # Ctrl-C or a bug here: never leave a worker holding the GPU
        _terminate(proc.pid)
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, not by Popen
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (compilers, helpers)
    wall = time.monotonic() - t0
    try:
        raw = json.loads((work / "result.json").read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}
    shutil.rmtree(work, ignore_errors=True)
    raw.update(wall_s=wall, returncode=proc.returncode, host_sys_peak_bytes=max(0, peak - base))
    raw["host_peak_rss_bytes"] = max(raw.get("host_peak_rss_bytes") or 0, ru.ru_maxrss * 1024) or None
    own = raw.get("error")  # the worker's own diagnosis, if it lived to write one
    if timed_out:
        raw["error"] = f"timeout after {timeout:.0f} s" + (f" ({own})" if own else "")
    elif own:
        pass
    elif proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        why = " (host out of memory? the OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
        raw["error"] = f"killed by {name}{why}"
    elif proc.returncode != 0:
        raw["error"] = f"worker exited with code {proc.returncode}"
    elif "step_s" not in raw:
        raw["error"] = "worker wrote no result"
    if raw.get("error") and not own:
        raw["error_detail"] = _tail(log_path)
    return raw


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    start = time.monotonic()
    now = dt.datetime.now().astimezone()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y-%m-%d_%H%M}_{a.tag}"
    logs = out / f"{stem}_logs"
    logs.mkdir(exist_ok=True)
    mem = meminfo()
    host = f"{os.cpu_count()} CPU cores, {mem.get('MemTotal', 0) / 2**30:.0f} GiB host RAM"
    gpu = gpu_name()
    pc = param_counts(a.shape)
    meta = {
        "command": "python " + shlex.join(sys.argv if argv is None else ["bench/bench.py", *argv]),
        "date": now.isoformat(timespec="seconds"),
        "device": f"{gpu or 'no GPU'}; {host}",
        "model": "custom" if a.custom else a.model,
        "shape": a.shape,
        "params": pc["params"],
        "seq_len": a.seq,
        "stem": stem,
    }
    print(
        f"# {meta['command']}\n# {meta['device']}\n# model {meta['model']} {a.shape}, "
        f"{pc['params']:,} params, seq {a.seq}; outputs {out / stem}.*",
        flush=True,
    )
    records: list[dict[str, Any]] = []
    runs = [(t, s) for t in a.tokens for s in a.systems]
    for i, (tokens, system) in enumerate(runs):
        mbs = min((a.ds_mbs or a.mbs) if system == "deepspeed" else a.mbs, tokens // a.seq)
        rec: dict[str, Any] = {
            "system": system,
            "model": meta["model"],
            **pc,
            "seq_len": a.seq,
            "tokens_per_step": tokens,
            "mbs": mbs,
            "steps": a.steps,
            "warmup": a.warmup,
            "date": meta["date"],
            "command": meta["command"],
            "log": f"{logs.name}/{system}_{tokens}.log",  # relative to --out
            "error": None,
        }
        # Leave 20 s of the deadline for writing results and killing a late worker.
        left = a.deadline - (time.monotonic() - start) - 20 if a.deadline else float("inf")
        timeout = min(a.timeout, left)
        print(
            f"[{i + 1}/{len(runs)}] {system} tokens/step={tokens} mbs={mbs} "
            f"timeout={max(0, timeout):.0f}s ...",
            flush=True,
        )
        if left < 30:
            rec["error"] = f"skipped: --deadline {a.deadline:.0f} s reached"
        else:
            spec = {
                "system": system,
                "shape": a.shape,
                "seq": a.seq,
                "tokens_per_step": tokens,
                "mbs": mbs,
                "steps": a.steps,
                "warmup": a.warmup,
                "smoke": a.smoke,
                "max_host_memory": a.max_host_memory,
                "max_gpu_memory": a.max_gpu_memory,
                "gpu_step_units": a.gpu_step_units,
                "embedding_rows": a.embedding_rows,
                "optim": a.optim,
                "optim_args": a.optim_args,
                "keep_layers": a.keep_layers,
                "update_order": a.update_order,
                "fetch_both_halves": a.fetch_both_halves,
                "full_determinism": a.full_determinism,
                "trace": str(out / rec["log"]).removesuffix(".log") + ".trace.json.gz" if a.trace else None,
            }
            raw = run_worker(spec, timeout, out / rec["log"])
            counted = raw.pop("params", None)
            if counted is not None and counted != pc["params"]:
                raw["params_note"] = f"worker counted {counted} parameters"
            rec.update(raw)
        rec["device"] = f"{rec.get('gpu') or gpu or 'no GPU'}; {host}"
        derive(rec, a.shape)
        records.append(rec)
        _report.add_ratios(records)
        if rec["error"]:
            print(f"    FAILED: {rec['error']}", flush=True)
            if rec.get("error_detail"):
                print("    | " + "\n    | ".join(rec["error_detail"].splitlines()[-12:]), flush=True)
        else:
            print(
                f"    {rec['step_s']:.3f} s/step, {rec['tokens_per_s']:,.0f} tokens/s, "
                f"{rec['model_tflops']:.1f} model TFLOP/s ({rec['wall_s']:.0f} s)",
                flush=True,
            )
        _report.write_all(records, meta, out / stem)  # after every run: partial results survive
    print()
    print(_report.text_table(records))
    print(f"\nwrote {out / stem}.json .md .png (logs in {logs})")
    return 0  # a failed system is a result (recorded in the table), not a failure of the bench


if __name__ == "__main__":
    sys.exit(main())
