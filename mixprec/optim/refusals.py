"""What a master optimizer refuses, and how it says so: the checks of its arguments and the
messages the step raises (:mod:`.wrapper` and the optimizers use them)."""

from __future__ import annotations

import torch

from ..formats import get as float_format

__all__ = ["check_bucket_mb", "check_grad_scale", "check_listed_once", "not_ours",
           "stale_fp16_error"]


def check_bucket_mb(bucket_mb) -> None:
    """Raise ValueError unless ``bucket_mb`` is None or a positive number."""
    if bucket_mb is not None and not (isinstance(bucket_mb, (int, float))
                                      and not isinstance(bucket_mb, bool) and bucket_mb > 0):
        raise ValueError(f"bucket_mb must be None or a positive number; got {bucket_mb!r}")


def check_grad_scale(grad_scale) -> None:
    """Raise TypeError unless ``grad_scale`` is a 0-d floating tensor."""
    if not (isinstance(grad_scale, torch.Tensor) and grad_scale.dim() == 0
            and grad_scale.is_floating_point()):
        raise TypeError(f"grad_scale must be a 0-d floating tensor (the factor the gradients "
                        f"carry) or None; got {grad_scale!r}")


def check_listed_once(params, method) -> None:
    """Raise ValueError where a parameter is listed twice in ``params`` (an optimizer's param
    groups, flattened): torch's optimizer steps it twice (and warns that this will be an
    error); a compact ``method`` steps each weight in place once, so it can't match that."""
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            raise ValueError(
                f"a {p.dtype} parameter of shape {tuple(p.shape)} is listed twice in the "
                f"optimizer's param groups; master={str(method)!r} steps each weight once, "
                f"where torch's optimizer would step it twice: list each parameter once (a "
                f"tied weight too)")
        seen.add(id(p))


def not_ours(tensor: torch.Tensor, owner: str) -> str:
    """The message for a tensor that is not one of ``owner``'s parameters."""
    return (f"{tensor.dtype} tensor of shape {tuple(tensor.shape)} is not a parameter (or master) "
            f"of this {owner}")


def stale_fp16_error(count: int, shape, groups_hold_fp32: bool = True) -> RuntimeError:
    """fp16 model gradients changed after their fp32 gradients were made. After
    ``unscale_grads_`` the model's fp16 gradients hold the unscaled values, where fp16 loses what
    lies below its smallest normal (2^-14); the step would take a change from them and lose
    those values (bf16 has fp32's range: its changes are taken). ``groups_hold_fp32``: the
    optimizer's ``param_groups`` hold the fp32 masters, whose gradients can be clipped (fp32
    masters); else they hold the fp16 parameters (a compact optimizer)."""
    where = ("clip the optimizer's parameters (their fp32 gradients): clip_grad_norm_([p for g "
             "in optimizer.param_groups for p in g['params']], max_norm)" if groups_hold_fp32
             else "with mp.MixedPrecision: amp.clip_grad_norm_(optimizer, max_norm) or "
             "amp.clip_grad_value_(optimizer, clip_value) (they clip the fp32 copies the step "
             "reads)")
    return RuntimeError(
        f"the fp16 gradients of {count} model parameter(s) (e.g. shape {tuple(shape)}) changed "
        "after their fp32 master gradients were made (scaler.unscale_(optimizer)), e.g. by "
        "clip_grad_norm_(model.parameters(), ...). Unscaled in fp16, gradients below "
        f"{float_format('fp16').min_normal:.2g} (its smallest normal) lose precision or vanish, "
        "so the step can't take that change exactly. Clip with "
        f"scaler.clip_grad_norm_(optimizer, max_norm), or {where} (Lightning: gradient_clip_val="
        " or self.clip_gradients; Accelerate: accelerator.clip_grad_norm_; the Hugging Face "
        "Trainer: max_grad_norm=); in bf16 clipping the model's parameters works")
