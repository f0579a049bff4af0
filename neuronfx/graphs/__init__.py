"""Model math (one flat file per HF model_type), per-phase graph functions and backends."""
