"""Scratch: time megatrain steps on a Llama shape, with a breakdown."""
import argparse, os, time, json, sys
import torch
sys.path.insert(0, os.getcwd())
from transformers import LlamaConfig
from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model
from megatrain.optim import AdamWConfig
from megatrain.batch import MicroBatch

ap = argparse.ArgumentParser()
for k, v in dict(hidden=3072, layers=28, heads=24, kv=8, ffn=8192, vocab=128256, seq=4096, mbs=4, tokens=16384, steps=4, overlap=1).items():
    ap.add_argument(f"--{k}", type=int, default=v)
a = ap.parse_args()
hf = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv,
                 intermediate_size=a.ffn, vocab_size=a.vocab, max_position_embeddings=a.seq, rope_theta=500000.0)
cfg = ModelConfig.from_hf(hf)
t = time.time()
m = build_model(cfg, seed=0, device="cuda", compute_dtype="bfloat16", adamw=AdamWConfig(lr=1e-5, betas=(0.9, 0.95)), overlap=bool(a.overlap))
N = m.state.num_params
print(f"built {N/1e9:.2f}B in {time.time()-t:.1f}s", flush=True)
nseq = a.tokens // a.seq
def batch():
    out = []
    for i in range(0, nseq, a.mbs):
        ids = torch.randint(0, a.vocab, (min(a.mbs, nseq - i), a.seq))
        out.append(MicroBatch(ids, ids.clone()))
    return out
e = m.engine
# optimizer alone
g = torch.zeros(max(u.numel for u in m.state.units))
t = time.time()
for u in m.state.units:
    m.optimizer.step_range(u, 0, u.numel, g[: u.numel], 0.0, 1)
opt_s = time.time() - t
print(f"cpu adamw alone: {opt_s:.2f}s = {N/opt_s/1e9:.2f} G params/s (threads {torch.get_num_threads()})", flush=True)
times = []
t_last = time.perf_counter()
for step in range(a.steps):
    mbs = batch()
    t0 = time.perf_counter()
    loss, n = e.forward_backward(mbs)
    norm, coef = e.clip_grad_norm(1.0)
    nv = norm.item()
    t1 = time.perf_counter()
    e.step(1e-5, coef)
    now = time.perf_counter(); dt = now - t_last; t_last = now
    times.append(dt)
    print(json.dumps(dict(step=step, loss=round(loss.item(), 4), norm=round(nv, 3), step_s=round(dt, 3), fb_s=round(t1 - t0, 3),
          tok_s=round(a.tokens / dt), tflops=round(6 * N * a.tokens / dt / 1e12, 1),
          gpu_peak=round(torch.cuda.max_memory_allocated() / 2**30, 1))), flush=True)
t = time.perf_counter(); m.transport.synchronize(); print(f"tail sync {time.perf_counter()-t:.2f}s")
# serial breakdown of one step
m.transport.synchronize()
torch.cuda.synchronize(); t0 = time.perf_counter()
loss, n = e.forward_backward(batch()); torch.cuda.synchronize(); t1 = time.perf_counter()
norm, coef = e.clip_grad_norm(1.0); norm.item(); e.step(1e-5, coef); m.transport.synchronize(); t2 = time.perf_counter()
print(f"serialised: forward+backward {t1-t0:.3f}s, update {t2-t1:.3f}s")
with open("/proc/self/status") as f:
    rss = [l for l in f if l.startswith("VmHWM")][0].split()[1]
print(f"host peak RSS {int(rss)/2**20:.1f} GiB = {int(rss)*1024/N:.1f} B/param")
m.close()
