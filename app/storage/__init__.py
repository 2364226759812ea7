"""Storage: what a run writes and reads back, and the promises around it (docs/guarantees.md).

    folders.py       the run's name and folders (RunPaths), their claims (FolderClaims), the checks that keep earlier
                     work safe, training_args.yaml, and removing what bad input created
    lease.py         the lease that claims one folder for one run: atomic, refreshed while the run lives, taken over
                     once stale
    checkpoints.py   CheckpointRecord (what each checkpoint records besides Accelerate's state) and Checkpoints:
                     atomic save, latest, pruning, resume; the only module that knows the layout on disk
    integrity.py     each checkpoint's record of its files (sizes, sha256), checked before a resume
    disk.py          file modes as the umask allows, free space before a save, a full disk as exit 4 on every rank,
                     text files written atomically
    final_model.py   the final model and tokenizer, gathered from shards and written atomically
    model_card.py    the output folder's README.md, from what the run did
    predictions.py   predict.py's --output_file: checked before any weights load, written atomically as CSV or JSON
                     lines, the input's own values as written

Nothing here trains, and nothing here is handed the whole training: each function gets the paths, config and
counters it writes.
"""
