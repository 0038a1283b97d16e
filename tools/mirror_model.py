#!/usr/bin/env python3
"""Copy a model checkpoint into a bucket (`gcs-spawner mirror`, gcs_spawner/cli.py, under its old name), so that
a fleet of a thousand VMs reads GCS instead of the Hugging Face Hub.

    python tools/mirror_model.py Qwen/Qwen2.5-7B gs://B/models/qwen2.5-7b [--revision R]
    python tools/mirror_model.py /path/to/local/model gs://B/models/mine

SOURCE is a hub id (downloaded with config, tokenizer and safetensors files only) or a local model directory.
DEST is a gs:// prefix or an existing local directory. Jobs then name DEST as their model.
"""

import sys

from gcs_spawner.cli import tool


def main(argv: list[str] | None = None) -> int:
    return tool("mirror", argv)


if __name__ == "__main__":
    sys.exit(main())
