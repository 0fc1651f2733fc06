"""The torch-xla engine (TPU slices; the CPU in tests): one SPMD program over every device."""
