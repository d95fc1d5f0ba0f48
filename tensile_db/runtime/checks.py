"""What the runtime's validation says of bad input: a value as the user wrote it, and the check of
an object's keys; and :func:`require`, the check of an internal invariant. A leaf: it imports
nothing of the package but its errors."""

from __future__ import annotations

import json

from ..errors import InvalidArgument

#: The longest a value is shown in an error message, characters.
SHOWN_CHARS = 40


def shown(value) -> str:
    """``value`` as JSON (``repr`` for what JSON cannot write), cut to :data:`SHOWN_CHARS`
    characters, for an error message."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def check_keys(obj: dict, allowed, where: str, kind: str = "") -> None:
    """Raise InvalidArgument for the first key of ``obj`` not in ``allowed``, naming ``where`` it
    is and listing the keys allowed; ``kind`` names what the keys belong to (e.g. "a dense
    layer") where ``where`` does not."""
    for key in obj:
        if key not in allowed:
            belongs = f" for {kind}" if kind else ""
            raise InvalidArgument(f"{where}: unknown key {key!r}{belongs}; allowed keys: {', '.join(allowed)}")


def require(condition: bool, what: str) -> None:
    """Raise AssertionError saying ``what`` unless ``condition``: an invariant's check that also
    runs under ``python -O``."""
    if not condition:
        raise AssertionError(what)
