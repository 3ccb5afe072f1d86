"""Small models shared by the tests: MLPs, a CNN with BatchNorm, a transformer block; an op
counter."""

import torch
from torch import nn


def mlp(d_in=16, hidden=32, d_out=4):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, d_out))


def norm_mlp(norm=nn.LayerNorm):
    """Linear, a norm layer, ReLU, Linear (8 -> 16 -> 4), the same weights every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), norm(16), nn.ReLU(), nn.Linear(16, 4))


def regression_batch(i: int, n: int = 8):
    """Inputs and targets for :func:`norm_mlp`, the same for the same ``i``."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


class SmallCNN(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x))) + x
        return self.head(x.mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=32, d=16, heads=2, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, heads, dim_feedforward=32, dropout=0.0,
                                                batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        h = self.norm(self.block(self.embed(tokens)))
        return self.head(h.mean(dim=1))


def make(name):
    """(model, input batch, integer targets) for a model name."""
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return mlp(), torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    if name == "cnn":
        return (SmallCNN(), torch.randn(4, 3, 8, 8, generator=g),
                torch.randint(0, 4, (4,), generator=g))
    if name == "transformer":
        return (TinyTransformer(), torch.randint(0, 32, (4, 6), generator=g),
                torch.randint(0, 4, (4,), generator=g))
    raise ValueError(name)


class KernelOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops inside the block that launch work (not views, allocations or profiler
    marks): what a GPU pays per launch."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not (func.is_view or name.startswith(("profiler::", "aten::empty"))
                or name in ("aten::detach", "aten::lift_fresh", "aten::unbind",
                            "aten::split_with_sizes")):
            self.count += 1
        return func(*args, **(kwargs or {}))
