"""The host: the machine a process runs on, and what the app does about it.

    runtime.py      the Accelerator (always mixed_precision="no"), the check that launched processes form one job,
                    collectives over host values, what runs (backend, device, threads) in words
    device.py       which device a process trains on (the launch's --cpu, else the accelerator), before any Accelerator
    preemption.py   SIGTERM and SIGINT: a flag the ranks agree on once per optimizer step
    starting.py     SIGTERM and SIGINT before that, while the libraries import: one line, at once
    memory.py       glibc malloc keeps a step's large freed blocks for the next step
    dropout.py      CPU dropout masks from 32 bits of SFC64 per element where torch draws them serially, attention
                    with them, and which masks a run draws (DropoutMasks), kept on resume

Model, data and precision code never ask which rank they run on: what differs by rank or machine is decided here.
"""
