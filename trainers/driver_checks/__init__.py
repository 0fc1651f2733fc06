"""What the driver checks before it takes a lease or starts Ray: pre-flight (storage, datasets,
model, a resume's checkpoint) and TPU slices by name."""
