"""What holds a kernel's warps, from an Nsight Compute report's raw page (`ncu --import R --page raw --csv`): per
profiled launch its time, DRAM throughput, occupancy, issue rate and the largest warp stall reasons (cycles a warp
spends stalled per issued instruction, by reason).

    python benchmarks/ncu_stalls.py ncu-attention-raw.csv [--top 8]
"""

from __future__ import annotations

import argparse
import csv
import sys

SUMMARY = {
    "gpu__time_duration.sum": "time",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM % of peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots busy %",
    "launch__registers_per_thread": "registers",
    "launch__occupancy_limit_registers": "blocks by registers",
    "launch__occupancy_limit_shared_mem": "blocks by shared memory",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def rows(path: str) -> tuple[list[str], list[str], list[list[str]]]:
    """The raw page's metric names, their units and one row per profiled launch (ncu's CSV: names, units, rows)."""
    with open(path, newline="") as handle:
        lines = [line for line in csv.reader(handle) if line]
    start = next((i for i, line in enumerate(lines) if "ID" in line and "Kernel Name" in line), None)
    if start is None:
        sys.exit(f"{path}: no raw-page header (ID, Kernel Name) found")
    return lines[start], lines[start + 1], lines[start + 2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw_csv")
    parser.add_argument("--top", type=int, default=8, help="stall reasons shown per launch")
    args = parser.parse_args()
    names, units, launches = rows(args.raw_csv)
    column = {name: i for i, name in enumerate(names)}
    stalls = [name for name in names if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX)]
    for launch in launches:
        print(f"launch {launch[column['ID']]}: {launch[column['Kernel Name']][:60]}")
        summary = [f"{label} {launch[column[name]]}{' ' + units[column[name]] if units[column[name]] else ''}"
                   for name, label in SUMMARY.items() if name in column]
        print("  " + "; ".join(summary))
        ranked = sorted(((float(launch[column[name]].replace(",", "") or 0), name) for name in stalls), reverse=True)
        print("  stalls (cycles per issued instruction): " + ", ".join(
            f"{name[len(STALL_PREFIX):-len(STALL_SUFFIX)]} {value:.2f}" for value, name in ranked[:args.top]))


if __name__ == "__main__":
    main()
