"""data=token_file: nanoGPT's uint16 train.bin / val.bin, written here with numpy as
nanoGPT's prepare.py writes them, and read through the real loaders and the real CLI."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import precheck, read_json, read_jsonl, refused_here, run_cli
from fsdp_exp.config import ConfigError
from fsdp_exp.data.token_file import TokenFile, TokenWindows, first_bad_id


def write_tokens(file: Path, tokens) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=np.uint16).tofile(file)  # nanoGPT: arr.tofile(filename)
    return file


def learnable_tokens(n: int, vocab_size: int = 256, seed: int = 0) -> np.ndarray:
    """Ids that mostly follow a fixed random next-token table, with 10% noise."""
    rng = np.random.default_rng(seed)
    table, noisy, noise = rng.permutation(vocab_size), rng.random(n) < 0.1, rng.integers(0, vocab_size, n)
    tokens = np.zeros(n, dtype=np.uint16)
    for t in range(1, n):
        tokens[t] = noise[t] if noisy[t] else table[tokens[t - 1]]
    return tokens


def starts(inputs: torch.Tensor) -> list[int]:
    """The window each row came from: in a file of 0, 1, 2, ... a row starts at its own offset."""
    return inputs[:, 0].tolist()


# ---- windows ------------------------------------------------------------------------------
def test_a_sample_is_a_window_and_the_same_window_one_token_later(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(100))
    data = TokenFile(path=str(tmp_path), seq_len=8, vocab_size=100)
    dataset = data.dataset()
    assert data.tokens_per_sample == 8
    assert len(dataset) == 12  # starts 0, 8, ..., 88: the last window is tokens 88..96
    x, y = dataset[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
    assert x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))
    assert dataset[11][1].tolist() == list(range(89, 97))
    with pytest.raises(IndexError):
        dataset[12]


def test_stride_sets_where_windows_start_and_a_bin_file_can_be_named_directly(tmp_path: Path) -> None:
    file = write_tokens(tmp_path / "tokens.bin", np.arange(100))
    every = TokenFile(path=str(file), seq_len=8, stride=1, vocab_size=100).dataset()
    assert len(every) == 92  # every offset, as data=text has
    assert every[91][1].tolist() == list(range(92, 100))
    halves = TokenFile(path=str(file), seq_len=8, stride=4, vocab_size=100).dataset()
    assert [halves[i][0][0].item() for i in range(len(halves))] == list(range(0, 92, 4))


def test_eval_reads_val_bin_in_windows_that_do_not_overlap(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(100))
    write_tokens(tmp_path / "val.bin", np.arange(1000, 1050))
    held_out = TokenFile(path=str(tmp_path), seq_len=8, stride=1, vocab_size=2000).eval_dataset()
    assert len(held_out) == 6
    targets = torch.cat([held_out[i][1] for i in range(len(held_out))]).tolist()
    assert targets == list(range(1001, 1049)), "each held-out token is predicted once"


def test_eval_needs_a_whole_val_bin_and_names_data_path(tmp_path: Path) -> None:
    file = write_tokens(tmp_path / "train.bin", np.arange(100))
    data = TokenFile(path=str(tmp_path), seq_len=8, vocab_size=100)
    with pytest.raises(ConfigError, match=f"^data.path={re.escape(str(tmp_path))}: no val.bin in this directory"):
        data.eval_dataset()
    write_tokens(tmp_path / "val.bin", np.arange(8))
    with pytest.raises(ConfigError, match="val.bin holds 8 tokens; data.seq_len=8 needs at least 9"):
        data.eval_dataset()
    write_tokens(tmp_path / "val.bin", np.arange(95, 105))
    with pytest.raises(ConfigError, match="val.bin holds token id 100 at token 5"):
        data.eval_dataset()
    with pytest.raises(ConfigError, match=f"^data.path={re.escape(str(file))}: one .bin file has no held-out split"):
        TokenFile(path=str(file), seq_len=8, vocab_size=100).eval_dataset()


# ---- epochs, ranks, resume ----------------------------------------------------------------
def test_each_epoch_the_ranks_read_every_window_once_in_a_new_order(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(401))
    data = TokenFile(path=str(tmp_path), seq_len=8, vocab_size=401)  # 50 windows

    def read(rank: int, seed: int = 0) -> list[list[int]]:
        stream = iter(data.batches(batch_size=5, rank=rank, world_size=2, seed=seed))
        return [starts(next(stream)[0]) for _ in range(10)]  # two epochs of 5 steps

    rank0, rank1 = read(0), read(1)
    for epoch in (slice(0, 5), slice(5, 10)):
        seen0 = [start for batch in rank0[epoch] for start in batch]
        seen1 = [start for batch in rank1[epoch] for start in batch]
        assert not set(seen0) & set(seen1), "ranks must not share windows within an epoch"
        assert sorted(seen0 + seen1) == list(range(0, 400, 8)), "together they read every window once"
    assert rank0[:5] != rank0[5:], "each epoch is reshuffled"
    assert read(0) == rank0, "the order follows the seed alone"
    assert read(0, seed=1) != rank0


def test_loader_workers_read_the_same_batches_and_get_no_copy_of_the_file(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(20_001) % 50_000)
    dataset = TokenFile(path=str(tmp_path), seq_len=16, vocab_size=50_000).dataset()
    dataset[0]  # opens the memory map
    assert len(pickle.dumps(dataset)) < 1000, "a worker is sent the path, not the tokens"
    by_workers = [x for x, _ in DataLoader(dataset, batch_size=50, num_workers=2)]
    in_process = [x for x, _ in DataLoader(dataset, batch_size=50)]
    assert len(by_workers) == len(in_process) == 25
    assert all(torch.equal(a, b) for a, b in zip(by_workers, in_process))


# ---- refused input ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"seq_len": 0}, "data.seq_len=0: must be at least 1"),
        ({"stride": 0}, "data.stride=0: must be at least 1, or null for seq_len"),
        ({"vocab_size": 70000}, "data.vocab_size=70000: uint16 files hold ids below 65536, so at most 65536"),
        ({"num_workers": -1}, "data.num_workers=-1: must be at least 0"),
        ({"path": None}, "data.path=null: set it to a directory holding train.bin"),
    ],
)
def test_bad_settings_name_the_key(tmp_path: Path, settings: dict, expected: str) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(100))
    with pytest.raises(ConfigError) as err:
        TokenFile(**{"path": str(tmp_path), "seq_len": 8, "vocab_size": 100, **settings}).dataset()
    assert str(err.value).startswith(expected)


def test_a_text_file_or_an_llm_c_shard_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "input.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    with pytest.raises(ConfigError, match=f"^data.path={re.escape(str(text))}: not a directory or a .bin file"):
        TokenFile(path=str(text), seq_len=8).dataset()
    # llm.c / modded-nanogpt: 256 int32 of header (magic, version, token count), then the tokens
    shard = tmp_path / "fineweb_train_000001.bin"
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, 1000
    shard.write_bytes(header.tobytes() + np.arange(1000, dtype=np.uint16).tobytes())
    with pytest.raises(ConfigError, match="starts with llm.c's header"):
        TokenFile(path=str(shard), seq_len=8, vocab_size=65536).dataset()


def test_ids_of_a_big_file_are_checked_in_spread_out_stretches() -> None:
    """Past the budget, evenly spaced stretches from the first token to the last are read."""
    tokens = np.zeros(10_000, dtype=np.uint16)
    assert first_bad_id(tokens, 10, budget=1000, stretches=10) is None
    for offset in (0, 5555, 9999):  # 5500..5599 is one of the ten stretches
        bad = tokens.copy()
        bad[offset] = 12
        assert first_bad_id(bad, 10, budget=1000, stretches=10) == (offset, 12)
        assert first_bad_id(bad, 10) == (offset, 12)  # within the real budget: read whole
    bad = tokens.copy()
    bad[500] = 12  # between the first two stretches
    assert first_bad_id(bad, 10, budget=1000, stretches=10) is None


def test_an_id_the_sampled_check_missed_stops_the_read_of_its_window(tmp_path: Path) -> None:
    tokens = np.arange(100)
    tokens[42] = 200
    windows = TokenWindows(write_tokens(tmp_path / "train.bin", tokens), seq_len=8, stride=8, vocab_size=100)
    windows[4]
    with pytest.raises(ValueError, match="holds token id 200 at token 42; ids must be below data.vocab_size=100"):
        windows[5]


def test_the_data_vocab_must_fit_the_model_and_the_gpt_hint_names_token_file(tmp_path: Path) -> None:
    write_tokens(tmp_path / "train.bin", np.arange(100))
    args = ["model=gpt", "data=token_file", f"data.path={tmp_path}", "data.seq_len=8"]
    too_small = r"^model.vocab_size=64: smaller than the data's 100 tokens \(fsdp_exp.models.gpt.build_gpt returns 64"
    with pytest.raises(ConfigError, match=too_small):
        precheck([*args, "data.vocab_size=100", "model.vocab_size=64"])
    with pytest.raises(ConfigError, match=r"^model.vocab_size=256: smaller than the data's 50257 tokens"):
        precheck([*args, "model.vocab_size=256"])  # GPT-2's vocab is the default
    precheck([*args, "data.vocab_size=100", "model.vocab_size=128", "train.batch_size=4"])  # 12 samples of 8
    with pytest.raises(ConfigError, match="a language model reads data=synthetic_tokens, text, token_file or padded_tokens"):
        precheck(["model=gpt", "data=synthetic"])


BAD_FILES = {
    "missing": ("nowhere", None, "no such file or directory"),
    "no train.bin": ("data", {"val.bin": np.arange(100)}, "no train.bin in this directory"),
    "odd size": ("data", {"train.bin": b"\0" * 2001}, "train.bin has 2001 bytes, an odd number"),
    "too short": ("data", {"train.bin": np.arange(20)}, "train.bin holds 20 tokens; data.seq_len=32 needs at least 33"),
    "id too big": ("data", {"train.bin": [*range(77), 300, *range(100)]},
                   "train.bin holds token id 300 at token 77; ids must be below data.vocab_size=256"),
    "eval, no val.bin": ("data", {"train.bin": np.arange(100)}, "no val.bin in this directory"),
}


def make_bad_files(tmp_path: Path, case: str) -> tuple[Path, list[str], str]:
    name, files, expected = BAD_FILES[case]
    path = tmp_path / name
    for file_name, content in (files or {}).items():
        if isinstance(content, bytes):
            path.mkdir(exist_ok=True)
            (path / file_name).write_bytes(content)
        else:
            write_tokens(path / file_name, content)
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"")  # task=eval checks the held-out data before its weights
    task = ["task=eval", f"task.weights={weights}"] if case.startswith("eval") else []
    args = ["model=gpt", "model.vocab_size=256", "data=token_file", f"data.path={path}",
            "data.vocab_size=256", "data.seq_len=32", "wandb.mode=disabled", *task]
    return path, args, expected


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_files_are_refused_naming_data_path(case: str, tmp_path: Path) -> None:
    path, args, expected = make_bad_files(tmp_path, case)
    with pytest.raises(ConfigError) as refused:
        precheck(args)
    assert str(refused.value).startswith(f"data.path={path}: ") and expected in str(refused.value)
    assert "\n" not in str(refused.value)


def test_cli_refuses_a_bad_file_in_one_line_and_leaves_nothing_behind(tmp_path: Path) -> None:
    path, args, expected = make_bad_files(tmp_path, "id too big")
    work = tmp_path / "work"
    work.mkdir()
    result = refused_here(*args, cwd=work)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdp_exp: data.path={path}: "), result.stderr
    assert expected in lines[0]
    assert list(work.iterdir()) == [], "a refused run must leave no output directory"


# ---- a real run ---------------------------------------------------------------------------
@pytest.mark.slow
def test_gpt_trains_on_2_ranks_from_train_bin(tmp_path: Path) -> None:
    write_tokens(tmp_path / "data" / "train.bin", learnable_tokens(20_000))
    out = tmp_path / "run"
    result = run_cli(
        "model=gpt", "model.vocab_size=256", "data=token_file", f"data.path={tmp_path / 'data'}",
        "data.seq_len=32", "data.vocab_size=256", "train.steps=4", "train.batch_size=8", "train.log_every=1",
        "train.lr=3e-3", "launcher.nproc_per_node=2", "wandb.mode=disabled", f"hydra.run.dir={out}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["choices"]["data"] == "token_file"
    assert summary["world_size"] == 2
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32)
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32) for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.1, [r["loss"] for r in records]


@pytest.mark.slow
def test_eval_scores_trained_weights_on_val_bin(tmp_path: Path) -> None:
    """Weights trained on train.bin are scored on every token of val.bin, and the figures
    match a forward pass by hand over the same windows."""
    from safetensors.torch import load_file

    from fsdp_exp.models.gpt import build_gpt

    data = tmp_path / "data"
    write_tokens(data / "train.bin", learnable_tokens(20_000))
    write_tokens(data / "val.bin", learnable_tokens(20_000)[-1000:])  # same table, later tokens
    common = ["model=gpt", "model.vocab_size=256", "data=token_file", f"data.path={data}",
              "data.seq_len=32", "data.vocab_size=256", "wandb.mode=disabled"]
    train = tmp_path / "train"
    result = run_cli(*common, "train.steps=30", "train.batch_size=8", "train.lr=3e-3",
                     "checkpoint.export_full=true", f"hydra.run.dir={train}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = tmp_path / "eval"
    result = run_cli(*common, "task=eval", f"task.weights={train / 'model.safetensors'}",
                     f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = read_json(out / "summary.json")
    assert figures["eval_samples"] == (1000 - 33) // 32 + 1
    assert figures["eval_loss"] < 0.7 * np.log(256), "the table learned on train.bin holds on val.bin"

    model = build_gpt("tiny", vocab_size=256, block_size=1024)
    model.load_state_dict(load_file(train / "model.safetensors"))
    windows = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    windows = windows[: figures["eval_samples"] * 32 + 1].unfold(0, 33, 32)
    with torch.no_grad():
        logits = model.eval()(windows[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert figures["eval_loss"] == pytest.approx(loss.item(), rel=1e-5)
