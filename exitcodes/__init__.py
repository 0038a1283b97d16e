"""The exit codes of every command, tool and consumer, each defined once here (bottom floor: imports nothing).

0 done; 1 failed; 2 usage (argparse's own); 65 bad input, `EX_DATAERR` of sysexits.h: what retrying cannot fix, so a
worker dead-letters the task and a unit does not restart (`RestartPreventExitStatus=65`). A consumer's other
failures are 70 (`EX_SOFTWARE`, a bug) and 75 (`EX_TEMPFAIL`, transient I/O); the queue retries both
(docs/PROTOCOL.md, "The consumer contract").
"""

EX_OK = 0
EX_FAILED = 1
EX_USAGE = 2
EX_DATAERR = 65
EX_SOFTWARE = 70
EX_TEMPFAIL = 75
