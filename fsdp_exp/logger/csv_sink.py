"""logger=csv: metrics.csv (a row a logged step) and summary.csv (one row) in the run directory."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from fsdp_exp.files import write_atomically


class Csv:
    """Each logged step a row of metrics.csv, appended as it is logged; a record with a figure
    the header lacks (eval's, at the end) writes the file again with it. The summary's
    single values one row of summary.csv."""

    def __init__(self, run_dir: Path):
        self.path, self.summary_path = Path(run_dir) / "metrics.csv", Path(run_dir) / "summary.csv"
        self.rows: list[dict] = []
        self.columns: list[str] = []

    def where(self) -> str:
        return f"in {self.path} and {self.summary_path}"

    def log(self, record: dict) -> None:
        row = single_values(record)
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            write_atomically(self.path, as_csv(self.columns, self.rows))
            return
        with open(self.path, "a", newline="") as file:
            csv.DictWriter(file, self.columns).writerow(row)

    def finish(self, summary: dict) -> None:
        row = single_values(summary)
        write_atomically(self.summary_path, as_csv(list(row), [row]))


def single_values(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (bool, int, float, str))}


def as_csv(columns: list[str], rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
