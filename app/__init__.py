"""A fine-tuning app on Hugging Face Accelerate with fp16 mixed precision as a switch, made visible."""
