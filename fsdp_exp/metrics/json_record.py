"""What the records of fsdp_exp's files share (summary.json: fsdp_exp.metrics.summary;
estimate.json: fsdp_exp.estimate.record; max_batch.json: fsdp_exp.tasks.max_batch.record):
a dataclass whose fields are the file's keys, each named once, read and written as one.
A key the record has no field for is an error where a figure is made (`with_figures`); in
a file read (an older file's key) it is kept in `more`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from fsdp_exp.files import read_json, write_json

if TYPE_CHECKING:
    from typing_extensions import Self


class JsonRecord:
    """A base of `@dataclass(kw_only=True, slots=True)` records with a `more: dict` field."""

    __slots__ = ()
    FILE: ClassVar[str]  # its name in a run directory
    KEEPS_NONE: ClassVar[bool] = False  # a figure that is None: written as null, or left out

    more: dict[str, Any]

    @classmethod
    def names(cls) -> frozenset[str]:
        return _names(cls)

    @classmethod
    def of(cls, figures: Mapping[str, Any]) -> Self:
        """The record of a file's figures: each under its field, any other key (an older
        file's) in `more`."""
        record = cls()
        names = cls.names()
        for key, value in figures.items():
            if key in names:
                setattr(record, key, value)
            else:
                record.more[key] = value
        return record

    def with_figures(self, figures: Mapping[str, Any]) -> Self:
        """This record with `figures` added (a figure already here is replaced). Each is a
        field's: a figure it has no field for is an error where it is made, not a key that
        goes unseen into `more`."""
        names = self.names()
        unknown = sorted(key for key in figures if key not in names)
        if unknown:
            raise KeyError(f"{type(self).__name__} has no field for {', '.join(unknown)}")
        for key, value in figures.items():
            setattr(self, key, value)
        return self

    def as_dict(self) -> dict[str, Any]:
        """As the file holds it: its figures in field order, then `more`."""
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "more"}
        if not self.KEEPS_NONE:
            known = {k: v for k, v in known.items() if v is not None}
        return {**known, **self.more}

    def get(self, name: str, default: Any = None) -> Any:
        """A figure by its name (a field's, or one in `more`), or `default` when it is not set."""
        value = getattr(self, name) if name in self.names() else self.more.get(name)
        return default if value is None else value

    def write(self, run_dir: Path) -> None:
        self.write_to(Path(run_dir) / self.FILE)

    def write_to(self, path: Path) -> None:
        write_json(Path(path), self.as_dict())

    @classmethod
    def read(cls, run_dir: Path) -> Self | None:
        """A run directory's record; None where there is none or it cannot be read."""
        return cls.read_from(Path(run_dir) / cls.FILE)

    @classmethod
    def read_from(cls, path: Path) -> Self | None:
        figures = read_json(Path(path))
        return None if figures is None else cls.of(figures)


@cache
def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls) if f.name != "more")
