"""What a request's quota charges cost in an engine process: the tenants' usage in this
process (one model, or one process) against the table that several models' engines share
(embedsvc/tenant_usage.py: a mapped file, flock around each change).

    flock /tmp/embedsvc-bench.lock .venv/bin/python bench/quota_table.py

One cycle is what admission does for one request of a tenant with every limit: ``take``,
``settle`` with the exact tokens, ``give_back`` as it is answered. The best of 5 repeats.
"""

from __future__ import annotations

import sys
import tempfile
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embedsvc.tenant_usage import UsageTable  # noqa: E402
from embedsvc.tenants import Keyring, Limits, Quotas, Tenant, digest  # noqa: E402

CYCLES = 20_000


def main() -> None:
    limits = Limits(requests_per_second=1e9, tokens_per_minute=1e11, inputs_in_flight=10**9)
    ring = Keyring.of([Tenant("t", digest("k"), limits)])
    table = UsageTable.open(Path(tempfile.mkdtemp()) / "quotas", 0, 3)
    for name, quotas in (("in this process", Quotas(ring)),
                         ("the shared table", Quotas(ring, table))):
        def cycle(q: Quotas = quotas) -> None:
            q.take("t", inputs=4, tokens=40)
            q.settle("t", 40, 38)
            q.give_back("t", 4)

        best = min(timeit.repeat(cycle, number=CYCLES, repeat=5)) / CYCLES
        print(f"{name}: {best * 1e6:.1f} us a request (take, settle, give_back)")


if __name__ == "__main__":
    main()
