"""The models ``mixprec bench`` times: nine-linear (Paddle's AMP benchmark), a ResNet-style
convnet with BatchNorm, and a small GPT-style language model.

Each model comes as a :class:`BenchModel`: a builder, a synthetic batch of fixed shape (reused
every step, so data loading is not timed), a loss, an optimizer factory, and the shape of a GEMM
that is representative of the model (the shape ``doctor``'s matmul probe is run at to give the
"share of matmul peak" column).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["BenchModel", "MODELS", "get_model", "NineLinear", "ConvNet", "TinyGPT", "count_flops"]


class NineLinear(nn.Module):
    """``depth`` Linear layers of ``width`` x ``width`` and nothing else (Paddle's SimpleNet)."""

    def __init__(self, width: int = 2048, depth: int = 9):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return x


class _Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ConvNet(nn.Module):
    """A small ResNet: a 3x3 stem, three stages of two basic blocks (widths w, 2w, 4w), a head."""

    def __init__(self, width: int = 32, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        blocks, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            blocks += [_Block(cin, cout, 1 if i == 0 else 2), _Block(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style causal language model: token + position embeddings, pre-LN blocks, a head.
    Sequences of up to ``MAX_POSITIONS`` tokens (``seq_len`` positions are built)."""

    MAX_POSITIONS = 1024  # GPT-2's n_positions

    def __init__(self, vocab: int = 256, dim: int = 256, depth: int = 4, heads: int = 4,
                 seq_len: int = 128):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim must be divisible by heads; got dim={dim}, heads={heads}")
        if not 1 <= seq_len <= self.MAX_POSITIONS:
            raise ValueError(f"seq_len must be in [1, {self.MAX_POSITIONS}]; got {seq_len}")
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.Sequential(*(_GPTBlock(dim, heads) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """A benchmark model at one size.

    Attributes:
        name: the CLI name.
        build: ``() -> nn.Module`` (fp32, on the CPU, seeded by the caller).
        batch: ``(generator) -> (inputs, target)`` a fixed synthetic batch.
        loss_fn: ``(output, target) -> scalar``.
        make_optimizer: ``(params) -> torch.optim.Optimizer``.
        gemm_shape: ``(m, k, n)`` of a GEMM representative of the model.
        sizes: the size settings used, for the report.
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple]
    loss_fn: Callable
    make_optimizer: Callable
    gemm_shape: tuple[int, int, int]
    sizes: dict


def _nine_linear(width=None, batch=None, depth=None, **_) -> BenchModel:
    w, b, d = width or 2048, batch or 512, depth or 9
    return BenchModel(
        "nine-linear", lambda: NineLinear(w, d),
        lambda g: (torch.rand(b, w, generator=g), torch.rand(b, w, generator=g)),
        F.mse_loss, lambda p: torch.optim.SGD(p, lr=1e-4), (b, w, w),
        {"width": w, "batch": b, "depth": d})


def _convnet(width=None, batch=None, image_size=None, **_) -> BenchModel:
    w, b, s = width or 32, batch or 64, image_size or 32
    return BenchModel(
        "convnet", lambda: ConvNet(w),
        lambda g: (torch.randn(b, 3, s, s, generator=g), torch.randint(0, 10, (b,), generator=g)),
        F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        (b * s * s // 4, 9 * 2 * w, 2 * w), {"width": w, "batch": b, "image_size": s})


def _transformer(width=None, batch=None, depth=None, seq_len=None, **_) -> BenchModel:
    w, b, d, t = width or 256, batch or 16, depth or 4, seq_len or 128
    if t > TinyGPT.MAX_POSITIONS:
        raise ValueError(f"seq_len must be at most {TinyGPT.MAX_POSITIONS}, the positions the "
                         f"transformer model has (GPT-2's n_positions); got {t}")
    heads = max(1, w // 64)

    def batch_fn(g):
        # Arithmetic sequences mod 256 with a random start and stride: learnable next tokens.
        start = torch.randint(0, 256, (b, 1), generator=g)
        stride = torch.randint(1, 8, (b, 1), generator=g)
        seq = (start + stride * torch.arange(t + 1)) % 256
        return seq[:, :-1], seq[:, 1:]

    return BenchModel(
        "transformer", lambda: TinyGPT(256, w, d, heads, t), batch_fn, _lm_loss,
        lambda p: torch.optim.AdamW(p, lr=3e-4), (b * t, w, 4 * w),
        {"width": w, "batch": b, "depth": d, "seq_len": t, "heads": heads})


MODELS: dict[str, Callable[..., BenchModel]] = {
    "nine-linear": _nine_linear,
    "convnet": _convnet,
    "transformer": _transformer,
}


def get_model(name: str, **sizes) -> BenchModel:
    """The benchmark model ``name`` at the given sizes (None keeps a default).

    Raises:
        ValueError: an unknown model name, a size the model does not have, or a non-positive
            size.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    takes = [p for p in inspect.signature(MODELS[name]).parameters
             if p != "_" and not p.startswith("*")]
    for key, value in sizes.items():
        if value is None:
            continue
        if key not in takes:  # (it was ignored, silently)
            raise ValueError(f"the {name} model has no {key} (its sizes: {', '.join(takes)}); "
                             f"got {key}={value!r}")
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer; got {value!r}")
    return MODELS[name](**sizes)


def count_flops(bm: BenchModel) -> int:
    """FLOPs of one forward + backward of ``bm`` counted by ``torch.utils.flop_counter``.

    The model runs on the meta device, so nothing is computed. Counts matmul, conv and
    attention FLOPs (2 per multiply-add); elementwise ops are not counted.
    """
    with torch.device("meta"):
        model = bm.build()
    inputs, target = bm.batch(torch.Generator().manual_seed(0))
    inputs, target = inputs.to("meta"), target.to("meta")
    with FlopCounterMode(display=False) as counter:
        bm.loss_fn(model(inputs), target).backward()
    return int(counter.get_total_flops())


def params_count(model: nn.Module) -> int:
    """Number of parameters of ``model``."""
    return sum(math.prod(p.shape) for p in model.parameters())
