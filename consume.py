#!/usr/bin/env python3
"""Extract a language model's activations (hidden states, hook sites) for one task (run by spawn.py, or by hand with
flags). The supported families are in docs/MODEL.md; the job in docs/EXTRACTION.md."""

from extract.cli import exit_now, main

if __name__ == "__main__":
    exit_now(main())
