"""Where the device waits in a `torch.profiler` trace (Chrome's format,
gzipped or not), e.g. ``mask_steps.py``'s ``TRACE=FILE``: the span from the
first kernel or copy to the last, the time the device was busy (kernels,
copies and memsets merged where they touch or overlap), the idle rest, each
over ``STEPS`` steps; and the largest idle gaps, with the kernel or copy on
either side.

Usage: python benchmarks/trace_gaps.py TRACE [STEPS (30)] [GAPS (5)]
"""

from __future__ import annotations

import gzip
import json
import sys


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    shown = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                    key=lambda e: e["ts"])
    busy: list[list] = []  # [start, end, first name, last name]
    for e in device:
        start, end = e["ts"], e["ts"] + e["dur"]
        if busy and start <= busy[-1][1] + 1:
            busy[-1][1], busy[-1][3] = max(busy[-1][1], end), e["name"]
        else:
            busy.append([start, end, e["name"], e["name"]])
    span = busy[-1][1] - busy[0][0]
    used = sum(b[1] - b[0] for b in busy)
    print(json.dumps({"trace": path, "steps": steps, "span_ms_per_step": round(span / steps / 1e3, 3),
                      "busy_ms_per_step": round(used / steps / 1e3, 3),
                      "idle_ms_per_step": round((span - used) / steps / 1e3, 3)}))
    gaps = sorted(((busy[i + 1][0] - busy[i][1], i) for i in range(len(busy) - 1)), reverse=True)
    for gap, i in gaps[:shown]:
        print(f"  {gap / 1e3:.3f} ms idle after {busy[i][3][:50]!r}, before {busy[i + 1][2][:50]!r}")


if __name__ == "__main__":
    main()
