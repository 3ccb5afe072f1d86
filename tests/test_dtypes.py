"""mixprec.dtypes: the registry of floating dtypes, its derived role tuples, names and widths."""

import pytest
import torch

from mixprec import dtypes
from mixprec.dtypes import REGISTRY, bits, dtype_name, to_dtype

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
       if d is not None]


def test_roles_of_each_dtype():
    trainable = (torch.float32, torch.float16, torch.bfloat16)
    assert dtypes.TRAINING_DTYPES == trainable
    assert dtypes.CASTABLE_DTYPES == trainable and dtypes.ROUNDABLE_DTYPES == trainable
    assert dtypes.LOW_PRECISION_DTYPES == (torch.float16, torch.bfloat16)
    for dt in (torch.float64, *FP8):  # known, named, but never trained in, cast or rounded
        assert dt not in dtypes.TRAINING_DTYPES + dtypes.CASTABLE_DTYPES + dtypes.ROUNDABLE_DTYPES


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_alias_resolves_to_its_entry_and_back(name):
    entry = REGISTRY[name]
    assert entry.name in entry.aliases
    for alias in entry.aliases:
        assert dtypes.ALIASES[alias] == name
        if entry.dtype is not None:
            assert to_dtype(alias.upper()) is entry.dtype
    if entry.dtype is not None:
        assert dtype_name(entry.dtype) == name
        assert bits(entry.dtype) == torch.finfo(entry.dtype).bits == entry.bits


def test_widths_count_fp8_as_8_bits():
    assert [bits(d) for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)] == [
        64, 32, 16, 16]
    assert all(bits(d) == 8 for d in FP8)
    assert bits(torch.int32) == 32  # a dtype outside the registry: its item size
    with pytest.raises(TypeError, match="torch.dtype; got str 'fp16'"):
        bits("fp16")


def test_aliases_are_unique_and_lower_case():
    spellings = [a for entry in REGISTRY.values() for a in entry.aliases]
    assert len(spellings) == len(set(spellings)) and all(a == a.lower() for a in spellings)


def test_is_low_precision():
    assert dtypes.is_low_precision(torch.ones(1, dtype=torch.bfloat16))
    assert not dtypes.is_low_precision(torch.ones(1))
    assert not dtypes.is_low_precision(torch.ones(1, dtype=torch.int16))
    for dt in FP8:
        assert dtypes.is_low_precision(torch.zeros(1).to(dt))
