"""The reference model of a worker rank's residency, shared by the model
tests (tests/client/test_index_model.py, tests/snapshot/test_property.py).
It shares no code with the index: one rank's event log since its last reset
is replayed from scratch."""

from __future__ import annotations

from collections import Counter

from tests.client.builders import STATE


def replay(log: list[tuple]) -> tuple[dict, dict, dict, Counter, set]:
    """(trusted, suspect, placeholder) counters keyed (group, medium, h), unknown
    removals per group, and the groups seen, from one rank's log. A group is
    seen from its first store or removal, whatever it names: a store with no
    hash (a group's shape store) holds nothing but makes its group count in the
    prefix rule, so an empty state group allows no prefix."""
    trusted: Counter = Counter()
    suspect: Counter = Counter()
    holder: Counter = Counter()
    unknown: Counter = Counter()
    groups: set[int] = set()
    for op in log:
        if op[0] == "store":
            _, g, m, hashes, placeholder = op
            groups.add(g)
            if g == STATE and m != "GPU" and len(hashes) > 1:
                # offload tiers hold one state per chunk; GPU lists only checkpoints
                hashes = hashes[-1:]
            for h in hashes:
                (holder if placeholder else trusted)[(g, m, h)] += 1
        elif op[0] == "remove":
            _, g, m, hashes = op
            groups.add(g)
            for h in hashes:
                for layer in (trusted, suspect, holder):
                    if layer[(g, m, h)] > 0:
                        layer[(g, m, h)] -= 1
                        break
                else:
                    unknown[g] += 1
        elif op[0] == "gap":
            for k, n in trusted.items():
                suspect[k] += n
            trusted.clear()
        elif op[0] == "clear":
            trusted.clear()
            suspect.clear()
            holder.clear()
    return dict(trusted), dict(suspect), dict(holder), unknown, groups
