"""A small Mooncake-format trace for the workload, bench and trace-replay tests."""

from __future__ import annotations

import json
from pathlib import Path

# A Mooncake-format trace in which prompts share prefixes: (ms, input tokens, output tokens,
# hash ids). At a length scale of 1/32 each trace block is one 16-token KV block; requests 2
# and 4 start with request 1's first two blocks, request 5 with request 3's first; every prompt
# ends in a block of its own, so its last token is always computed. 80 of its 237 prompt
# tokens can come from a prefix cache.
SHARED_PREFIX_TRACE = [
    (0, 3 * 512, 6, [0, 1, 2]),
    (300, 3 * 512, 4, [0, 1, 3]),
    (600, 2 * 512, 9, [4, 5]),
    (900, 4 * 512 - 100, 3, [0, 1, 6, 7]),
    (1200, 2 * 512, 5, [4, 8]),
    (1500, 512, 1, [9]),
]


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": m, "hash_ids": h})
            + "\n"
            for t, n, m, h in rows
        )
    )
    return path
