"""The memory report's arena table, from the memory pass's JSON (tuples arrive as lists)."""

import json

from tide_core.bench.report_train import arena_table

MiB = 1 << 20


def _point(by_kind, transports=1):
    return {
        "peak_allocated": 1,
        "peak_reserved": 1,
        "tide_memory": {
            "arena_reserved": sum(nbytes for _, nbytes in by_kind.values()),
            "transports": transports,
            "arena_by_kind": by_kind,
        },
    }


def test_arena_table_lists_each_kind_of_segment_per_tide_system():
    memory = {
        "stock": {"2048": {"peak_allocated": 1, "peak_reserved": 1}},
        "in_place": {
            "2048": _point({"ring": (2, 4 * MiB)}, transports=3),
            "4096": _point({"ring": (2, 232 * MiB), "group": (1, 1002 * MiB), "staging": (1, 32 * MiB)}),
        },
        "slot_reuse": {"4096": _point({"ring": (2, 232 * MiB), "flags": (1, 1024)})},
    }
    lines = arena_table(json.loads(json.dumps(memory)))
    table = [line for line in "\n".join(lines).splitlines() if line.startswith("| ")]
    assert table[0] == "| system | transports | flags | group | ring | staging | total |"
    # The last tokens point of each system; a kind a system lacks is "-".
    assert table[2] == "| in_place | 1 | - | 1002.0 (1) | 232.0 (2) | 32.0 (1) | 1266.0 |"
    assert table[3] == "| slot_reuse | 1 | 0.0 (1) | - | 232.0 (2) | - | 232.0 |"


def test_arena_table_is_empty_without_tide_memory():
    assert arena_table({"stock": {"2048": {"peak_allocated": 1, "peak_reserved": 1}}, "in_place": None}) == []
