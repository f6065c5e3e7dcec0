"""How xdist deals the suite's tests to its workers: whole cases.

A case's tests (forward, backward, invariants, for each backend) share one context, its inputs and float64
reference, built once per worker that runs any of them. xdist's load scheduling sends a worker a number of
tests that ignores case boundaries, so a case's tests were split between workers and its reference built on
each: a premerge run on two H200s (eight workers) built 211 contexts, on one (four workers) 199. Here every
batch is extended to the end of its last case. A worker that dies still has its tests re-dealt (unlike
`--dist loadgroup`, which cannot replace a crashed worker: pytest-xdist#1189).
"""

from __future__ import annotations

from xdist.scheduler import LoadScheduling

from verify.results import combo_of


def case_of(nodeid: str) -> str:
    """The case a test belongs to; a test of no case is a group of its own."""
    combo = combo_of(nodeid)
    return combo[1] if combo else nodeid


class CaseScheduling(LoadScheduling):
    """xdist's load scheduling, with every batch of tests extended to finish the case it ends in. With
    `--maxschedchunk 1` (the suite's default) each batch is one case."""

    def _send_tests(self, node, num: int) -> None:
        if 0 < num < len(self.pending):
            last_case = case_of(self.collection[self.pending[num - 1]])
            while num < len(self.pending) and case_of(self.collection[self.pending[num]]) == last_case:
                num += 1
        super()._send_tests(node, num)
