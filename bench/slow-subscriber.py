"""A KV-event subscriber that reads one message every DELAY seconds (0.2 by
default) and counts what it got: the slow reader bench/kv-events.sh runs
beside the engine.

    python3 bench/slow-subscriber.py tcp://127.0.0.1:5557 [DELAY]
"""
import signal
import sys
import time

import zmq


def stop(*_):
    raise KeyboardInterrupt


# The bench script runs this in the background, where SIGINT is ignored.
signal.signal(signal.SIGTERM, stop)

endpoint = sys.argv[1]
delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.RCVHWM, 16)
sub.connect(endpoint)
sub.setsockopt(zmq.SUBSCRIBE, b"")
got = 0
try:
    while True:
        if sub.poll(1000):
            sub.recv_multipart()
            got += 1
        time.sleep(delay)
except KeyboardInterrupt:
    pass
finally:
    print(f"slow subscriber read {got} messages", flush=True)
