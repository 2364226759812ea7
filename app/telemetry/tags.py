"""The TensorBoard vocabulary: every scalar and text tag the app writes, each scalar with its unit in its name.

Scripts and tests read runs back through these names, so a tag is renamed here or nowhere.
"""

# ---- scalars --------------------------------------------------------------------------------------------------------
TRAIN_LOSS, TRAIN_LR, TRAIN_GRAD_NORM, TRAIN_EPOCH = "train/loss", "train/lr", "train/grad_norm", "train/epoch"
TRAIN_STOPPED_EARLY = "train/stopped_early"  # 1 at the step where early stopping ended the run
AMP_LOSS_SCALE = "amp/loss_scale"
AMP_SKIPPED_STEPS = "amp/skipped_steps"  # cumulative
AMP_SKIP_RATE = "amp/skip_rate"  # skipped / optimizer steps, over the last interval
AMP_CONSECUTIVE_SKIPS = "amp/consecutive_skips"
AMP_APPLIED_UPDATES = "amp/applied_updates"  # cumulative
PERF_SAMPLES_PER_SEC, PERF_TOKENS_PER_SEC = "perf/samples_per_sec", "perf/tokens_per_sec"  # tokens: padding excluded
PERF_PADDING_FRACTION, PERF_STEP_TIME_MS, PERF_MFU_PCT = "perf/padding_fraction", "perf/step_time_ms", "perf/mfu_pct"
MEMORY_RSS_GIB = "memory/rss_gib"  # CPU: resident set of the process
MEMORY_ALLOCATED_GIB, MEMORY_RESERVED_GIB = "memory/allocated_gib", "memory/reserved_gib"  # GPU
MEMORY_PEAK_ALLOCATED_GIB = "memory/peak_allocated_gib"  # GPU, since the previous log
EVAL_LOSS, EVAL_ACCURACY, EVAL_F1 = "eval/loss", "eval/accuracy", "eval/f1"  # f1: macro-averaged
EVAL_PERPLEXITY = "eval/perplexity"  # exp(eval/loss): causal_lm, whose eval/loss is the mean over label tokens
EVAL_EXACT_MATCH = "eval/exact_match"  # causal_lm with prompts: share of greedy responses equal to the reference

# ---- texts (markdown, written once at step 0) -----------------------------------------------------------------------
RUN_CONFIG, RUN_ENVIRONMENT, RUN_PRECISION, RUN_TF32 = "run/config", "run/environment", "run/precision", "run/tf32"

# ---- texts written when they happen (fp16 diagnostics: app/amp/diagnose.py, app/amp/fallback.py) ------------------
AMP_PREFLIGHT = "amp/preflight"  # before step 1: the first batch's module outputs against fp16's range
AMP_OVERFLOW_REPORT = "amp/overflow_report"  # at the alarm: the first module whose output or gradient overflowed
AMP_FALLBACK = "amp/fallback"  # --on_scale_collapse fallback: from which step, to which precision, why

# ---- the metric columns of TensorBoard's HPARAMS tab, read from the scalars above -----------------------------------
HPARAM_METRICS = [
    EVAL_ACCURACY,
    EVAL_F1,
    EVAL_LOSS,
    EVAL_PERPLEXITY,
    EVAL_EXACT_MATCH,
    PERF_SAMPLES_PER_SEC,
    AMP_SKIPPED_STEPS,
    AMP_LOSS_SCALE,
]
