"""Ask first_to_find_a_process_gone of a real process group whose store's host froze (SIGSTOP), as a machine that
hangs does: it must answer within its wait, not block the process for good.

python tests/workers/frozen_store.py   # prints "first True second False", then "frozen True <seconds>"
"""

import os
import signal
import socket
import subprocess
import sys
import time

import torch.distributed as dist

from app.host.runtime import first_to_find_a_process_gone

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
host = f"import torch.distributed as d, time; s = d.TCPStore('127.0.0.1', {port}, 1, True); print('up', flush=True); "
server = subprocess.Popen([sys.executable, "-c", host + "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
server.stdout.readline()
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 1, False), rank=0, world_size=1)
print("first", first_to_find_a_process_gone(), "second", first_to_find_a_process_gone(), flush=True)
os.kill(server.pid, signal.SIGSTOP)
while open(f"/proc/{server.pid}/stat").read().split(") ")[1][0] != "T":  # stopped: the signal is no instant
    time.sleep(0.01)
started = time.monotonic()
print("frozen", first_to_find_a_process_gone(), f"{time.monotonic() - started:.1f}", flush=True)
server.kill()
os._exit(0)  # the process group's teardown would wait for the frozen store
