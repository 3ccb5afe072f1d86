"""A script launched by torchrun in the tests: MixprecTrainer or MixprecAccelerator, DDP or
FSDP2, a few steps at O2, then the script ends (right after its last collectives)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_cases as hc  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", choices=["trainer", "accelerate"], required=True)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.host == "trainer":
        result = hc.hf_fit(args.out, "O2", world, shard=args.shard, max_steps=3)
    else:
        result = hc.accelerate_fit("O2", world, shard=args.shard)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(result["weights"], os.path.join(args.out, "weights.pt"))
        print(f"{args.host} x{world} done")


if __name__ == "__main__":
    main()
