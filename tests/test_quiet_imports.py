"""Importing what mixprec imports prints nothing that is not the user's business.

torchao's import logs that its optional compiled kernels do not load ("Failed to load
.../torchao/_C_mxfp8...so"; mixprec's FP8 layers use none of them) and torch logs that torchao
registers Enum classes with ``_pytree`` the deprecated way. mixprec imports torchao only when FP8
is asked for, and drops exactly those messages, only while it imports. Each case runs in a fresh
interpreter (an import happens once per process) and checks its stderr.
"""

import logging
import os
import subprocess
import sys

import pytest

from mixprec.lowbit import backend

pytest.importorskip("torchao.float8")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("Failed to load", "is an Enum subclass")


def stderr_of(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def noisy():
    """What importing torchao prints here without mixprec (the control: on a machine where
    torchao's import is silent the cases below would prove nothing)."""
    err = stderr_of("import torchao.float8")
    if not any(n in err for n in NOISE):
        pytest.skip("torchao's import prints nothing on this machine")
    return err


@pytest.mark.slow
def test_importing_mixprec_and_its_trainer_integration_prints_nothing(noisy):
    err = stderr_of("import sys, mixprec\n"
                    "assert 'torchao' not in sys.modules, 'mixprec imported torchao'\n"
                    "import mixprec.integrations.transformers")
    assert err == ""


@pytest.mark.slow
def test_fp8_prepare_prints_nothing_and_trains(noisy):
    err = stderr_of(
        "import torch, warnings, mixprec as mp\n"
        "warnings.simplefilter('ignore', mp.SlowDtypeWarning)  # this machine's note, not noise\n"
        "from torch import nn\n"
        "net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])\n"
        "net = mp.prepare(net, level='O1', dtype='bf16', fp8='tensorwise')\n"
        "assert mp.fp8_modules(net) == ['1']\n"
        "net(torch.randn(16, 32)).float().square().mean().backward()\n")
    assert err == ""


def test_the_filter_is_scoped_to_the_import_and_to_those_messages(caplog):
    torchao_logger = logging.getLogger("torchao")
    kernel = "Failed to load /site-packages/torchao/_C_mxfp8.cpython-311-x86_64-linux-gnu.so: x"
    with caplog.at_level(logging.WARNING):
        with backend.quiet_import():
            torchao_logger.warning(kernel)
            torchao_logger.warning("Failed to load the checkpoint")  # not about its kernels
            logging.getLogger("torch.utils._pytree").warning(
                "%s is an Enum subclass and is now natively supported by torch.compile", "E")
        torchao_logger.warning(kernel)  # after the import: shown
    shown = [r.getMessage() for r in caplog.records]
    assert shown == ["Failed to load the checkpoint", kernel]
    assert not torchao_logger.filters
