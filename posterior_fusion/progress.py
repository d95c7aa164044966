"""Progress for every long phase: a tqdm bar on a terminal, else a plain line every few
seconds on stderr (pipes, nohup, CI logs). ``PFUSE_PROGRESS=0`` (``pfuse --quiet``) silences both."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm

from posterior_fusion.environment import environment

T = TypeVar("T")
EVERY_SECONDS = 5.0


def enabled() -> bool:
    return bool(environment("PFUSE_PROGRESS"))


class _Plain:
    """Iterate and print ``desc: i/total (p%), elapsed, eta`` at most every ``every`` seconds."""

    def __init__(self, iterable: Iterable[T], desc: str, total: int | None, every: float) -> None:
        self.iterable, self.desc, self.every = iterable, desc, every
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.postfix = ""

    def set_postfix(self, **kw: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kw.items())

    def __iter__(self) -> Iterator[T]:
        start = last = time.monotonic()
        for i, item in enumerate(self.iterable, 1):
            yield item
            now = time.monotonic()
            if now - last >= self.every:
                last = now
                done = f"{i}/{self.total} ({100 * i / self.total:.0f}%)" if self.total else str(i)
                eta = f", eta {(now - start) / i * (self.total - i):.0f}s" if self.total else ""
                print(f"{self.desc}: {done}, {now - start:.0f}s{eta} {self.postfix}".rstrip(), file=sys.stderr, flush=True)

    def __len__(self) -> int:
        return self.total or 0


class _Quiet(_Plain):
    def __iter__(self) -> Iterator[T]:
        yield from self.iterable


def progress(iterable: Iterable[T], desc: str, total: int | None = None, show: bool = True):
    """Wrap ``iterable`` with the right progress display (supports ``set_postfix``)."""
    if not show or not enabled():
        return _Quiet(iterable, desc, total, EVERY_SECONDS)
    if sys.stderr.isatty():
        return tqdm(iterable, desc=desc, total=total, leave=False)
    return _Plain(iterable, desc, total, EVERY_SECONDS)


class LoaderProgress:
    """A DataLoader seen through :func:`progress` that keeps ``.dataset`` (laplace-torch reads it)."""

    def __init__(self, loader, desc: str) -> None:
        self.loader, self.desc, self.dataset = loader, desc, loader.dataset

    def __iter__(self):
        return iter(progress(self.loader, self.desc, len(self.loader)))

    def __len__(self) -> int:
        return len(self.loader)
