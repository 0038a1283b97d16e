#!/usr/bin/env python3
"""Extract Qwen hidden states for one task (run by spawn.py, or by hand with flags). See docs/EXTRACTION.md."""

from extract.cli import exit_now, main

if __name__ == "__main__":
    exit_now(main())
