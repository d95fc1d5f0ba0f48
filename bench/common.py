"""What every benchmark here says the same way: the policies it compares, a median with its
spread, and verdicts that say "not decided" where the spreads overlap (never PASS or FAIL on a
difference the noise could make)."""

from __future__ import annotations

import statistics
import sys

from tensile_db.settings import UNPLANNED_POLICIES

#: The scheduling policies, the rivals first and tensile last, as the tables list them.
POLICIES = ("reactive", "dtr", "vdnn", "swap_score", "capuchin", "checkpoint", "tensile_published", "tensile")
#: What users would pick instead of tensile: the published planners, PyTorch-style
#: checkpointing and DTR.
RIVALS = ("vdnn", "swap_score", "capuchin", "checkpoint", "dtr", "tensile_published")
#: The policies that make plans.
PLANNED = tuple(p for p in POLICIES if p not in UNPLANNED_POLICIES)


def spread(values, fmt: str = ".3f") -> str:
    """``median [min, max]`` of ``values``, each with the format spec ``fmt``; the value alone
    when there is one."""
    values = list(values)
    return f"{values[0]:{fmt}}" if len(values) == 1 else " ".join(median_and_range(values, fmt))


def median_and_range(values, fmt: str = ".3f") -> list[str]:
    """``[median, "[min, max]"]`` of ``values`` with the format spec ``fmt``: two table cells."""
    values = list(values)
    return [f"{statistics.median(values):{fmt}}", f"[{min(values):{fmt}}, {max(values):{fmt}}]"]


def decided(low: float, high: float, target: float, higher_is_better: bool = True) -> str:
    """PASS when the whole spread ``[low, high]`` is at or above ``target`` (with
    ``higher_is_better`` False: at or below it), FAIL when all of it is on the other side, else
    not decided."""
    if not higher_is_better:
        return decided(-high, -low, -target)
    return "PASS" if low >= target else "FAIL" if high < target else "not decided"


def better(ours, theirs, higher_is_better: bool) -> str | None:
    """``"ours"`` or ``"theirs"``, whichever is better on every repeat (the two ranges do not
    overlap), else None (not decided)."""
    if min(ours) > max(theirs):
        return "ours" if higher_is_better else "theirs"
    if max(ours) < min(theirs):
        return "theirs" if higher_is_better else "ours"
    return None


def verdict(parts) -> str:
    """PASS if every part is ``yes``, FAIL if any is ``no``, else not decided."""
    return "PASS" if all(p == "yes" for p in parts) else "FAIL" if "no" in parts else "not decided"


def inline_copies(cost) -> str:
    """What the cost model ``cost`` says the executor's thread copies itself (Note [Copies beside
    kernels on every core] in ``tensile_db.runtime.device``), as a phrase."""
    if cost.inline_nbytes >= sys.maxsize:
        return "every copy to and from host memory"
    return f"copies of up to {cost.inline_nbytes:,} bytes"
