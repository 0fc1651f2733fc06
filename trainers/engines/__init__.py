"""The engines that run the training step, one folder each (`deepspeed/`, `xla/`), behind one seam
(`seam.py`) and registered by name (`registry.py`)."""
