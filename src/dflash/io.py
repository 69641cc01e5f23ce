"""Atomic file writes: a crash leaves either the old file or the new one, never a torn one."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def normal_permissions(path: str | os.PathLike) -> None:
    """mkstemp/mkdtemp make owner-only files and folders; give them the modes an ordinary write would."""
    mode = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, mode & ~_umask())


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yields a temporary path in the target's folder; renamed over `path` only if the block succeeds."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    os.close(fd)
    try:
        yield tmp
        normal_permissions(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def save_png(fig, path: str | os.PathLike, dpi: int = 110) -> None:
    """Lays out a matplotlib figure, writes it as a PNG atomically and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)
