"""data=padded_tokens: documents of any length padded to seq_len, with attention_mask and
labels masked at padding and prompts, trained by a Hugging Face model through its own loss
(loss=model), on real gloo ranks against the same training by hand in this process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_exp.commands.experiment import compose_config
from fsdp_exp.config import ConfigError
from fsdp_exp.data.padded import IGNORED, PaddedTokens
from fsdp_exp.data.tokens import shipped_corpus
from fsdp_exp.driver.plan import prepare
from fsdp_exp.driver.run import run_experiment
from tests.conftest import PARITY_RUN, PARITY_STEPS, names, precheck, read_jsonl

TINY_LLAMA = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "tie_word_embeddings": True}
SEQ_LEN, BATCH = 96, 8


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def instructions(path: Path) -> Path:
    """Prompt and response pairs of many lengths: the shipped text's lines, asked for by number."""
    lines = [line for line in shipped_corpus().read_text().splitlines() if len(line) > 8]
    return write_jsonl(path, [{"prompt": f"Line {i}?\n", "response": line[: 20 + 7 * (i % 11)]}
                              for i, line in enumerate(lines)])


def test_each_kind_of_file_gives_documents_padded_with_their_mask_and_labels(tmp_path: Path) -> None:
    records = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "Q: 2+2?\nA:", "response": " 4"},
                                                    {"text": "hello world"}, {"text": "x"}])
    chat = PaddedTokens(path=str(records), seq_len=16).dataset()
    assert len(chat) == 2  # a document of one token teaches nothing
    first, second = chat[0], chat[1]
    assert bytes(first["input_ids"][:13].tolist()) == b"Q: 2+2?\nA: 4" + b"\0"
    assert first["attention_mask"].tolist() == [1] * 12 + [0] * 4
    assert first["labels"].tolist() == [IGNORED] * 10 + list(b" 4") + [IGNORED] * 4
    assert second["labels"][:11].tolist() == list(b"hello world") and (second["labels"][11:] == IGNORED).all()

    tokens = tmp_path / "docs.bin"
    np.array([5, 6, 7, 50256, 8, 50256, 50256, 9, 10, 11, 12, 13], np.uint16).tofile(tokens)
    docs = PaddedTokens(path=str(tokens), seq_len=4, pad_id=50256).dataset()
    assert [docs[i]["input_ids"].tolist() for i in range(len(docs))] == [[5, 6, 7, 50256], [9, 10, 11, 12]]
    assert docs[0]["labels"].tolist() == [5, 6, 7, IGNORED] and docs[1]["attention_mask"].tolist() == [1] * 4

    synthetic = PaddedTokens(seq_len=64, num_samples=300)
    made = [synthetic.dataset()[i] for i in range(300)]
    lengths = torch.stack([item["attention_mask"].sum() for item in made])
    assert 16 <= lengths.min() and lengths.max() <= 64 and len(set(lengths.tolist())) > 20
    for item, length in zip(made, lengths):
        kept = item["labels"] != IGNORED
        prompt = int(length) - int(kept.sum())
        assert 0 <= prompt <= length // 4 and kept[prompt:length].all()
    assert torch.equal(PaddedTokens(seq_len=64, num_samples=300).dataset()[7]["input_ids"], made[7]["input_ids"])
    held_out = synthetic.eval_dataset()
    assert len(held_out) == 30 and not torch.equal(held_out[0]["input_ids"], made[0]["input_ids"])


@pytest.mark.parametrize("write, overrides, key, allowed", [
    (lambda d: None, {"path": "{d}/none.jsonl"}, "data.path={d}/none.jsonl", ("no such file",)),
    (lambda d: (d / "a.jsonl").write_text('{"text": "fine"}\n{oops\n'), {"path": "{d}/a.jsonl"},
     "data.path={d}/a.jsonl", ("line 2", "not JSON")),
    (lambda d: (d / "a.jsonl").write_text('{"question": "q"}\n'), {"path": "{d}/a.jsonl"},
     "data.path={d}/a.jsonl", ("line 1", "question", '{"prompt": ..., "response": ...}')),
    (lambda d: (d / "a.jsonl").write_text('{"prompt": "a long prompt", "response": "!"}\n'),
     {"path": "{d}/a.jsonl", "seq_len": 8}, "data.path={d}/a.jsonl", ("no document", "data.seq_len=8")),
    (lambda d: (d / "a.bin").write_bytes(b"\1\0\2"), {"path": "{d}/a.bin"}, "data.path={d}/a.bin", ("odd",)),
    (lambda d: np.array([1, 2, 300], np.uint16).tofile(d / "a.bin"), {"path": "{d}/a.bin", "vocab_size": 256},
     "data.path={d}/a.bin", ("token id 300", "data.vocab_size=256")),
    (lambda d: None, {"vocab_size": 100}, "data.vocab_size=100", ("bytes", "256")),
    (lambda d: None, {"pad_id": 256}, "data.pad_id=256", ("255",)),
    (lambda d: None, {"seq_len": 1}, "data.seq_len=1", ("2",)),
])
def test_a_file_without_documents_to_pad_is_refused_in_one_line(tmp_path: Path, write, overrides: dict, key: str,
                                                                  allowed: tuple[str, ...]) -> None:
    write(tmp_path)
    settings = {k: v.format(d=tmp_path) if isinstance(v, str) else v for k, v in overrides.items()}
    with pytest.raises(ConfigError) as err:
        PaddedTokens(**settings).dataset()
    names(str(err.value), key.format(d=tmp_path), *allowed)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_a_loss_that_would_read_the_labels_unshifted_is_refused(loss: str) -> None:
    with pytest.raises(ConfigError) as err:
        precheck(["model=hf", "data=padded_tokens", f"loss={loss}", "wandb.mode=disabled"])
    names(str(err.value), f"loss={loss}", "in line with its input_ids", "loss=model")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_LLAMA)).save_pretrained(path)
    return path


def test_a_hugging_face_model_trains_on_padded_instructions_through_its_own_loss_as_by_hand(
        llama_dir: Path, tmp_path: Path) -> None:
    """model=hf_dir with loss=model on 2 ranks (sharding=full): each step's loss and the final
    weights are those of the model trained here, unsharded, on the same two halves of each
    global batch: the mean over every answer token of the global batch, however many each
    half holds (each rank's mean weighed by its tokens); each step's share of padding is that
    of its batches."""
    data = instructions(tmp_path / "instructions.jsonl")
    args = [*PARITY_RUN, f"train.batch_size={BATCH}", "model=hf_dir", f"model.path={llama_dir}",
            "model.pretrained=true", "data=padded_tokens", f"data.path={data}", f"data.seq_len={SEQ_LEN}",
            "loss=model", "sharding=full"]
    out = tmp_path / "run"
    summary = run_experiment(prepare(compose_config(args), 0), out, args, {})
    assert summary.ok, summary.error
    records = read_jsonl(out / "metrics.jsonl")

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    padded = PaddedTokens(path=str(data), seq_len=SEQ_LEN)
    ranks = [iter(padded.batches(BATCH, rank, 2, seed=0)) for rank in (0, 1)]
    for step, record in enumerate(records[:PARITY_STEPS], start=1):
        halves = [next(batches) for batches in ranks]
        answers = [int((half["labels"][:, 1:] != IGNORED).sum()) for half in halves]
        assert answers[0] != answers[1], "the halves must differ for the weighing to show"
        loss = sum(model(**half, use_cache=False).loss * n for half, n in zip(halves, answers)) / sum(answers)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        kept = sum(int(half["attention_mask"].sum()) for half in halves)
        assert record["loss"] == pytest.approx(loss.item(), rel=1e-5), f"step {step}"
        assert record["padding_share"] == pytest.approx(1 - kept / (2 * BATCH * SEQ_LEN)), f"step {step}"
    assert len(records) == PARITY_STEPS and 0.2 < records[0]["padding_share"] < 0.9
    assert records[-1]["loss"] < records[0]["loss"]
    from safetensors.torch import load_file

    exported = load_file(out / "model.safetensors")
    for name, want in model.state_dict().items():
        torch.testing.assert_close(exported[f"hf.{name}"], want, rtol=1e-4, atol=1e-5)


def test_the_estimate_traces_a_hugging_face_model_on_padded_documents_through_its_own_loss() -> None:
    """task=estimate's trace of model=hf on data=padded_tokens, loss=model: the step on fake
    tensors, and what task=eval of its weights holds (the loss summed over the counted tokens,
    never read on the host)."""
    from fsdp_exp.commands.experiment import compose_checked
    from fsdp_exp.estimate.trace import trace

    plan = prepare(compose_checked(["model=hf", "data=padded_tokens", "data.seq_len=32", "device=cpu",
                                    "wandb.mode=disabled"]), 0)
    result = trace(plan.exp, 2, [4], on_gpu=False)
    (step,) = result.steps
    assert step.batch_size == 4 and step.eval_forward_bytes > 0
