"""Fine-tuning: downstream tasks (GLUE, SQuAD 1.1) and their official metrics."""
