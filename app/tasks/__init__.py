"""Tasks: what differs between training a sequence classifier and a causal language model.

    task.py             the `Task` protocol that everything else sees; which task a model config is, with its reason
    classification.py   a text (or pair) -> a label: columns, labels, the classifier, accuracy and macro-F1
    first_token.py      a classifier's last layer computes only the first token, the one its head reads
    causal_lm.py        prompts and responses, conversations or plain text -> next tokens: the loss where labels are,
                        perplexity, exact match
    lm_data.py          the causal-LM formats: chat template, label masks, packing, the batch collator
    generation.py       greedy generation for many prompts (exact match, predict.py)

Everything else (the loop, the precision policy, telemetry, checkpoints) sees only the `Task` protocol of task.py.
"""
