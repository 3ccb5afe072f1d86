"""The models and rows of ``bench/gpu_check.py`` (``make gpu-check``): config-built Hugging Face
models at their GPU sizes (or tiny ones for a smoke run), and one training-step function per row.

Rows: ``fp32``; ``autocast`` (bf16) and ``autocast-fp16`` (+ ``torch.amp.GradScaler``);
mixprec ``O1``, ``O2``, ``O3``, ``split`` and ``kahan`` (O2 with compact masters), ``O2-fp16``,
``O2-fp8`` (O2 bf16 with torchao FP8 tensorwise layers, mixprec's default choice of layers); and
``torchao-fp8``: torchao used directly (``convert_to_float8_training`` on the same layers, then
``torch.autocast`` bf16). Every row trains with AdamW (torch's fused kernel on CUDA; mixprec's
O2 steps its fp32 masters with it) through ``mp.MixedPrecision`` for mixprec's rows.
"""

from __future__ import annotations

import torch
from torch import nn

import mixprec as mp

ROWS = ("fp32", "autocast", "O1", "O2", "O3", "split", "kahan", "autocast-fp16", "O2-fp16",
        "O2-fp8", "torchao-fp8")
FP8_ROWS = ("O2-fp8", "torchao-fp8")

# GPU sizes, and the tiny ones of ``--tiny`` (a few seconds on a CPU)
MODELS = {
    "gpt2": dict(kind="gpt2", layers=12, width=768, heads=12, ffn=3072, vocab=50257, seq=1024,
                 batch=8, label="GPT-2 124M"),
    "llama": dict(kind="llama", layers=8, width=1024, heads=16, ffn=2816, vocab=32000,
                  seq=1024, batch=8, label="Llama d=1024, 8 layers, 32k vocab"),
    "llama4096": dict(kind="llama", layers=4, width=4096, heads=32, ffn=11008, vocab=32000,
                      seq=1024, batch=8, label="Llama d=4096 (7B layers), 4 layers"),
}
TINY = {"layers": 1, "width": 32, "heads": 2, "ffn": 64, "vocab": 128, "seq": 16, "batch": 2}


def size_of(name: str, tiny: bool) -> dict:
    size = dict(MODELS[name])
    if tiny:
        size.update(TINY, label=size["label"] + " (tiny)")
    return size


def build(size: dict) -> nn.Module:
    """The config-built model of ``size`` (fp32, on the CPU)."""
    import transformers  # optional: the benchmark's only
    if size["kind"] == "gpt2":
        cfg = transformers.GPT2Config(n_layer=size["layers"], n_embd=size["width"],
                                      n_head=size["heads"], n_inner=size["ffn"],
                                      vocab_size=size["vocab"], n_positions=size["seq"],
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=size["layers"], hidden_size=size["width"],
                                   num_attention_heads=size["heads"],
                                   num_key_value_heads=size["heads"],
                                   intermediate_size=size["ffn"], vocab_size=size["vocab"],
                                   max_position_embeddings=size["seq"])
    return transformers.LlamaForCausalLM(cfg)


def fp8_problem(device: torch.device) -> str | None:
    """Why the FP8 rows cannot run here, or None."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return f"FP8 GEMMs need compute capability 8.9+; {torch.cuda.get_device_name(device)}"
    try:
        mp.fp8.require()
    except ImportError:
        return "torchao is not installed here (bring a wheel in .whl/ for make gpu-check)"
    return None


def _torchao_names(model: nn.Module, device: torch.device) -> set[str]:
    """The layers mixprec's default FP8 choice takes: every Linear except the first and the
    last, dimensions multiples of 16, and on CUDA torchao's own shape filter."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    names = {n for n, m in linears[1:-1]
             if m.in_features % 16 == 0 and m.out_features % 16 == 0}
    if device.type == "cuda":
        from torchao.float8 import _auto_filter_for_recipe  # optional
        keep = _auto_filter_for_recipe("tensorwise", [])
        names = {n for n, m in linears if n in names and keep(m, n)}
    return names


def make_row(row: str, size: dict, device: torch.device, compile: bool):
    """``(step, model)``: ``step(ids)`` runs forward, loss, backward and update; returns the
    loss (a tensor: no host sync)."""
    if row not in ROWS:
        raise ValueError(f"unknown row {row!r}; rows are {', '.join(ROWS)}")
    torch.manual_seed(0)
    model = build(size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    amp, scaler, dtype = None, None, None
    if row in ("autocast", "torchao-fp8"):
        dtype = torch.bfloat16
    elif row == "autocast-fp16":
        dtype = torch.float16
        scaler = torch.amp.GradScaler(device.type)
    if row == "torchao-fp8":
        from torchao.float8 import convert_to_float8_training  # optional
        names = _torchao_names(model, device)
        convert_to_float8_training(model, module_filter_fn=lambda m, n: n in names)
    elif row != "fp32" and dtype is None:
        level = row if row in ("O1", "O2", "O3") else "O2"
        kw = {"master": row} if row in ("split", "kahan") else {}
        if row == "O2-fp8":
            kw["fp8"] = "tensorwise"
        amp = mp.MixedPrecision(level, "fp16" if row == "O2-fp16" else "bf16", **kw)
        model, opt = amp.setup(model, opt)
    forward = torch.compile(model) if compile else model

    def step(ids):
        if dtype is not None:
            with torch.autocast(device.type, dtype=dtype):
                loss = forward(input_ids=ids, labels=ids).loss
        else:
            loss = forward(input_ids=ids, labels=ids).loss
        if amp is not None:
            amp.backward(loss)
            amp.step(opt)
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step, model
