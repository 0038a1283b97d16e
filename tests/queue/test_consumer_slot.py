"""A stop signal that arrives while the worker's own thread is starting or reaping its consumer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from taskqueue.process import ConsumerSlot

    slot = ConsumerSlot()
    consumer = slot.start([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    signal.signal(signal.SIGTERM, lambda signum, frame: slot.signal(signal.SIGKILL))
    with slot._lock:  # as while this thread starts or reaps a consumer
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # Python runs the handler here, on this same thread
    print(consumer.wait(timeout=10))
    """
)


def test_a_signal_handler_reaches_the_consumer_while_the_slot_is_busy():
    # With a plain lock the handler would wait forever for its own thread: the worker would hang on
    # its preemption notice instead of stopping the consumer and releasing the lease.
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "-9"  # the consumer got the handler's SIGKILL
