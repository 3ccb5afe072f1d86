"""Probe CUDA facts mixprec's defaults rest on (run on a GPU machine; prints what it finds).

1. what torch.autocast does with F.rms_norm on CUDA (output dtype, error vs fp32);
2. whether CUDA's layer_norm/group_norm take bf16 activations with fp32 parameters, and how
   far that is from normalising the fp32 upcast and rounding;
3. the cost of mixprec's op-list mode per forward+backward of a small GPT (interleaved).
"""

import statistics
import time

import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec.benchmodels import TinyGPT

dev = "cuda"
torch.manual_seed(0)
x = torch.randn(64, 512, device=dev) * 3 + 1
w = torch.randn(512, device=dev)
b = torch.randn(512, device=dev)

with torch.autocast("cuda", dtype=torch.bfloat16):
    out = F.rms_norm(x.bfloat16(), (512,), w)
ref = F.rms_norm(x.bfloat16().float(), (512,), w)
print("rms_norm under CUDA autocast:", out.dtype, "max rel err vs fp32",
      ((out.float() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item())

xb = x.bfloat16()
for name, fn, args in (("layer_norm", F.layer_norm, ((512,), w, b)),
                       ("group_norm", F.group_norm, (8, w, b))):
    try:
        mixed = fn(xb, *args)
        exact = fn(xb.float(), *args)
        ulp = exact.abs().clamp_min(2 ** -126) * 2 ** -7
        within = ((mixed.float() - exact.to(torch.bfloat16).float()).abs() <= ulp).float().mean()
        print(f"{name} bf16 input, fp32 params: ok, out {mixed.dtype}, share within 1 ulp of the "
              f"rounded fp32 result {within.item():.4f}")
    except RuntimeError as exc:
        print(f"{name} bf16 input, fp32 params: refused ({str(exc)[:80]})")


def step_time(model, tokens, reps=30):
    for _ in range(5):
        model(tokens).float().sum().backward()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        model(tokens).float().sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


tokens = torch.randint(0, 256, (16, 128), device=dev)
rows = {}
for label, kw in (("O1, op lists extended", {}), ("O1, torch's lists only", {"fp32_ops": ()})):
    torch.manual_seed(0)
    model = TinyGPT().to(dev)
    model = mp.prepare(model, level="O1", dtype="bf16", **kw)
    rows[label] = model
ctx_extended = rows["O1, op lists extended"].forward.context
rows["O1, torch's lists only"].forward.context = type(ctx_extended)(
    ctx_extended.device_type, ctx_extended.dtype, True, True, (), False)
torch.manual_seed(0)
plain = TinyGPT().to(dev)


def autocast_model(tokens):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return plain(tokens)


for _ in range(3):
    for label, model in (*rows.items(), ("torch.autocast", autocast_model)):
        print(f"{label:24s} {step_time(model, tokens):.2f} ms")
