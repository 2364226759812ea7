"""Inputs: what a run reads, checked before any weights load.

    data.py       the examples (the embedded reviews, --dataset_name, or files) and the loaders that batch them
    fingerprint.py the name of a tokenizing transform in datasets' cache, its tokenizer hashed by its contents
    reading.py    errors of reading user input (files, stdin, text and label cells) that name the file and the line,
                  or the row
    sampling.py   the training order of each epoch (a function of seed and epoch), the data position in examples that
                  a resume continues from, evaluation in length order
    batch_shape.py the examples of an optimizer step, which a resume keeps under another process count or batch size
    model.py      where the model and tokenizer come from, the cheap checks before the weights load, and the load
                  that names the weights a checkpoint lacked
    gguf.py       a model shipped as a GGUF file (SmolLM2): converted once into a model folder in the cache
    hub.py        whether the Hugging Face Hub answers, asked once before a name that is no local path is looked up

The task (app/tasks/) checks the columns and tokenizes; nothing here knows about ranks or precision.
"""
