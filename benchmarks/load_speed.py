#!/usr/bin/env python
"""Model load time: opening SmolLM2's GGUF with the gguf package's GGUFReader against specjax's
struct-based GGUFFile (same process, best of 3 rotated rounds, specjax.benchtime), and the whole
load_model.

  python benchmarks/load_speed.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from gguf import GGUFReader

    from specjax.benchtime import interleaved_medians
    from specjax.models.gguf_file import GGUFFile
    from specjax.models.loader import default_gguf_path, load_model

    path = default_gguf_path()
    t = interleaved_medians({"reader": lambda: GGUFReader(path, "r"), "file": lambda: GGUFFile(path), "load": load_model},
                            3, warmup=0, stat=min)
    print(f"open: GGUFReader {t['reader']:.3f} s, GGUFFile {t['file']:.3f} s ({t['reader'] / t['file']:.0f}x faster); "
          f"load_model (open, dequantize, params, tokenizer) {t['load']:.2f} s")


if __name__ == "__main__":
    main()
