"""``mixprec advise``: which layers of a bench model can take bf16, fp16 or FP8 (measured).

Builds a benchmark model (``mixprec bench``'s: nine-linear, convnet, transformer), trains it
for a few steps in fp32 (``--train-steps``; a freshly initialised model's numbers differ from
a trained one's) and runs :func:`mixprec.advise` on one of its batches: a table with one row per
layer, most sensitive first, the reasons for every unsafe layer, the advised policy, and what
the measurement cost. ``--model planted-overflow`` / ``planted-outlier`` run the two planted
cases of :mod:`mixprec.advisor.planted` instead (as built: not trained).

The advised policy runs FP8 only in the layers that gain from it on ``--target`` (default: this
machine's GPU class, else the CPU), by :meth:`mixprec.advisor.Advice.fp8_gains`: on a CPU FP8 is
emulated and never advised; the fp8 columns still give its numerics. ``--dtype auto`` is the
fast 16-bit type of the target (on this CPU: measured, see :mod:`mixprec.hardware`); where that
is fp32 the advised policy has no 16-bit layers, and the output says why.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from .. import benchmodels, hardware
from ..advisor import FORMATS, advise
from ..advisor.planted import CASES
from ..fp8 import speed
from ..lowbit.float8 import RECIPES, Float8
from .args import add_keyword_options, add_model_size_options, given_as

__all__ = ["run_advise", "register"]


def _formats(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in FORMATS]
    if bad or not names:
        raise ValueError(f"--formats takes a comma-separated list of {', '.join(FORMATS)}; "
                         f"got {text!r}")
    return names


def run_advise(model: str = "transformer", formats=("bf16", "fp16", "fp8_e4m3"),
               train_steps: int = 20, seed: int = 0, ablation: bool = False,
               fp8: str = Float8.recipe, **sizes):
    """Build, briefly train and advise a bench model (or build a planted case); returns
    ``(advice, bench model or None)``.

    Raises:
        ValueError: an unknown model, format or size.
    """
    if not isinstance(train_steps, int) or train_steps < 0:
        raise ValueError(f"--train-steps must be an integer >= 0; got {train_steps!r}")
    if model not in CASES and model not in benchmodels.MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of "
                         f"{', '.join([*benchmodels.MODELS, *CASES])}")
    if model in CASES:
        if sizes:
            raise ValueError(f"{model} is built at its own size: --"
                             f"{', --'.join(k.replace('_', '-') for k in sizes)} applies to the "
                             f"bench models ({', '.join(benchmodels.MODELS)})")
        net, batch, loss_fn = CASES[model]()
        return advise(net, batch, loss_fn, formats=formats, ablation=ablation,
                      fp8=fp8, seed=seed), None
    bm = benchmodels.get_model(model, **sizes)
    torch.manual_seed(seed)
    net = bm.build()
    gen = torch.Generator().manual_seed(seed)
    opt = bm.make_optimizer(net.parameters())
    for _ in range(train_steps):
        inputs, target = bm.batch(gen)
        opt.zero_grad(set_to_none=True)
        bm.loss_fn(net(inputs), target).backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return advise(net, bm.batch(gen), bm.loss_fn, formats=formats, ablation=ablation,
                  fp8=fp8, seed=seed), bm


def _check_plot(path: str | None) -> None:
    """Refuse a chart path whose directory does not exist, before the measurement."""
    if path is None:
        return
    if os.path.isdir(path):  # matplotlib would write <path>.png beside it, saying nothing
        raise ValueError(f"--plot {path}: is a directory; give the chart's file name, e.g. "
                         f"{os.path.join(path, 'advise.png')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise ValueError(f"--plot {path}: the directory {folder} {what}; create it or "
                         f"choose another path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {path}: the directory {folder} is not writable; choose "
                         f"another path")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix and suffix not in _PLOT_FORMATS:
        raise ValueError(f"--plot {path}: matplotlib writes {', '.join(_PLOT_FORMATS)}; got "
                         f"'.{suffix}'")


_PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")


def _target(name: str) -> str:
    """``--target``: ``"auto"`` is this machine's GPU class where torch sees one, else "cpu"."""
    if name == "auto":
        return speed.device_class("cuda") if torch.cuda.is_available() else "cpu"
    return name


def _low_dtype(given: str | None, formats, target: str) -> tuple[str | None, str]:
    """The advised policy's 16-bit format, and a note when ``--dtype auto`` decided it."""
    if given != "auto":
        return given or next((f for f in ("bf16", "fp16") if f in formats), None), ""
    if target == "cpu":
        caps = hardware.device_capabilities("cpu")
        low, why = caps["auto_dtype"], caps["auto_reason"]
    else:
        low, why = "bf16", f"{target} computes bf16 on its tensor cores"
    if low != "fp32" and low not in formats:
        raise ValueError(f"--dtype auto is {low} on {target} ({why}), which --formats "
                         f"{','.join(formats)} does not measure: add it, or give --dtype")
    return low, f"--dtype auto -> {low} on {target}: {why}"


def _run(args) -> int:
    sizes = {k: getattr(args, k) for k in ("width", "batch", "depth", "seq_len", "image_size")
             if getattr(args, k) is not None}
    formats = _formats(args.formats)
    _check_plot(args.plot)
    if given_as(args, "fp8") == "--fp8-recipe":
        print("mixprec advise: --fp8-recipe is deprecated; pass --fp8 (same values)",
              file=sys.stderr)
    target = _target(args.target)
    low, dtype_note = _low_dtype(args.dtype, formats, target)
    advice, bm = run_advise(args.model, formats, args.train_steps, args.seed, args.ablation,
                            args.fp8, **sizes)
    gains, fp8_why = advice.fp8_gains(target, low or "fp32")
    policy = None
    if low is not None:
        policy = advice.policy(args.level, low,
                               fp8=args.fp8 if gains else None, fp8_layers=gains or None)
    if args.plot:
        try:
            advice.plot(args.plot)
        except OSError as error:  # (a path the checks above could not rule out: /proc)
            raise ValueError(f"--plot {args.plot}: could not be written ({error.strerror}); "
                             f"choose another path") from error
    if args.json:
        out = {"model": args.model, "sizes": None if bm is None else bm.sizes,
               **advice.to_dict(), "policy": None if policy is None else policy.state_dict(),
               "fp8_advice": {"target": target, "layers": gains, "why": fp8_why},
               "dtype_note": dtype_note}
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(f"{args.model} (planted case, as built)" if bm is None else
          f"{bm.name} {bm.sizes}, after {args.train_steps} fp32 steps")
    print(advice.table())
    c = advice.cost
    print(f"cost: {c['full_passes']} full forward+backward, {c['layer_passes']} single-layer "
          f"passes, {c['ablation_forwards']} ablation forwards, {c['seconds']:.2f} s")
    if dtype_note:
        print(dtype_note)
    print(f"FP8 on {target}: {fp8_why}")
    if policy is not None:
        print(f"advised policy: {policy}")
        if policy.fp8_modules is not None:
            print(f"  fp8_modules: {list(policy.fp8_modules)}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("advise", help="measure which layers can take bf16, fp16 or FP8",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="transformer",
                   help=f"one of {', '.join([*benchmodels.MODELS, *CASES])} "
                        f"(default %(default)s)")
    p.add_argument("--formats", default="bf16,fp16,fp8_e4m3",
                   help="comma-separated formats (default %(default)s)")
    add_keyword_options(p, "fp8", "level", "dtype", aliases={"fp8": "--fp8-recipe"}, differs={
        "fp8": (str(Float8()), 'the FP8 recipe the "fp8_e4m3" row measures and the advised '
                               "policy uses; --fp8-recipe: deprecated spelling"),
        "level": ("O2", "the level of the advised policy"),
        "dtype": (None, "the 16-bit format of the advised policy: the first measured; auto: "
                        "the fast one of --target")},
        choices={"fp8": tuple(RECIPES), "dtype": ("auto", "bf16", "fp16")})
    p.add_argument("--target", default="auto", choices=("auto", "cpu", *speed.FIGURES),
                   help="the device class the advice is for: FP8 is advised only for layers "
                   "estimated to gain on it (auto: this machine's GPU, else cpu, where FP8 is "
                   "emulated and never advised; default %(default)s)")
    p.add_argument("--train-steps", type=int, default=20,
                   help="fp32 steps before measuring (default %(default)s)")
    add_model_size_options(p)
    p.add_argument("--ablation", action="store_true",
                   help="measure each layer's loss change (one forward per layer and format)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="save a chart of the advice to this PNG")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)
