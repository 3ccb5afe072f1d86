"""O2 written in plain torch with torch's fused kernel and nothing more: bf16 weights, fp32
masters stepped by torch's fused AdamW, the bf16 gradients widened into fp32 gradient buffers
(one ``_foreach_copy_``) and the masters cast back into the weights with torch's cast (round to
nearest even; one ``_foreach_copy_``). The floor a master-weight step built on torch's kernel
can reach without a kernel of its own."""

from __future__ import annotations

import torch


class PlainO2:
    """Steps ``params`` (bf16, gradients in ``.grad``) through fp32 masters ``masters`` (fp32
    copies of their values) with torch's fused AdamW (``hyper``: its keyword arguments)."""

    def __init__(self, params, masters, **hyper):
        self.params = list(params)
        self.masters = list(masters)
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        self.optimizer = torch.optim.AdamW(self.masters, fused=True, **hyper)

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        self.optimizer.step()
        torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
