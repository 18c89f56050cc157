"""Checkpoints: RNG capture, atomic writes and validated loads.

A checkpoint is one ``torch.save`` file holding a dict with the format
marker ``{"format": "ppetrace.checkpoint", "version": 1, ...}``. The Trainer
fills it with the module's ``get_state()``, the optimizers, schedulers and
GradScaler, the RNG states and its counters. Files are written atomically (a
temporary file in the same folder, created exclusively, ``fsync``,
``os.replace``), so a write that fails or is interrupted leaves the previous
checkpoint intact; a failed write names the file and the cause, and the
temporary files of killed writes are removed by the next successful one. Loading uses
``torch.load(weights_only=True)``: a checkpoint holds only tensors and plain
Python containers, numbers and strings, and loading one runs no code.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "capture_rng",
    "load_checkpoint",
    "loader_generators",
    "restore_rng",
    "save_atomic",
]

FORMAT = "ppetrace.checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is not a file, cannot be read, is not a ppetrace checkpoint or does
    not fit what is being resumed; the message names the file. (A missing file raises
    ``FileNotFoundError``.)"""


# -- RNG states ----------------------------------------------------------------


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The distinct ``torch.Generator`` objects a DataLoader draws its order from."""
    found: list[torch.Generator] = []
    candidates = [getattr(loader, "generator", None)]
    for attr in ("sampler", "batch_sampler"):
        sampler = getattr(loader, attr, None)
        candidates.append(getattr(sampler, "generator", None))
        inner = getattr(sampler, "sampler", None)
        candidates.append(getattr(inner, "generator", None))
    for gen in candidates:
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _numpy_random() -> Any:
    try:
        import numpy.random as np_random
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return np_random


def capture_rng(generators: Iterable[torch.Generator] = ()) -> dict[str, Any]:
    """Snapshot the RNGs: torch (CPU, and CUDA once initialized), Python, NumPy, ``generators``."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "generators": [g.get_state() for g in generators],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np_random = _numpy_random()
    if np_random is not None:
        kind, keys, pos, has_gauss, gauss = np_random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    return state


def restore_rng(state: Mapping[str, Any], generators: Iterable[torch.Generator] = ()) -> None:
    """Restore a :func:`capture_rng` snapshot (generators matched by position)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    gens = list(generators)
    saved = list(state.get("generators", ()))
    if len(saved) != len(gens):
        raise CheckpointError(
            f"Expected {len(saved)} DataLoader generator(s) as when the checkpoint was written, "
            f"but the training loader has {len(gens)}. Resume with the same loader setup."
        )
    for gen, gen_state in zip(gens, saved, strict=True):
        gen.set_state(gen_state)
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    np_state = state.get("numpy")
    np_random = _numpy_random()
    if np_state is not None and np_random is not None:
        np_random.set_state(
            (
                np_state["kind"],
                np_state["keys"].numpy().astype("uint32"),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["gauss"],
            )
        )


# -- files -----------------------------------------------------------------------


def save_atomic(state: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` to ``path`` atomically and return the path.

    The data goes to a temporary file in the same folder, created exclusively
    (``O_CREAT | O_EXCL | O_NOFOLLOW``: it never opens an existing file or
    follows a symbolic link, and a name that is taken is retried with another),
    is flushed and fsynced, then renamed over ``path`` with ``os.replace``. On
    any error the temporary file is removed and ``path`` keeps its previous
    content; an ``OSError`` (a full disk, a missing permission) is raised again
    as one naming ``path`` and the cause. After a successful write, temporary
    files of ``path`` left by writes whose process is gone (killed in the
    middle) are removed.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _create_temp(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(dict(state), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise _write_error(target, exc) from exc
        raise
    _fsync_dir(target.parent)
    _remove_orphans(target)
    return target


_TEMP_MARK = ".tmp-"
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
_TEMP_FLAGS |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _temp_name(target: Path) -> Path:
    """``.<name>.tmp-<pid>-<random>`` beside ``target``."""
    return target.with_name(f".{target.name}{_TEMP_MARK}{os.getpid()}-{secrets.token_hex(6)}")


def _create_temp(target: Path) -> tuple[Path, int]:
    """A new temporary file beside ``target``, opened for writing: ``(path, fd)``."""
    for _ in range(100):
        tmp = _temp_name(target)
        try:
            return tmp, os.open(tmp, _TEMP_FLAGS, 0o666)
        except FileExistsError:
            continue  # taken (or a link planted there): never opened, try another name
        except OSError as exc:
            raise _write_error(target, exc) from exc
    raise _write_error(target, FileExistsError(f"100 temporary names beside {target} are taken"))


def _write_error(target: Path, exc: OSError) -> OSError:
    """``exc`` as an ``OSError`` (same errno) whose message names the checkpoint file."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    text = (
        f"Could not write the checkpoint {str(target)!r}: {cause}"
        f"{'' if exc.errno is None else f' (errno {exc.errno})'}. The previous checkpoint there "
        "is intact and the temporary file was removed; free some space, fix the folder's "
        "permissions, or point checkpoint_dir at another disk."
    )
    return OSError(text) if exc.errno is None else OSError(exc.errno, text)


def _remove_orphans(target: Path) -> None:
    """Remove ``target``'s temporary files whose writing process no longer exists."""
    prefix = f".{target.name}{_TEMP_MARK}"
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        pid_text = entry.name[len(prefix) :].partition("-")[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(entry.path)  # unlink never follows a link


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (``True`` when unsure)."""
    if pid == os.getpid() or os.name != "posix":  # Windows' os.kill would end the process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or no permission to ask
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by the Trainer, naming the file and the cause on failure.

    Raises ``FileNotFoundError`` when nothing exists at ``path`` and
    :class:`CheckpointError` when it is not a file, cannot be read or is not
    a ppetrace checkpoint; every message names the file and what to do.
    """
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(
            f"Expected a checkpoint file at resume_from={str(source)!r}, but it does not exist. "
            "Pass the path of a checkpoint written by the Trainer (checkpoint_dir/last.pt), "
            "or start without resume_from."
        )
    if not source.is_file():
        raise CheckpointError(
            f"Expected a checkpoint file at resume_from={str(source)!r}, but it is "
            f"{'a directory' if source.is_dir() else 'not a regular file'}. Pass the path of "
            "the checkpoint file itself (checkpoint_dir/last.pt)."
        )
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"Could not read the checkpoint {str(source)!r}: {_load_cause(exc)}. "
            "The file is corrupt, truncated or not a torch checkpoint; resume from another "
            "checkpoint or start without resume_from."
        ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"Expected a ppetrace checkpoint in {str(source)!r}, but it holds "
            f"{_describe(state)} without the format marker {FORMAT!r}. Pass a file written by "
            "ppetrace.Trainer."
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"Expected checkpoint version {VERSION} in {str(source)!r}, but it has version "
            f"{state.get('version')!r}. Resume with the ppetrace version that wrote it."
        )
    return state


_UNPICKLER = "WeightsUnpickler error:"


def _load_cause(exc: Exception) -> str:
    """Why ``torch.load`` failed, without torch's advice: a weights-only load's message
    tells to load with ``weights_only=False`` (running whatever the file holds), which
    is no advice to give about a corrupt file; its cause follows ``WeightsUnpickler
    error:``."""
    text = str(exc)
    if _UNPICKLER in text:
        text = text.split(_UNPICKLER, 1)[1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if "weights_only" not in ln and "Weights only" not in ln]
    return lines[0].rstrip(".") if lines else type(exc).__name__


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        keys = ", ".join(map(repr, list(value)[:5]))
        return f"a dict with keys {keys}" if keys else "an empty dict"
    return f"a {type(value).__name__}"
