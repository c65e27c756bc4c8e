"""What a sampled token's draw costs on the CPU: `sampling.draw` (one
uniform a row, looked up in its cumulative sums) against the rule it
replaced there (the argmax of probs / E, an exponential E a token) and
`torch.multinomial` (what a seeded row still calls, a row at a time), ms
a call.

Usage: PYTHONPATH=. python benchmarks/sample_draw.py [ROWSxVOCAB ...]
"""

from __future__ import annotations

import sys
import time

import torch

from pagedlm.sampling import draw


def timed(fn, repeats: int = 7) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1000 * (time.perf_counter() - t0) / repeats


def main() -> None:
    cases = sys.argv[1:] or ["1x49152", "16x49152", "1x262144", "8x262144", "64x151936"]
    print(f"threads {torch.get_num_threads()}")
    print("| rows x vocab | exponential a token | draw | multinomial, a row at a time | draw, a row at a time |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for case in cases:
        rows, vocab = map(int, case.split("x"))
        probs = torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)), -1)
        gen = torch.Generator().manual_seed(1)
        exponential = timed(lambda: (probs / torch.empty_like(probs).exponential_()).argmax(-1))
        batched = timed(lambda: draw(probs))
        multinomial = timed(lambda: [torch.multinomial(probs[i], 1, generator=gen) for i in range(rows)])
        one_by_one = timed(lambda: [draw(probs[i][None]) for i in range(rows)])
        print(f"| {rows} x {vocab:,} | {exponential:.2f} | {batched:.2f} | {multinomial:.2f} | {one_by_one:.2f} |")


if __name__ == "__main__":
    main()
