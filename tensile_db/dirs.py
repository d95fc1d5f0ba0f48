"""Directories only this OS user may enter: the coordinator's socket directory, its spill
directory and the served models' files. A leaf every layer may import."""

from __future__ import annotations

import os
import stat

from .errors import TensileError


def secure_dir(path: str, what: str, remedy: str = "remove it and call again") -> str:
    """Create ``path`` with mode 0700 if missing, and return it.

    Raises:
        TensileError: ``path`` is not a directory owned by this OS user, or others may enter it;
            the message calls it ``what`` and ends with ``remedy``.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise TensileError(f"{what} {path} must be a directory owned by uid {os.geteuid()} with mode 0700 (it has "
                           f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); {remedy}")
    return path
