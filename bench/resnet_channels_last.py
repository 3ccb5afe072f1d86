"""A torchvision-style ResNet-18 in channels_last, trained at fp32 and at O2: does O2 learn?

The model is converted to channels_last before ``prepare`` (as torchvision's recipes do) and
trained on a learnable synthetic task (each class is a fixed random image plus noise) with SGD
and momentum. Prints the smoothed final loss of each run; O2 should track fp32.

    python bench/resnet_channels_last.py [--steps 60] [--batch 32] [--size 32]
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))


def batches(steps, batch, size, classes=10):
    g = torch.Generator().manual_seed(0)
    prototypes = torch.randn(classes, 3, size, size, generator=g)
    for _ in range(steps):
        y = torch.randint(0, classes, (batch,), generator=g)
        x = prototypes[y] + 1.5 * torch.randn(batch, 3, size, size, generator=g)
        yield x.contiguous(memory_format=torch.channels_last), y


def train(level, steps, batch, size):
    torch.manual_seed(0)
    model = ResNet18().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    amp = mp.MixedPrecision(level=level, dtype="bf16")
    model, opt = amp.setup(model, opt)
    losses, start = [], time.perf_counter()
    for x, y in batches(steps, batch, size):
        loss = F.cross_entropy(model(x), y)
        amp.backward(loss)
        amp.step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    tail = losses[-max(steps // 5, 1):]
    return sum(tail) / len(tail), (time.perf_counter() - start) / steps


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=32)
    args = p.parse_args()
    print(f"ResNet-18 channels_last, SGD momentum, {args.steps} steps of {args.batch} "
          f"{args.size}x{args.size} images; smoothed loss over the last fifth")
    for level in ("O0", "O2"):
        loss, sec = train(level, args.steps, args.batch, args.size)
        print(f"{level}: final loss {loss:.3f}  ({sec * 1e3:.0f} ms/step)")


if __name__ == "__main__":
    main()
