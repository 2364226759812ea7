"""The TensorBoard vocabulary: every scalar and text tag the app writes, each scalar with its unit in its name.

Scripts and tests read runs back through these names, so a tag is renamed here or nowhere. The custom-scalars layout
that groups them into charts is built from these names in layout.py.
"""

# ---- scalars --------------------------------------------------------------------------------------------------------
TRAIN_LOSS, TRAIN_LR, TRAIN_GRAD_NORM, TRAIN_EPOCH = "train/loss", "train/lr", "train/grad_norm", "train/epoch"
TRAIN_STOPPED_EARLY = "train/stopped_early"  # 1 at the step where early stopping ended the run
# The scaler's tags: written only while loss scaling is on (fp16), so a run without them had AMP off.
AMP_LOSS_SCALE = "amp/loss_scale"
AMP_SKIPPED_STEPS = "amp/skipped_steps"  # cumulative
AMP_SKIP_RATE = "amp/skip_rate"  # skipped / optimizer steps, over the last interval
AMP_CONSECUTIVE_SKIPS = "amp/consecutive_skips"
AMP_APPLIED_UPDATES = "amp/applied_updates"  # cumulative
SCALER_TAGS = (AMP_LOSS_SCALE, AMP_SKIPPED_STEPS, AMP_SKIP_RATE, AMP_CONSECUTIVE_SKIPS, AMP_APPLIED_UPDATES)
AMP_HEADROOM_BITS = "amp/headroom_bits"  # fp16 autocast: log2(65504 / max |x|) over fp16 activations, at log steps
PERF_SAMPLES_PER_SEC, PERF_TOKENS_PER_SEC = "perf/samples_per_sec", "perf/tokens_per_sec"  # tokens: padding excluded
PERF_TOKENS_PER_SEC_PER_DEVICE = "perf/tokens_per_sec_per_device"  # the total over the number of processes
PERF_PADDING_FRACTION, PERF_STEP_TIME_MS, PERF_MFU_PCT = "perf/padding_fraction", "perf/step_time_ms", "perf/mfu_pct"
# Once, at the end: every timed interval's samples over their seconds, as the summary's samples/s (a mean of the
# perf/samples_per_sec points would weigh an interval of one step as much as one of a hundred).
RUN_SAMPLES_PER_SEC = "run/samples_per_sec"
MEMORY_RSS_GIB = "memory/rss_gib"  # CPU: resident set of the process
MEMORY_ALLOCATED_GIB, MEMORY_RESERVED_GIB = "memory/allocated_gib", "memory/reserved_gib"  # GPU
MEMORY_PEAK_ALLOCATED_GIB = "memory/peak_allocated_gib"  # GPU, since the previous log
# GPU, since the previous log: the peaks as a share of the device's total memory
MEMORY_PEAK_ALLOCATED_PCT = "memory/device_pct/peak_allocated"
MEMORY_PEAK_RESERVED_PCT = "memory/device_pct/peak_reserved"
MEMORY_ALLOC_RETRIES, MEMORY_OOMS = "memory/alloc_retries", "memory/ooms"  # GPU, cumulative counts of the allocator
# At step 0, before any weight loads: weights, gradients and AdamW state (telemetry/footprint.py); what trains
MEMORY_ESTIMATE_GIB, MODEL_TRAINABLE_PARAMS = "memory/estimate_gib", "model/trainable_params"
EVAL_LOSS, EVAL_ACCURACY, EVAL_F1 = "eval/loss", "eval/accuracy", "eval/f1"  # f1: macro-averaged
EVAL_PERPLEXITY = "eval/perplexity"  # exp(eval/loss): causal_lm, whose eval/loss is the mean over label tokens
EVAL_EXACT_MATCH = "eval/exact_match"  # causal_lm with prompts: share of greedy responses equal to the reference

# ---- texts (markdown, written once at step 0) -----------------------------------------------------------------------
RUN_CONFIG, RUN_ENVIRONMENT, RUN_PRECISION, RUN_TF32 = "run/config", "run/environment", "run/precision", "run/tf32"

# ---- texts written when they happen (fp16 diagnostics: app/amp/diagnose.py, app/amp/fallback.py) ------------------
AMP_PREFLIGHT = "amp/preflight"  # before step 1: the first batch's module outputs against fp16's range
AMP_OVERFLOW_REPORT = "amp/overflow_report"  # at the alarm: the first module whose output or gradient overflowed
AMP_FALLBACK = "amp/fallback"  # --on_scale_collapse fallback: from which step, to which precision, why
AMP_HEADROOM_MODULE = "amp/headroom_module"  # at a log step where the module that sets amp/headroom_bits changes

# ---- scripts/compare_amp.py's comparison: one run per precision, <name>/<fp16|bf16|fp32>, each with these -----------
COMPARE_GRAD_NORM, COMPARE_TRAIN_LOSS = "compare/grad_norm", "compare/train_loss"
COMPARE_EVAL_LOSS, COMPARE_SAMPLES_PER_SEC = "compare/eval_loss", "compare/samples_per_sec"
COMPARE_PEAK_MEMORY_GIB = "compare/peak_memory_gib"  # each run's peak: CPU RSS or GPU peak allocated

# ---- the metric columns of TensorBoard's HPARAMS tab, read from the scalars above -----------------------------------
# The same columns for every run (TensorBoard takes them from one run's hparams); a run without a scaler leaves the
# amp/ cells empty, and its `loss_scaling` column says False; a classifier leaves the causal-LM cells empty.
HPARAM_METRICS = [
    EVAL_ACCURACY,
    EVAL_F1,
    EVAL_LOSS,
    EVAL_PERPLEXITY,
    EVAL_EXACT_MATCH,
    RUN_SAMPLES_PER_SEC,
    AMP_SKIPPED_STEPS,
    AMP_LOSS_SCALE,
]
