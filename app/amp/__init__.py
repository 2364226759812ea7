"""AMP: the reason this app exists. Everything about mixed precision lives here, in the order a run meets it:

    policy.py    the one precision decision, with its reason (fp16, bf16 or fp32; autocast; whether to scale)
    scaler.py    the loss scaler for the backend, its checkpointable state, and the overflow flag brought to the host
    watches.py   the loss-scale alarm and the watch for non-finite losses
    diagnose.py  the fp16 pre-flight before step 1, and the overflow report that names the first module to overflow
    fallback.py  --on_scale_collapse fallback: back to the last checkpoint, on in bf16 or fp32
    headroom.py  amp/headroom_bits: how far the largest fp16 activation is from 65504, measured at log steps

The loop (app/loop.py) calls autocast and the scaler the same way in every mode; with AMP off they are exact no-ops.
"""
