"""task=eval: loss and accuracy of trained weights on the data's held-out split."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.data import DataLoader

from fsdp_exp.batch import forward_keys
from fsdp_exp.checkpoint.export import load_weights, weight_shapes
from fsdp_exp.checkpoint.files import CheckpointError
from fsdp_exp.checkpoint.resume import model_shapes, open_checked
from fsdp_exp.errors import ConfigError, at_least
from fsdp_exp.metrics.figures import EvalAnswer
from fsdp_exp.models import ModelSpec
from fsdp_exp.tasks import Task
from fsdp_exp.tasks.export import plain_model

if TYPE_CHECKING:
    from fsdp_exp.config import Experiment
    from fsdp_exp.launcher.core import Launcher
    from fsdp_exp.run_context import RunContext

log = logging.getLogger("fsdp_exp")


@dataclass
class Eval(Task):
    runs_in_driver: ClassVar[bool] = True

    weights: str | None = None  # model.safetensors, model.pt, a DCP step_* directory or a checkpoint.dir
    batch_size: int = 256
    show: int = 8  # predictions printed next to their labels

    def __post_init__(self) -> None:
        at_least("task.batch_size", self.batch_size, 1)
        at_least("task.show", self.show, 0)

    def check(self, exp: Experiment) -> None:
        if self.weights is None:
            raise ConfigError("task.weights: task=eval needs weights (model.safetensors, model.pt, "
                              "a step_* directory or a checkpoint.dir)")
        exp.data.eval_dataset()  # a missing held-out split is refused before the run
        path = Path(self.weights).expanduser()
        if path.is_dir():
            open_checked(path, exp.model, "task.weights")
        elif not path.is_file():
            raise ConfigError(f"task.weights={path}: no such file or checkpoint")
        else:
            check_weights_file(path, exp.model)

    @torch.no_grad()
    def run(self, exp: Experiment, context: RunContext, run_dir: Path, launcher: Launcher, nproc: int) -> EvalAnswer:
        """In this process, on this machine's first GPU when it has one (the plan decided
        exp.device from this machine, not from the launcher's nodes)."""
        device = torch.device("cuda", 0) if exp.device == "cuda" else torch.device("cpu")
        log.info("eval in this process on %s", device)
        model = plain_model(exp.model)
        load_weights(model, Path(self.weights).expanduser(), "task.weights")
        model.to(device).eval()
        data = exp.data
        loader = DataLoader(data.eval_dataset(), batch_size=self.batch_size, shuffle=False)
        loss, classifies = exp.loss, exp.loss.classifies
        loss_sum, correct, count = 0.0, 0, 0
        shown: list[tuple[Any, Any]] = []
        keys, takes = data.batch_keys, forward_keys(model)
        for raw in loader:
            batch = keys.read(raw, takes, loss.reads_targets, device)
            output = batch.forward(model)
            loss_sum += float(loss(output, batch, reduction="sum"))
            count += loss.counted(batch)
            if classifies:  # the loss's own predictions: the argmax over its classes
                targets = batch.targets
                predictions, counted = loss.predictions(output), targets != loss.ignore_index
                correct += int(((predictions == targets) & counted).sum())
                if len(shown) < self.show:
                    shown += _examples(predictions, targets, self.show - len(shown))
        answer = EvalAnswer(eval_loss=loss_sum / max(count, 1), eval_samples=len(loader.dataset),
                            weights=str(Path(self.weights).expanduser()),
                            examples=[{"predicted": p, "label": t} for p, t in shown])
        accuracy = ""
        if classifies:
            answer.eval_accuracy = correct / max(count, 1)
            accuracy = f", accuracy {100 * answer.eval_accuracy:.2f}%"
        log.info("eval on %d held-out samples: loss %.4f%s", answer.eval_samples, answer.eval_loss, accuracy)
        if shown:
            log.info("predicted / label:\n%s", "\n".join(f"  {p!r:>12} / {t!r}" for p, t in shown))
        return answer


def check_weights_file(path: Path, model: ModelSpec) -> None:
    """A weights file that is readable and holds this model's tensors, by name and shape."""
    try:
        saved = weight_shapes(path, "task.weights")
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    wanted = model_shapes(model)
    differences = [f"{name} is {saved.get(name) or 'absent'} there, {wanted.get(name) or 'absent'} here"
                   for name in sorted(set(saved) | set(wanted)) if saved.get(name) != wanted.get(name)]
    if differences:
        more = f"; and {len(differences) - 4} more" if len(differences) > 4 else ""
        raise ConfigError(f"task.weights={path}: saved from a different model: {'; '.join(differences[:4])}{more}")


def _examples(predictions: torch.Tensor, targets: torch.Tensor, n: int) -> list[tuple[Any, Any]]:
    """Images: one class per sample. Token sequences: the first sequence, as text when
    its tokens are bytes of printable text, else as token ids. Other targets (a
    segmentation's maps): none."""
    if targets.dim() > 2:
        return []
    if targets.dim() == 1:
        return [(int(p), int(t)) for p, t in zip(predictions[:n].tolist(), targets[:n].tolist())]
    pred, label = predictions[0, :n * 8].tolist(), targets[0, :n * 8].tolist()
    if max(pred + label) < 128:
        return [(bytes(pred).decode(errors="replace"), bytes(label).decode(errors="replace"))]
    return [(pred[:n], label[:n])]
