"""8-bit and 4-bit optimizer states from torchao and bitsandbytes as inner optimizers.

Each library's optimizer steps the same fixed gradient sequence twice: unwrapped, on an fp32
copy of the weight (the reference), and inside a mixprec master step on a bf16 weight. With fp32
masters the inner optimizer sees exactly the reference's tensors, so the masters equal the
reference bitwise; with Kahan compensation the compensated value stays within 1e-5 of it (the
bf16 pair's precision over a few steps); with stochastic rounding within a few bf16 ulps of the
weights' scale (5 * 2**-10 for |w| <= 1/8). Bytes per parameter are measured from the states
the libraries hold (quantized codes, block scales, maps).
"""

import dataclasses

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.optim import CompactMasterOptimizer

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning",
    "ignore::UserWarning:torchao.*", "ignore::DeprecationWarning:torchao.*",
    "ignore::FutureWarning:torchao.*", "ignore::UserWarning:bitsandbytes.*",
    "ignore::DeprecationWarning:bitsandbytes.*")

TOL = {"kahan": 1e-5, "stochastic": 5 * 2.0 ** -10}
SHAPE = (64, 64)  # 4096 elements: both libraries quantize tensors this large


def torchao_optim(name):
    optim = pytest.importorskip("torchao.optim")
    return getattr(optim, name)


def bnb_adamw8bit():
    bnb = pytest.importorskip("bitsandbytes")
    return lambda params, lr: bnb.optim.AdamW8bit(params, lr=lr)


INNER = {"torchao AdamW8bit": lambda: torchao_optim("AdamW8bit"),
         "torchao AdamW4bit": lambda: torchao_optim("AdamW4bit"),
         "bitsandbytes AdamW8bit": bnb_adamw8bit}


def grads(steps=5):
    return [torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).bfloat16()
            for i in range(steps)]


def run(make, master):
    torch.manual_seed(0)
    w = nn.Parameter(nn.Linear(*SHAPE).weight.detach().bfloat16())
    ref = nn.Parameter(w.detach().float())
    ref_opt = make([ref], lr=1e-3)
    if master == "fp32":
        opt = mp.MasterWeightOptimizer(make([w], lr=1e-3))
    else:
        opt = CompactMasterOptimizer(make([w], lr=1e-3), master)
    for g in grads():
        w.grad, ref.grad = g, g.float()
        opt.step()
        ref_opt.step()
    got = opt.master_param(w) if master == "fp32" else opt.fp32_values()[w]
    return w, opt, got.detach(), ref.detach()


@pytest.mark.parametrize("master", ["fp32", "kahan", "stochastic"])
@pytest.mark.parametrize("inner", INNER)
def test_low_bit_optimizers_step_inside_the_master_step(inner, master):
    w, opt, got, ref = run(INNER[inner](), master)
    if master == "fp32":
        assert torch.equal(got, ref)
        assert torch.equal(w, ref.to(torch.bfloat16))  # torch's cast: ties to even
    else:
        assert (got - ref).abs().max().item() < TOL[master]


@pytest.mark.parametrize("inner", INNER)
def test_low_bit_states_are_measured_in_bytes_per_parameter(inner):
    make = INNER[inner]()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    model, opt = mp.prepare(model, make(model.parameters(), lr=1e-3), level="O2", dtype="bf16",
                            master="kahan")
    model(torch.randn(4, 64)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    got = mp.bytes_per_parameter(model, opt)
    assert got["weights"] == 2 and got["compensation"] == 2 and got["gradients"] == 0
    # codes (1 or 0.5 B per moment) + block scales + the quantization maps (two 256-entry fp32
    # maps per tensor: 0.5 B per parameter of a 4096-element tensor; nothing on a large one)
    limit = 1.6 if "4bit" in inner else 2.6
    assert got["optimizer_state"] < limit


@pytest.mark.parametrize("fp8", ["mxfp8", "nvfp4"])
def test_a_format_whose_kernels_take_no_fp16_is_refused_with_fp16_compute(fp8):
    """torchao's MX and NVFP4 kernels take bf16 (and fp32) inputs only: with fp16 compute a
    policy was accepted and the first forward died inside torchao. Refused at the policy, with
    the formats that take fp16; bf16 and the float8 recipes with fp16 are accepted."""
    def model():
        return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))

    with pytest.raises(ValueError, match=rf"fp8='{fp8}' runs its GEMMs with bf16 compute, not "
                                         r"fp16.*'tensorwise', 'rowwise', 'rowwise_gw_hp'"):
        mp.prepare(model(), level="O2", dtype="fp16", fp8=fp8)
    policy = mp.Policy.from_level("O2", "fp16")
    with pytest.raises(ValueError, match="runs its GEMMs with bf16 compute"):
        dataclasses.replace(policy, fp8=fp8)  # the advisor's policy(dtype="fp16", fp8=) too
    dataclasses.replace(mp.Policy.from_level("O2", "bf16"), fp8=fp8)
    dataclasses.replace(policy, fp8="tensorwise")
