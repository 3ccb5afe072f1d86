"""Work per group of tensors, never per tensor: the launches of an unscale, a clip and a step
do not grow with the number of parameter tensors (what a GPU pays per launch, counted on the
CPU as aten ops that are not views or allocations)."""

import pytest
import torch
from testmodels import KernelOps
from torch import nn

import mixprec as mp

CASES = [("bf16", "fp32"), ("bf16", "split"), ("bf16", "kahan"), ("fp16", "fp32"),
         ("fp16", "kahan")]


def _ops(layers: int, dtype: str, master: str, update) -> int:
    """Kernel ops of ``update(amp, model, opt)`` at the third step of a stack of ``layers``
    Linear layers at O2."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    amp = mp.MixedPrecision(level="O2", dtype=dtype, master=master)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(4, 16)
    for step in range(3):
        amp.backward(model(x).float().square().mean())
        counter = KernelOps()
        with counter:
            update(amp, model, opt)
        opt.zero_grad()
    return counter.count


def _clip_folded(amp, model, opt):
    amp.step(opt, max_grad_norm=1.0)


def _unscale_then_torch_clip(amp, model, opt):
    amp.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    amp.step(opt)


def _clip_by_engine(amp, model, opt):
    amp.clip_grad_norm_(opt, 1.0)
    amp.step(opt)


@pytest.mark.parametrize("update", [_clip_folded, _unscale_then_torch_clip, _clip_by_engine],
                         ids=["folded", "unscale-torch-clip", "engine-clip"])
@pytest.mark.parametrize("dtype,master", CASES)
def test_unscale_and_clip_launch_per_group_not_per_tensor(dtype, master, update):
    """A clip folded into the step, ``unscale_`` then torch's clip, and the engine's clip: the
    norm is one ``_foreach_norm`` per device and dtype, the fp32 gradient copies one
    ``_foreach_copy_``: 4 Linear layers (8 tensors) and 16 (32 tensors) run the same ops."""
    assert _ops(4, dtype, master, update) == _ops(16, dtype, master, update)
