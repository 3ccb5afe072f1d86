"""``save_pretrained`` of a prepared Hugging Face model: the fp32 masters, a float32 config.

A prepared model's ``state_dict()`` holds the fp32 masters (see :mod:`mixprec.statedict`), so
``save_pretrained`` writes them; but it also records ``config.dtype`` from the model's first
floating parameter, a 16-bit weight at O2, and transformers >= 5 loads a checkpoint in its
config's dtype: a plain ``from_pretrained`` would round the masters to 16 bits. So a prepared
``transformers.PreTrainedModel`` with 16-bit weights (masters, or at O3 the weights upcast,
which its ``state_dict()`` holds too) gets a :class:`Fp32SavePretrained` as its
``save_pretrained``: transformers' own method, then the config re-written with ``dtype``
float32 (what ``MixprecTrainer.save_model`` does), so a plain ``from_pretrained`` gives the
masters exactly. ``push_to_hub`` (transformers' ``model.push_to_hub``) saves through it too.
transformers is never imported here: a model of its classes means it already is.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

__all__ = ["Fp32SavePretrained", "fp32_save_pretrained"]


def _is_pretrained_model(model: nn.Module) -> bool:
    # the module that defines the class, not ``transformers`` itself: that is a lazy module,
    # whose attribute would import modeling_utils (and torchao with it) for a model of another
    # library (about 1 s, and torchao's load messages, in every prepare once Lightning imported
    # transformers' top level)
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None) if modeling else None
    return base is not None and isinstance(model, base)


class Fp32SavePretrained:
    """A prepared model's ``save_pretrained``: transformers' own, with a float32 config."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` with the same arguments (see the module
        docstring).

        Raises:
            ValueError: ``push_to_hub=True`` (call ``model.push_to_hub(repo_id)``, which saves
                through this method).
        """
        method = type(self.model).save_pretrained
        bound = inspect.signature(method).bind(self.model, save_directory, *args, **kwargs)
        options = {**bound.arguments, **bound.arguments.get("kwargs", {})}
        if options.get("push_to_hub", False):
            raise ValueError(
                "save_pretrained(push_to_hub=True) of a prepared model would upload a config "
                "that records the 16-bit storage dtype; call model.push_to_hub(repo_id), which "
                "saves through model.save_pretrained and uploads the fp32 config")
        out = method(self.model, save_directory, *args, **kwargs)
        config = getattr(self.model, "config", None)
        if config is not None and options.get("is_main_process", True):
            config.dtype = torch.float32  # the weights written are the fp32 masters
            config.save_pretrained(save_directory)
        return out


def fp32_save_pretrained(model: nn.Module) -> None:
    """Give a prepared Hugging Face ``model`` the :class:`Fp32SavePretrained` (nothing for other
    models)."""
    if _is_pretrained_model(model):
        model.save_pretrained = Fp32SavePretrained(model)
