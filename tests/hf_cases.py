"""Shared pieces of the Accelerate and Hugging Face Trainer tests over several processes: what
one rank runs (through parallel_cases.launch), and the same run in one process.

Accelerate turns FSDP on only on accelerators (its state ignores an FSDP plugin on MULTI_CPU),
so the CPU runs put the accelerator's state into FSDP2 mode, as it is on GPUs
(:func:`force_fsdp2`); FSDP2 itself runs over gloo.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from parallel_cases import GLOBAL_BATCH, Net, dataset
from torch.utils.data import DataLoader

import mixprec as mp

pytest.importorskip("accelerate")
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

from mixprec.integrations.accelerate import MixprecAccelerator  # noqa: E402

EPOCHS = 2


def launcher_env(world: int) -> None:
    """What ``accelerate launch``/``torchrun`` set beside RANK/WORLD_SIZE/LOCAL_RANK."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555",
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def force_fsdp2(accelerator) -> None:
    """The accelerator's state as Accelerate sets it on GPUs for ``fsdp_version=2``."""
    from accelerate.state import PartialState

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # AcceleratorState()


def reset_accelerate() -> None:
    """Forget the accelerator state singletons (a new run in the same process)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if PartialState._shared_state:
        PartialState._shared_state["distributed_type"] = (
            DistributedType.MULTI_CPU if PartialState().num_processes > 1 else DistributedType.NO)


def accelerator(level, *, master=None, shard=False, **kw):
    reset_accelerate()
    acc = MixprecAccelerator(level=level, dtype="bf16", master=master, cpu=True, **kw)
    if shard:
        force_fsdp2(acc)
    return acc


def build(acc, world):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world)
    return acc.prepare(model, opt, data)


def train(acc, model, opt, data, *, epochs=EPOCHS, stop_at=None, skip=0, first_epoch=0):
    """The user's loop; returns the global mean loss of each step."""
    losses = []
    step = first_epoch * len(data) + skip
    for _ in range(first_epoch, epochs):
        batches = acc.skip_first_batches(data, skip) if skip else data
        skip = 0
        for x, y in batches:
            loss = F.cross_entropy(model(x).float(), y)
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(acc.reduce(loss.detach(), "mean").item())
            step += 1
            if step == stop_at:
                return losses
    return losses


def weights(model, opt) -> dict:
    return {k: v.detach().cpu().clone() for k, v in mp.fp32_state_dict(model, opt).items()}


def accelerate_fit(level, world, *, master=None, shard=False) -> dict:
    acc = accelerator(level, master=master, shard=shard)
    model, opt, data = build(acc, world)
    losses = train(acc, model, opt, data)
    return {"weights": weights(model, opt), "loss": losses,
            "scale": acc.engine.scaler.get_scale(),
            "fp32_reduce": getattr(model, "_mixprec_hook", False)}


def accelerate_resume(out, level, world, *, master=None, shard=False, stop_at=6, **kw) -> dict:
    """Uninterrupted vs stopped at ``stop_at`` (mid-epoch 2), save_state, load_state, go on."""
    acc = accelerator(level, master=master, shard=shard, **kw)
    whole = build(acc, world)
    train(acc, *whole)
    acc = accelerator(level, master=master, shard=shard, **kw)
    first = build(acc, world)
    train(acc, *first, stop_at=stop_at)
    path = os.path.join(out, f"acc-{level}-{master}-{shard}-{kw.get('state_dtype')}")
    acc.save_state(path)
    before = weights(*first[:2])
    acc = accelerator(level, master=master, shard=shard, **kw)
    second = build(acc, world)
    acc.load_state(path)
    loaded = weights(*second[:2])
    per_epoch = len(second[2])
    train(acc, *second, first_epoch=stop_at // per_epoch, skip=stop_at % per_epoch)
    a, b = weights(*whole[:2]), weights(*second[:2])
    return {"equal": all(torch.equal(a[k], b[k]) for k in a),
            "loaded": all(torch.equal(before[k], loaded[k]) for k in before),
            "files": sorted(os.listdir(path)), "path": path, "saved": before, "weights": a}


def accelerate_load(path, level, world, *, shard=False, stop_at=6, **kw) -> dict:
    """A state saved at step ``stop_at`` loaded by ``world`` processes (the same global batch),
    then trained to the end: the weights just after loading, and at the end."""
    acc = accelerator(level, shard=shard, **kw)
    model, opt, data = build(acc, world)
    acc.load_state(path)
    loaded = weights(model, opt)
    per_epoch = len(data)
    train(acc, model, opt, data, first_epoch=stop_at // per_epoch, skip=stop_at % per_epoch)
    return {"loaded": loaded, "weights": weights(model, opt),
            "engine": acc.engine.state_dict()}


# -- the Hugging Face Trainer -----------------------------------------------------------------
VOCAB, SEQ = 32, 8


def gpt2():
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def rows(n=32):
    """Counting sequences from random starts."""
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def hf_arguments(out, world, *, shard=False, **kwargs):
    import transformers

    options = dict(use_cpu=True, report_to=[], per_device_train_batch_size=GLOBAL_BATCH // world,
                   num_train_epochs=EPOCHS, learning_rate=3e-3, logging_steps=1,
                   save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0,
                   train_sampling_strategy="sequential")
    if shard:
        options.update(fsdp="full_shard", fsdp_config={"version": 2})
    return transformers.TrainingArguments(str(out), **{**options, **kwargs})


def hf_trainer(out, level, world, *, master=None, shard=False, dtype="bf16", **kwargs):
    from mixprec.integrations.transformers import MixprecTrainer

    class Trainer(MixprecTrainer):
        def create_accelerator_and_postprocess(self):
            reset_accelerate()
            super().create_accelerator_and_postprocess()
            if shard:  # as Accelerate sets it up on GPUs (see the module docstring)
                force_fsdp2(self.accelerator)
                self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
                    **self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    trainer = Trainer(gpt2(), hf_arguments(out, world, shard=shard, **kwargs),
                      train_dataset=rows(), level=level, dtype=dtype, master=master)
    trainer.model_accepts_loss_kwargs = False  # the model's own mean loss per rank
    return trainer


def hf_weights(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)
    return {k: v.detach().cpu().clone() for k, v in mp.fp32_state_dict(model, opt).items()}


def hf_losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def hf_fit(out, level, world, **kw) -> dict:
    trainer = hf_trainer(out, level, world, **kw)
    trainer.train()
    return {"weights": hf_weights(trainer), "loss": hf_losses(trainer),
            "scale": trainer.mixed_precision.scaler.get_scale(),
            "fp32_reduce": getattr(trainer.model_wrapped, "_mixprec_hook", False)}


def hf_resume(out, level, world, *, stop_at=6, **kw) -> dict:
    """Uninterrupted vs resumed from the checkpoint of step ``stop_at`` (mid-epoch 2)."""
    import transformers

    name = f"hf-{level}-{kw.get('master')}-{kw.get('shard', False)}"
    whole = hf_trainer(os.path.join(out, name), level, world, save_strategy="steps",
                       save_steps=stop_at, **kw)
    at_save = {}

    class Keep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            if state.global_step == stop_at:  # every rank (the fp32 values are gathered)
                at_save.update(hf_weights(whole))

    whole.add_callback(Keep())
    whole.train()
    checkpoint = os.path.join(out, name, f"checkpoint-{stop_at}")
    resumed = hf_trainer(os.path.join(out, name + "-resumed"), level, world, **kw)
    resumed.train(resume_from_checkpoint=checkpoint)
    a, b = hf_weights(whole), hf_weights(resumed)
    saved = os.path.join(out, name + "-saved")
    whole.save_model(saved)
    return {"equal": all(torch.equal(a[k], b[k]) for k in a), "weights": a,
            "loss": hf_losses(whole), "checkpoint": checkpoint, "saved": saved,
            "files": sorted(os.listdir(checkpoint)), "at_save": at_save,
            "scale": (whole.mixed_precision.scaler.get_scale(),
                      resumed.mixed_precision.scaler.get_scale())}


def hf_load(out, checkpoint, level, world, **kw) -> dict:
    """``checkpoint`` resumed by ``world`` processes: the step and weights just after loading
    (when training begins), and the weights after training to the end."""
    import transformers

    resumed = hf_trainer(os.path.join(out, "resumed"), level, world, **kw)
    loaded = {}

    class Keep(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **_):
            loaded.update(hf_weights(resumed), step=state.global_step)

    resumed.add_callback(Keep())
    resumed.train(resume_from_checkpoint=checkpoint)
    step = loaded.pop("step")
    return {"loaded": loaded, "steps": (step, resumed.state.global_step),
            "weights": hf_weights(resumed), "engine": resumed.mixed_precision.state_dict()}
