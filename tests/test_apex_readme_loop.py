"""apex's documented usage runs with only the import changed, and trains to the fp32 loss.

APEX_PROGRAM is an apex script written the way apex's README and API page teach it: build the
model and optimizer in fp32, ``amp.initialize`` them, backward inside ``amp.scale_loss``, and
checkpoint with the model, optimizer and amp state dicts saved after ``initialize`` and loaded
after ``initialize`` on fresh objects. The test swaps the import line, checks that it is the only
line that changed, and runs the result at O0, O1 and O2.
"""

import difflib

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.hardware.SlowDtypeWarning")

APEX_PROGRAM = '''
import io
import torch
from apex import amp

opt_level = "O1"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
N, D_in, H, D_out = 512, 16, 32, 4
x = torch.randn(N, D_in, device=device)
y = torch.tanh(x @ torch.randn(D_in, D_out, device=device) / 4)
y = y + 0.1 * torch.randn(N, D_out, device=device)


def build():
    model = torch.nn.Sequential(torch.nn.Linear(D_in, H), torch.nn.BatchNorm1d(H),
                                torch.nn.ReLU(), torch.nn.Linear(H, D_out)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return model, optimizer


def train(model, optimizer, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    return loss.item()


model, optimizer = build()
model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
start_loss = train(model, optimizer, 1)
train(model, optimizer, 99)

checkpoint = {
    "model": model.state_dict(),
    "optimizer": optimizer.state_dict(),
    "amp": amp.state_dict(),
}
buffer = io.BytesIO()
torch.save(checkpoint, buffer)

model, optimizer = build()
model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
checkpoint = torch.load(io.BytesIO(buffer.getvalue()))
model.load_state_dict(checkpoint["model"])
optimizer.load_state_dict(checkpoint["optimizer"])
amp.load_state_dict(checkpoint["amp"])
final_loss = train(model, optimizer, 100)
'''

MIXPREC_PROGRAM = APEX_PROGRAM.replace("from apex import amp",
                                       "from mixprec.compat import apex_amp as amp")


def _run(level: str) -> float:
    program = MIXPREC_PROGRAM.replace('opt_level = "O1"', f'opt_level = "{level}"')
    namespace: dict = {}
    exec(compile(program, f"<apex README loop, {level}>", "exec"), namespace)
    return namespace["start_loss"], namespace["final_loss"]


def test_only_the_import_changes():
    changed = [line for line in difflib.unified_diff(APEX_PROGRAM.splitlines(),
                                                     MIXPREC_PROGRAM.splitlines(), lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == ["-from apex import amp", "+from mixprec.compat import apex_amp as amp"]


def test_o1_and_o2_train_to_the_fp32_loss_within_3_percent():
    start, fp32 = _run("O0")
    losses = {level: _run(level)[1] for level in ("O1", "O2")}
    print(f"final loss after 200 steps: O0 {fp32:.6f}, "
          + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
    assert fp32 < start / 4  # it learned (the noise floor is 0.01)
    for level, loss in losses.items():
        assert abs(loss - fp32) <= 0.03 * fp32, (level, loss, fp32)
