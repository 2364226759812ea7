"""What trains: every weight (a full fine-tune), or LoRA adapters (peft) on a frozen base, with trl's flag names.

    plan.py      the plan, made before any weight loads: the base's dtype, the adapters, the memory estimate; loading
                 the model as planned; what is frozen and what trains, said in counts and bytes; a resume's fit
    lora.py      which layers get adapters and which modules train in full; adding them with every trainable
                 parameter in float32; checkpoints that hold only what trains
    forward.py   the adapters' forward pass: the LoRA update added into the base layer's output by one product
    base.py      the frozen base: its dtype and the autocast it needs, the fp16 range check before the cast, its
                 fingerprint, the tensor names its files store
    trained.py   an output folder with adapters, loaded for prediction: its base found, the adapters merged in

The rule that makes the classic fp16 failure ("Attempting to unscale FP16 gradients") impossible lives in lora.py:
whatever the base is stored in, everything that trains is float32.
"""
