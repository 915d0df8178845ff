"""logger=tensorboard: torch's SummaryWriter, rank 0's figures as TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdp_exp.logger.figures import flat, numbers

if TYPE_CHECKING:
    from fsdp_exp.logger.settings import TensorBoardSettings


class TensorBoard:
    """Each logged step's numeric figures as scalars at its step, flushed as they are written
    (a run stopped by Ctrl-C keeps them); the config as text; the summary's figures under
    `summary/` at the last step, and its words as text."""

    def __init__(self, settings: TensorBoardSettings, config: dict, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(settings.dir).expanduser() if settings.dir else Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.writer.add_text("config", table(flat(config)), 0)
        self.writer.flush()
        self.step = 0

    def where(self) -> str:
        return f"in {self.dir} (tensorboard --logdir {self.dir} shows it)"

    def log(self, record: dict) -> None:
        self.step = int(record["step"])
        for key, value in numbers(record).items():
            if key != "step":
                self.writer.add_scalar(key, value, self.step)
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        for key, value in numbers(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, self.step)
        words = {k: str(v) for k, v in summary.items() if isinstance(v, str)}
        if words:
            self.writer.add_text("summary", table(words), self.step)
        self.writer.close()


def table(values: dict[str, Any]) -> str:
    """Key and value as a markdown table, as TensorBoard's text tab shows it."""
    return "| key | value |\n| --- | --- |\n" + "\n".join(f"| {k} | {v} |" for k, v in values.items())
