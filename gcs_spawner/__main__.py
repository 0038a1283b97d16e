"""`python -m gcs_spawner`: the same as the `gcs-spawner` console command."""

import sys

from gcs_spawner.cli import main

sys.exit(main())
