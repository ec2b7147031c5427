"""The memory-safety stress run, short: one run of 2 gloo processes, one install cycle, one fault."""

import json
import subprocess
import sys


def test_a_short_stress_run_is_clean_and_its_fault_fires(tmp_path):
    """Seed 7 draws an all-gather whose rank 0 fails at its first send while rank 1 sends late but
    in time: rank 0's receives are posted when it fails, and rank 1's data arrives after that. The
    run passes only if that data lands before rank 0's call returns (none after, in its outputs)."""
    argv = [sys.executable, "-m", "tide_core.bench", "stress", "--runs", "1", "--ranks", "2", "--cycles", "1"]
    argv += ["--steps", "2", "--seed", "7", "--fault-timeout-s", "2", "--no-write", "--scratch", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    [row] = json.loads((tmp_path / "stress.json").read_text())
    assert row["errors"] == [], row["errors"]
    assert row["exit codes"] == [0, 0] and row["aborted ranks"] == [] and row["hung ranks"] == []
    assert row["install cycles"] == 2 and row["steps"] == 4 and row["parity failures"] == 0
    assert row["faults fired"] == 1 and row["outcomes"] == {"PeerFailure": 1, "PeerStallTimeout": 1}
    assert row["late arrivals"] == 0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
