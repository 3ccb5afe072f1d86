"""``strategy="ddp_spawn"``, launched by Lightning itself: 2 CPU processes, O2 bf16, 2 epochs.

Run as a script (``python tests/lightning_spawn.py OUT``, from the repository root, by
tests/test_parallel_lightning.py under a timeout); writes to OUT the fp32 weights Lightning
hands back to this process from rank 0, and those of one process at the same global batch.
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.simplefilter("ignore")


def main(out: str) -> None:
    import lightning.pytorch as L
    import lightning_cases as lc
    from parallel_cases import GLOBAL_BATCH, dataset
    from torch.utils.data import DataLoader

    from mixprec.integrations.lightning import MixprecPrecision

    module = lc.Classifier()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2,
                        plugins=[MixprecPrecision(level="O2", dtype="bf16")],
                        gradient_clip_val=lc.CLIP, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(dataset(), batch_size=GLOBAL_BATCH // 2))
    spawned = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    single = lc.fit("ddp", ("O2", "bf16", None), world=1, epochs=2)["weights"]
    torch.save({"spawned": spawned, "single": single}, out)


if __name__ == "__main__":
    main(sys.argv[1])
