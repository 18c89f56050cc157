"""Whether two sets of runs ran in the same environment.

ppetrace records the environment of a run in its trace's
``otherData.environment`` (Python and torch versions, CPU model and count,
torch threads, device, ppetrace version). A comparison across environments
measures the environments too, so :func:`environment_warnings` names every
field that differs between the base and the candidate runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FIELDS", "environment_warnings"]

#: The fields that ppetrace records, in the order warnings name them; any other
#: field found is compared too, after these (``ranks``: the ranks of a run of several,
#: which ``summarize_run`` adds; a record without it has 1).
FIELDS = ("python", "torch", "cpu_model", "cpu_count", "torch_threads", "device", "ppetrace")


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


#: what a field that a record leaves out means: ``ranks`` is set for several ranks only
_IMPLIED = {"ranks": 1}


def _values(envs: Sequence[Mapping[str, Any]], key: str) -> list[str]:
    """The distinct values of ``key`` on one side, in first-seen order."""
    seen: list[str] = []
    for env in envs:
        shown = _show(env.get(key, _IMPLIED.get(key)))
        if shown not in seen:
            seen.append(shown)
    return seen


def environment_warnings(
    base: Sequence[Mapping[str, Any] | None], candidate: Sequence[Mapping[str, Any] | None]
) -> list[str]:
    """One line per environment field whose values differ between the base runs and the
    candidate runs, or between the runs of one side (``"environment differs:
    torch_threads: base 1, candidate 2"``; several values of one side are joined by
    `` / ``), and, unless no run has one, one line per side with runs that have no
    environment record (``"environment unknown: ..."``: they cannot be checked)."""
    out: list[str] = []
    if all(env is None for env in (*base, *candidate)):
        return out  # nothing recorded anywhere: nothing differs that could be named
    for label, envs in (("base", base), ("candidate", candidate)):
        missing = sum(env is None for env in envs)
        if missing:
            which = "run has" if missing == 1 else "runs have"
            out.append(
                f"environment unknown: {missing} {label} {which} no environment record (a "
                "trace written by an older ppetrace or another program), so it cannot be "
                "checked"
            )
    b = [env for env in base if env is not None]
    c = [env for env in candidate if env is not None]
    if not b or not c:
        return out
    extra = sorted({k for env in (*b, *c) for k in env} - set(FIELDS))
    for key in (*FIELDS, *extra):
        vb, vc = _values(b, key), _values(c, key)
        if set(vb) != set(vc) or len(vb) > 1:
            out.append(
                f"environment differs: {key}: base {' / '.join(vb)}, candidate {' / '.join(vc)}"
            )
    return out
