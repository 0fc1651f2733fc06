"""The DeepSpeed engine (GPUs and CPUs): ZeRO, mixed precision, its checkpoint shards."""
