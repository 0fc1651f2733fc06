"""What one training step is made of: the objectives (softmax / sigmoid cross-entropy, masked patch
prediction), the device feed, attention kernels, float8 layers, the optimizer, its schedule and the
EMA of the weights."""
