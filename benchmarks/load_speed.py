#!/usr/bin/env python
"""Model load time: opening SmolLM2's GGUF with the gguf package's GGUFReader against specjax's
struct-based GGUFFile (same process, best of 3 each), and the whole load_model.

  python benchmarks/load_speed.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best(fn, reps: int = 3) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def main():
    from gguf import GGUFReader

    from specjax.models.gguf_file import GGUFFile
    from specjax.models.loader import default_gguf_path, load_model

    path = default_gguf_path()
    old, new = best(lambda: GGUFReader(path, "r")), best(lambda: GGUFFile(path))
    print(f"open: GGUFReader {old:.3f} s, GGUFFile {new:.3f} s ({old / new:.0f}x faster); "
          f"load_model (open, dequantize, params, tokenizer) {best(load_model):.2f} s")


if __name__ == "__main__":
    main()
