"""A 42M-parameter Llama-like stack and the training rows that the step benchmarks compare.

The model: token embedding, ``layers`` pre-norm blocks (``nn.RMSNorm``, causal attention
without bias through ``scaled_dot_product_attention``, no rotary embedding, a SwiGLU MLP), a
final RMSNorm and an untied head. The defaults (width 512, 10 blocks, MLP 1536, 8 heads, a
vocabulary of 8192) hold 42.5M parameters; with 64 tokens a micro-batch the step is bound by
the weights, not the matmuls.

A row is one way to train it: ``make(row)`` returns a :class:`Trainee` whose ``step()`` runs
``MICRO`` micro-batches forward and backward, accumulating gradients, then the optimizer step
and ``zero_grad``. Every row uses AdamW with lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay
0.01 (optimi's and torchao's AdamW are given the same).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

MICRO = 4
TOKENS = 64
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BF16 = torch.bfloat16


class _Attention(nn.Module):
    """Causal multi-head attention without bias (no rotary embedding)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, tokens, 3 * dim) -> three (batch, heads, tokens, head_dim)
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        return self.o(out.transpose(1, 2).flatten(2))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = _Attention(dim, heads)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaLike(nn.Module):
    """A Llama-shaped causal language model (see the module docstring)."""

    def __init__(self, vocab: int = 8192, dim: int = 512, layers: int = 10, heads: int = 8,
                 hidden: int = 1536):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*(_Block(dim, heads, hidden) for _ in range(layers)))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(idx))))


def batches(vocab: int = 8192, micro: int = MICRO, tokens: int = TOKENS):
    """``micro`` fixed micro-batches of one sequence of ``tokens`` tokens: (inputs, targets)."""
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, vocab, (micro, 1, tokens + 1), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


@dataclasses.dataclass
class Trainee:
    """A model, its optimizer and the functions that run one accumulated step of its row."""

    model: nn.Module
    optimizer: object
    step: Callable[[], float]  # one training step; returns the loss of its last micro-batch
    timed_update: Callable[[], float] | None = None  # seconds of the last step's update


def _loop(model, data, forward, backward, update, zero_grad) -> Trainee:
    spent = [0.0]

    def step() -> float:
        for inputs, target in data:
            loss = forward(inputs, target) / len(data)
            backward(loss)
        start = time.perf_counter()
        update()
        spent[0] = time.perf_counter() - start
        zero_grad()
        return float(loss.detach()) * len(data)
    return Trainee(model, None, step, lambda: spent[0])


def _torch_row(model, opt, data, autocast: bool) -> Trainee:
    def forward(inputs, target):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            return lm_loss(model(inputs), target)
    trainee = _loop(model, data, forward, lambda loss: loss.backward(), opt.step,
                    lambda: opt.zero_grad(set_to_none=True))
    trainee.optimizer = opt
    return trainee


def _mixprec_row(model, data, master=None, state_dtype=None) -> Trainee:
    import mixprec as mp

    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    amp = mp.MixedPrecision(level="O2", dtype="bf16", master=master, state_dtype=state_dtype)
    model, opt = amp.setup(model, opt)
    trainee = _loop(model, data, lambda i, t: lm_loss(model(i), t), amp.backward,
                    lambda: amp.step(opt), lambda: opt.zero_grad(set_to_none=True))
    trainee.optimizer = opt
    return trainee


def _autocast(model, data):
    opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
    return _torch_row(model, opt, data, autocast=True)


def _optimi_kahan(model, data):
    from optimi import AdamW  # the bench extra's torch-optimi

    model.to(BF16)
    opt = AdamW(model.parameters(), lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                weight_decay=HYPER["weight_decay"], kahan_sum=True)
    return _torch_row(model, opt, data, autocast=False)


def _torchao_sr(model, data):
    from torchao.optim import _AdamW

    model.to(BF16)
    opt = _AdamW(model.parameters(), **HYPER, bf16_stochastic_round=True)
    return _torch_row(model, opt, data, autocast=False)


#: row name -> (description, builder(model, data) -> Trainee)
ROWS: dict[str, tuple[str, Callable]] = {
    "autocast": ("`torch.autocast` bf16, torch's fused AdamW on fp32 params", _autocast),
    "O2": ("O2 bf16, fp32 masters", _mixprec_row),
    "O2-bf16": ('O2 bf16, fp32 masters, `state_dtype="bf16"`',
                lambda m, d: _mixprec_row(m, d, None, "bf16")),
    "split": ('O2 `master="split"`', lambda m, d: _mixprec_row(m, d, "split")),
    "kahan": ('O2 `master="kahan"`, fp32 moments', lambda m, d: _mixprec_row(m, d, "kahan")),
    "kahan-bf16": ('O2 `master="kahan"`, `state_dtype="bf16"`',
                   lambda m, d: _mixprec_row(m, d, "kahan", "bf16")),
    "optimi-kahan": ("optimi `AdamW(kahan_sum=True)`, bf16 model (bf16 moments)",
                     _optimi_kahan),
    "stochastic": ('O2 `master="stochastic"`, fp32 moments',
                   lambda m, d: _mixprec_row(m, d, "stochastic")),
    "stochastic-bf16": ('O2 `master="stochastic"`, `state_dtype="bf16"`',
                        lambda m, d: _mixprec_row(m, d, "stochastic", "bf16")),
    "torchao-sr": ("torchao `_AdamW(bf16_stochastic_round=True)`, bf16 model (bf16 moments)",
                   _torchao_sr),
}


def make(row: str, **sizes) -> Trainee:
    """The model of ``sizes`` (seeded), trained as ``row``."""
    if row not in ROWS:
        raise ValueError(f"unknown row {row!r}; choose one of {', '.join(ROWS)}")
    torch.manual_seed(0)
    model = LlamaLike(**sizes)
    return ROWS[row][1](model, batches(vocab=model.embed.num_embeddings))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
