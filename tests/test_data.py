"""Data comes in through the real loaders; each rank reads its own part of every epoch."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from fsdp_exp.data import Batches
from fsdp_exp.data.images import _NORMALIZE, SyntheticImages, TorchvisionImages
from fsdp_exp.errors import ConfigError
from tests.conftest import REPO, read_json, run_cli

def write_idx(raw: Path, split: str, images: torch.Tensor, labels: torch.Tensor) -> None:
    """The IDX files torchvision's MNIST and FashionMNIST read: big-endian header, uint8 body."""
    raw.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    (raw / f"{split}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 0x00000803, n, h, w) + images.numpy().tobytes()
    )
    (raw / f"{split}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 0x00000801, n) + labels.numpy().tobytes()
    )


def make_dataset(root: Path, name: str, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
    for split in ("train", "t10k"):
        write_idx(root / name / "raw", split, images, labels)
    return images, labels


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST"])
def test_torchvision_classes_read_our_idx_files(tmp_path: Path, name: str) -> None:
    images, labels = make_dataset(tmp_path, name)
    dataset = TorchvisionImages(name=name, root=str(tmp_path)).dataset()
    x, y = dataset[5]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    assert int(y) == int(labels[5])
    mean, std = _NORMALIZE[name]
    assert torch.allclose((x[0] * std + mean) * 255, images[5].float(), atol=1e-3)


def test_missing_files_give_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.root=.*no MNIST IDX files in .*MNIST/raw"):
        TorchvisionImages(name="MNIST", root=str(tmp_path)).dataset()


def test_each_rank_reads_its_own_part_of_every_epoch() -> None:
    data = SyntheticImages(num_samples=40, num_classes=4)
    dataset = data.dataset()
    labels_of = {tuple(dataset[i][0].flatten()[:4].tolist()): i for i in range(40)}

    def epoch(rank: int) -> list[list[int]]:
        batches = iter(data.batches(batch_size=5, rank=rank, world_size=2, seed=0))
        return [[labels_of[tuple(x.flatten()[:4].tolist())] for x in next(batches)[0]] for _ in range(8)]

    rank0, rank1 = epoch(0), epoch(1)
    first0 = {i for b in rank0[:4] for i in b}
    first1 = {i for b in rank1[:4] for i in b}
    assert not first0 & first1, "ranks must not share samples within an epoch"
    assert first0 | first1 == set(range(40)), "together the ranks read the whole epoch"
    assert rank0[:4] != rank0[4:], "each epoch is reshuffled"


def test_synthetic_images_are_deterministic_and_class_dependent() -> None:
    a = SyntheticImages(num_samples=200).dataset()
    b = SyntheticImages(num_samples=200).dataset()
    assert torch.equal(a.tensors[0], b.tensors[0])
    images, labels = a.tensors
    means = torch.stack([images[labels == c].mean(0) for c in range(3)])
    assert (means[0] - means[1]).abs().mean() > 0.3, "classes must look different"


@pytest.mark.slow
def test_cnn_trains_on_fashion_mnist_files(tmp_path: Path) -> None:
    make_dataset(tmp_path / "data", "FashionMNIST", n=256)
    out = tmp_path / "run"
    result = run_cli(
        "model=cnn", "data=fashion_mnist", f"data.root={tmp_path / 'data'}", "train.steps=3",
        "train.batch_size=16", "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["choices"]["data"] == "fashion_mnist"
    assert summary["choices"]["model"] == "cnn"


def test_batches_resume_at_another_world_size_with_the_same_global_batches() -> None:
    """The data position is kept in samples of the epoch's order: after 3 steps on 2 ranks
    of 4, 4 ranks of 2 continue with the very samples the 2 ranks would have read next."""
    data = SyntheticImages(num_samples=40)

    def global_batches(world: int, batch: int, steps: int, state: dict | None = None) -> tuple[list, dict]:
        per_rank = []
        for rank in range(world):
            batches = data.batches(batch, rank, world, seed=0)
            if state is not None:
                batches.load_state_dict(state)
            stream = iter(batches)
            # each sample by the sum of its pixels, which no two samples share
            per_rank.append([[round(v, 3) for v in next(stream)[0].flatten(1).sum(1).tolist()] for _ in range(steps)])
        merged = [sorted(sum((r[step] for r in per_rank), [])) for step in range(steps)]
        return merged, batches.state_dict()

    whole, _ = global_batches(2, 4, 7)  # crosses into the second epoch (5 steps per epoch)
    first, state = global_batches(2, 4, 3)
    assert state == {"epoch": 0, "samples": 24}
    rest, _ = global_batches(4, 2, 4, state)
    assert first + rest == whole


class WhereItIsRead(torch.utils.data.Dataset):
    """Each sample says whether the process reading it was forked (its command line is its
    parent's) or started fresh (multiprocessing's spawn_main)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        started_by = Path("/proc/self/cmdline").read_text()
        fresh = "spawn_main" in started_by or "forkserver" in started_by
        return torch.tensor([0.0 if fresh else 1.0]), torch.tensor(0)


WORKERS = """
import multiprocessing
multiprocessing.set_start_method("spawn", force=True)  # as in a rank started by spawn
from torch.utils.data import DistributedSampler
from fsdp_exp.data import Batches
from tests.test_data import WhereItIsRead
data = WhereItIsRead()
batches = Batches(data, DistributedSampler(data, num_replicas=1, rank=0), batch_size=4, world_size=1, num_workers=1)
print(next(iter(batches))[0].flatten().tolist())
"""


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads Linux's /proc")
def test_data_workers_are_forked_from_their_rank_whatever_started_it() -> None:
    """A rank started by spawn or a forkserver has that as its default start method; its
    DataLoader workers would each be a fresh interpreter with a copy of the data set.
    They are forked from the rank, sharing its pages, as Linux's DataLoader does."""
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-c", WORKERS], capture_output=True, text=True, cwd=REPO, check=True)
    assert shown.stdout.split("\n")[0] == "[1.0, 1.0, 1.0, 1.0]", shown.stdout + shown.stderr[-2000:]


class WhoReadsIt(torch.utils.data.Dataset):
    """Each sample is the id of the process that read it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([os.getpid()]), torch.tensor(index)


def test_data_workers_carry_over_an_epochs_start_in_the_epochs_order() -> None:
    """One DataLoader reads the whole run: its workers are not started again at each epoch
    (a window holding an epoch's start waited for them: about 10% of its time against 2-4%),
    and the batches still follow each epoch's shuffled order, cut to whole batches."""
    data = WhoReadsIt()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=3, drop_last=True)
    batches = Batches(data, sampler, batch_size=5, world_size=1, num_workers=2)  # 2 batches an epoch
    stream = iter(batches)
    read = [next(stream) for _ in range(8)]  # four epochs
    readers = {int(pid) for inputs, _ in read for pid in inputs.flatten()}
    assert len(readers) == 2 and os.getpid() not in readers, readers
    order = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        order += list(sampler)[:10]
    assert [i for _, targets in read for i in targets.tolist()] == order
    assert batches.state_dict() == {"epoch": 4, "samples": 0}
