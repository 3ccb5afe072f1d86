"""Lightning runs the multi-process tests share: a LightningModule over parallel_cases.Net, a fit
at a global batch of GLOBAL_BATCH under a strategy, and a rank's whole / stopped / resumed runs.

Under the 2-rank gloo launcher (``parallel_cases.launch``) each rank builds ``L.Trainer(
accelerator="cpu", devices=2, strategy=...)``: the launcher's ``LOCAL_RANK`` tells Lightning
the processes exist already, and the process group it finds is used as it is.
"""

import os

import lightning.pytorch as L  # noqa: E402
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from parallel_cases import GLOBAL_BATCH, Net, dataset
from torch.utils.data import DataLoader, DistributedSampler

import mixprec as mp
from mixprec.integrations.lightning import MixprecPrecision  # noqa: E402

SPLIT = ("O2", "bf16", "split")
CLIP = 0.05  # below every step's gradient norm: a clip norm measured on one shard would show


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Dropping(Classifier):
    """A Classifier whose blocks drop half their activations: each step draws from the rank's
    global torch RNG."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(dropout=0.5)


class Sharded(Classifier):
    """ModelParallelStrategy needs configure_model; the plugin shards the blocks as units."""

    def configure_model(self):
        self.trainer.precision_plugin.shard(self)


class LeftToThePlugin(Classifier):
    """A configure_model that shards nothing: the plugin shards with the defaults."""

    def configure_model(self):
        pass


def strategy_for(name: str, sharded_checkpoint: bool = False):
    """``ModelParallelStrategy`` saves one file (every rank's shards gathered, which one process
    can resume from) unless ``sharded_checkpoint`` (its default: a directory of shards)."""
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                     save_distributed_checkpoint=sharded_checkpoint)
    return name


def fit(strategy: str, config, *, world: int, epochs: int, ckpt_path=None, save=None,
        module_class=None, sharded_checkpoint=False) -> dict:
    """One fit; the fp32 weights (gathered under FSDP2) and, with ``save``, a checkpoint."""
    level, dtype, master = config
    environment = dict(os.environ)
    if module_class is None:
        module_class = Sharded if strategy == "fsdp2" and world > 1 else Classifier
    module = module_class()
    plugin = MixprecPrecision(level=level, dtype=dtype, master=master)
    chosen = strategy_for(strategy, sharded_checkpoint) if world > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=chosen,
                        plugins=[plugin], max_epochs=epochs, gradient_clip_val=CLIP,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    data = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world, sampler=sampler(world))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    weights = mp.fp32_state_dict(trainer.lightning_module, trainer.optimizers[0])
    os.environ.clear()
    os.environ.update(environment)  # Lightning's teardown drops WORLD_SIZE
    return {"weights": {k: v.cpu() for k, v in weights.items()}, "step": trainer.global_step,
            "sharded": mp.parallel.is_fsdp(trainer.lightning_module)}


def sampler(world: int):
    """Lightning trains over ``DistributedSampler(shuffle=True, seed=0)`` in several processes,
    even for a loader that does not shuffle; one process at the same global batch draws the
    same permutation each epoch (the ranks' shares of batch b are its elements 8b..8b+7)."""
    if world > 1:
        return None  # Lightning replaces it
    return DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)


def name(config) -> str:
    level, dtype, master = config
    return f"{level}-{dtype}" + (f"-{master}" if master else "")


def rank_case(rank, out, strategy, configs):
    """Per config: 2 epochs whole; 1 epoch, saved, resumed into a fresh module for epoch 2."""
    results = {}
    for config in configs:
        path = os.path.join(out, f"{strategy}-{name(config)}.ckpt")
        whole = fit(strategy, config, world=2, epochs=2)
        fit(strategy, config, world=2, epochs=1, save=path)
        torch.manual_seed(1234 + rank)  # nothing random may leak into the resumed run
        resumed = fit(strategy, config, world=2, epochs=2, ckpt_path=path)
        results[name(config)] = {"whole": whole, "resumed": resumed, "ckpt": path}
    if strategy == "fsdp2":
        results["left to the plugin"] = fit(strategy, ("O2", "fp16", None), world=2, epochs=2,
                                            module_class=LeftToThePlugin)
        path = os.path.join(out, "fsdp2-split-sharded")  # the strategy's default: a directory
        fit(strategy, SPLIT, world=2, epochs=1, save=path, sharded_checkpoint=True)
        results["split, sharded checkpoint"] = fit(strategy, SPLIT, world=2, epochs=2,
                                                   ckpt_path=path, sharded_checkpoint=True)
    return results


def dropout_case(rank, out):
    """DDP, O2 bf16, a model with dropout: 2 epochs whole; 1 epoch, saved, resumed for epoch 2
    from another global RNG state."""
    path, config = os.path.join(out, "dropout.ckpt"), ("O2", "bf16", None)
    whole = fit("ddp", config, world=2, epochs=2, module_class=Dropping)
    fit("ddp", config, world=2, epochs=1, save=path, module_class=Dropping)
    torch.manual_seed(1234 + rank)  # the checkpoint's RNG states must replace this
    resumed = fit("ddp", config, world=2, epochs=2, ckpt_path=path, module_class=Dropping)
    return {"whole": whole, "resumed": resumed}


def resume_case(rank, out, strategy, config, ckpt_path):
    """2 epochs at 2 ranks under ``strategy``, resumed from ``ckpt_path`` (saved elsewhere)."""
    return fit(strategy, config, world=2, epochs=2, ckpt_path=ckpt_path)


def launch_case(rank, out, strategy):
    """One 2-rank launch of the 20-in-a-row loops: O2 bf16, 2 epochs; rank's fp32 weights."""
    return fit(strategy, ("O2", "bf16", None), world=2, epochs=2)["weights"]


def fit_alone(strategy: str, config, accelerator: str = "cpu", epochs: int = 2) -> dict:
    """One process on one device under ``strategy``: ``"auto"`` (none), ``"ddp"`` or
    ``"fsdp2"`` (``ModelParallelStrategy`` over one rank); the fp32 weights and the backend of
    the process group Lightning made (None without one), which is destroyed afterwards."""
    level, dtype, master = config
    seen = {}

    class Backend(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["backend"] = dist.get_backend() if dist.is_initialized() else None
            seen["timeouts"] = group_timeouts()

    chosen = {"auto": "auto", "ddp": "ddp",
              "fsdp2": ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)}
    module = (Sharded if strategy == "fsdp2" else Classifier)()
    plugin = MixprecPrecision(level=level, dtype=dtype, master=master)
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=chosen[strategy],
                        plugins=[plugin], max_epochs=epochs, gradient_clip_val=CLIP,
                        callbacks=[Backend()], logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    data = DataLoader(dataset(), batch_size=GLOBAL_BATCH, sampler=sampler(1))
    environment = dict(os.environ)
    try:
        trainer.fit(module, data)
        weights = mp.fp32_state_dict(trainer.lightning_module, trainer.optimizers[0])
        weights = {k: v.detach().cpu() for k, v in weights.items()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    return {"weights": weights, "backend": seen.get("backend"), "timeouts": seen.get("timeouts")}


def group_timeouts() -> list[float]:
    """The collective timeout (seconds) of each gloo process group of this process."""
    if not dist.is_initialized():
        return []
    groups = list(dist.distributed_c10d._world.pg_map)
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]
