"""A minimal hand-written FSDP2 training loop: the baseline for bench/overhead.py.

torchrun --nproc_per_node=2 bench/hand_loop.py --steps 60 --batch-size 32 --warmup 5
Prints one JSON line on rank 0: {"steps_per_s": ..., "first_step_at": ...}: steps/s timed
after the warm-up steps, and the wall-clock time (time.time()) the first step ended.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.models.vision_transformer import EncoderBlock

from fsdp_exp.data.images import SyntheticImages
from fsdp_exp.models.vit import build_vit

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--num-layers", type=int, default=10)
args = parser.parse_args()

cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh(device.type, (world,))

torch.manual_seed(0)
model = build_vit(28, 7, args.num_layers, 2, 128, 128, 10).to(device)
for block in [m for m in model.modules() if isinstance(m, EncoderBlock)]:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
if not cuda:  # a correct gloo loop needs this too (see fsdp_exp/sharding.py)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

dataset = SyntheticImages().dataset()
sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0, drop_last=True)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)


def batches():
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def sync():
    if cuda:
        torch.cuda.synchronize()


data = batches()
start = time.perf_counter()
for step in range(1, args.steps + 1):
    x, y = next(data)
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if step == 1:
        sync()
        first_step_at = time.time()
    if step == args.warmup:
        sync()
        start = time.perf_counter()
    if step % 10 == 0 and rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
sync()
elapsed = time.perf_counter() - start
if rank == 0:
    print(json.dumps({"steps_per_s": (args.steps - args.warmup) / elapsed, "first_step_at": first_step_at}))
dist.destroy_process_group()
