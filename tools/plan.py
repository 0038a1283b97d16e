#!/usr/bin/env python3
"""What a job will cost, before it is launched: `plan.py JOB --accelerator v5litepod-8 [--tasks tasks.jsonl]`.

The planner lives in reporting/plan.py; see its docstring.
"""

import sys

from reporting.plan import main

if __name__ == "__main__":
    sys.exit(main())
